//! Sequential writes of a snapshot file through a 4 KiB-aligned buffer, with `O_DIRECT` while
//! the filesystem takes it (buffered, with the reason kept, when it does not), checksumming
//! every byte put.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use expert_store::io::{AlignedBuf, IO_ALIGN, drop_page_cache};

use super::{Checksum, WRITE_BLOCK, WriteReport};

/// Sequential writes through an aligned buffer, `O_DIRECT` while the file takes it.
pub(super) struct Writer {
    file: File,
    path: PathBuf,
    buf: AlignedBuf,
    filled: usize,
    /// Bytes already written to the file.
    offset: u64,
    direct: bool,
    fallback: Option<String>,
    /// Of every byte put so far.
    pub(super) checksum: Checksum,
}

impl Writer {
    pub(super) fn create(path: &Path) -> std::io::Result<Self> {
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        let (file, direct, fallback) = match direct {
            Ok(f) => (f, true, None),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(path)?;
                (f, false, Some(format!("O_DIRECT open refused: {e}")))
            }
        };
        Ok(Self {
            file,
            path: path.to_owned(),
            buf: AlignedBuf::zeroed(WRITE_BLOCK),
            filled: 0,
            offset: 0,
            direct,
            fallback,
            checksum: Checksum::new(),
        })
    }

    pub(super) fn put(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let n = bytes.len().min(WRITE_BLOCK - self.filled);
            self.buf[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.checksum.update(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == WRITE_BLOCK {
                self.flush()?;
            }
        }
        Ok(())
    }

    pub(super) fn put_f32s(&mut self, values: &[f32]) -> std::io::Result<()> {
        let mut values = values;
        while !values.is_empty() {
            let n = values.len().min((WRITE_BLOCK - self.filled) / 4);
            if n == 0 {
                // Fewer than 4 bytes left in the block: go through `put`.
                self.put(&values[0].to_le_bytes())?;
                values = &values[1..];
                continue;
            }
            let dst = &mut self.buf[self.filled..self.filled + n * 4];
            for (d, v) in dst.chunks_exact_mut(4).zip(&values[..n]) {
                d.copy_from_slice(&v.to_le_bytes());
            }
            self.checksum.update(dst);
            self.filled += n * 4;
            values = &values[n..];
            if self.filled == WRITE_BLOCK {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Writes the buffer's `filled` bytes (padded to whole blocks under `O_DIRECT`; the file
    /// is cut to its real length at the end).
    fn flush(&mut self) -> std::io::Result<()> {
        let data = self.filled;
        let len = if self.direct {
            let padded = data.next_multiple_of(IO_ALIGN);
            self.buf[data..padded].fill(0);
            padded
        } else {
            data
        };
        if self.direct {
            match self.file.write_all_at(&self.buf[..len], self.offset) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // Opened with O_DIRECT but the write is refused: buffered from here on.
                    self.file = std::fs::OpenOptions::new().write(true).open(&self.path)?;
                    self.direct = false;
                    self.fallback = Some(format!("O_DIRECT write refused: {e}"));
                    self.file.write_all_at(&self.buf[..data], self.offset)?;
                }
                result => result?,
            }
        } else {
            self.file.write_all_at(&self.buf[..data], self.offset)?;
        }
        self.offset += data as u64;
        self.filled = 0;
        Ok(())
    }

    pub(super) fn finish(mut self) -> std::io::Result<WriteReport> {
        if self.filled > 0 {
            self.flush()?;
        }
        self.file.set_len(self.offset)?;
        self.file.sync_all()?;
        if !self.direct {
            let _ = drop_page_cache(&self.file, 0, self.offset);
        }
        Ok(WriteReport {
            bytes: self.offset,
            direct: self.direct,
            fallback: self.fallback,
        })
    }
}
