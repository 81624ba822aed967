//! Sequential writes of a snapshot file through a 4 KiB-aligned buffer into the engine's
//! atomic file writer ([`AtomicFile`]: `O_DIRECT` while the filesystem takes it, renamed into
//! place whole), checksumming every byte put.

use std::path::{Path, PathBuf};

use expert_store::io::{AlignedBuf, IO_ALIGN};

use crate::io::atomic::{AtomicFile, WriteReport};
use crate::io::checksum::Checksum;

/// Bytes written per `O_DIRECT` write.
pub(super) const WRITE_BLOCK: usize = 4 << 20;

/// Sequential writes through an aligned buffer into an [`AtomicFile`], `O_DIRECT` while the
/// file takes it.
pub(super) struct Writer {
    file: AtomicFile,
    buf: AlignedBuf,
    filled: usize,
    /// Bytes already written to the file.
    offset: u64,
    /// Of every byte put so far.
    pub(super) checksum: Checksum,
}

impl Writer {
    /// A new file for `path`, written in `tmp` beside it (with `O_DIRECT` if `direct` and the
    /// filesystem takes it) and renamed over `path` by [`Self::finish`].
    pub(super) fn create(path: &Path, tmp: PathBuf, direct: bool) -> std::io::Result<Self> {
        Ok(Self {
            file: AtomicFile::create(path, tmp, direct)?,
            buf: AlignedBuf::zeroed(WRITE_BLOCK),
            filled: 0,
            offset: 0,
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
    /// is cut to its real length when committed).
    fn flush(&mut self) -> std::io::Result<()> {
        let data = self.filled;
        let len = if self.file.is_direct() {
            let padded = data.next_multiple_of(IO_ALIGN);
            self.buf[data..padded].fill(0);
            padded
        } else {
            data
        };
        self.file.write_at(&self.buf[..len], self.offset)?;
        self.offset += data as u64;
        self.filled = 0;
        Ok(())
    }

    /// Writes what is left and renames the file into place.
    pub(super) fn finish(mut self) -> std::io::Result<WriteReport> {
        if self.filled > 0 {
            self.flush()?;
        }
        let len = self.offset;
        self.file.commit(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `data` in uneven pieces (bytes and f32s) and returns the file's bytes.
    fn write(path: &Path, direct: bool, data: &[f32]) -> (Vec<u8>, WriteReport, u64) {
        let mut w = Writer::create(path, path.with_extension("tmp"), direct).unwrap();
        w.put(&[7, 8, 9]).unwrap();
        let (a, b) = data.split_at(data.len() / 3);
        w.put_f32s(a).unwrap();
        w.put(&[1]).unwrap();
        w.put_f32s(b).unwrap();
        let sum = w.checksum.finish();
        let report = w.finish().unwrap();
        (std::fs::read(path).unwrap(), report, sum)
    }

    #[test]
    fn direct_and_buffered_writes_give_the_same_file() {
        let dir = std::env::temp_dir().join(format!("k3-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Lengths that end mid-block, on a block and past a whole write buffer.
        for n in [0, 1, IO_ALIGN / 4, WRITE_BLOCK / 4 + 3] {
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut expected = vec![7, 8, 9];
            let (a, b) = data.split_at(n / 3);
            expected.extend(a.iter().flat_map(|v| v.to_le_bytes()));
            expected.push(1);
            expected.extend(b.iter().flat_map(|v| v.to_le_bytes()));
            let mut sum = Checksum::new();
            sum.update(&expected);
            for direct in [true, false] {
                let path = dir.join(format!("{n}-{direct}"));
                let (bytes, report, got_sum) = write(&path, direct, &data);
                assert!(bytes == expected, "{n} values, direct {direct}");
                assert_eq!(report.bytes, expected.len() as u64);
                assert_eq!(got_sum, sum.finish());
                // Asked for buffered: buffered, no fallback to explain.
                if !direct {
                    assert_eq!((report.direct, &report.fallback), (false, &None));
                }
                // Asked for direct: either it was, or the reason is given.
                if direct {
                    assert!(report.direct || report.fallback.is_some(), "{report:?}");
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
