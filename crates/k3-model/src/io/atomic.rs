//! One way the engine writes a file of its own (a snapshot, the pack cache): into a temporary
//! file beside the target, with `O_DIRECT` where the filesystem takes it (buffered otherwise,
//! the reason kept, and the written pages dropped from the page cache after), then cut to its
//! length, synced and renamed over the target, so a reader never sees half a file. A writer
//! dropped before [`AtomicFile::commit`] removes its temporary file.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use expert_store::io::drop_page_cache;

/// How a file was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReport {
    /// Bytes of the file.
    pub bytes: u64,
    /// The data bypassed the page cache (`O_DIRECT`).
    pub direct: bool,
    /// Why it did not, when it was asked to and could not.
    pub fallback: Option<String>,
}

/// A file being written; see the module docs.
#[derive(Debug)]
pub(crate) struct AtomicFile {
    file: File,
    tmp: PathBuf,
    target: PathBuf,
    direct: bool,
    fallback: Option<String>,
    committed: bool,
}

impl AtomicFile {
    /// A new temporary file `tmp` (beside `target`, so the rename is atomic), with `O_DIRECT`
    /// if `direct` and the filesystem takes it. An existing `tmp` is replaced.
    pub(crate) fn create(target: &Path, tmp: PathBuf, direct: bool) -> std::io::Result<Self> {
        let open = |flags: i32| {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(flags)
                .open(&tmp)
        };
        let (file, direct, fallback) = if direct {
            match open(libc::O_DIRECT) {
                Ok(file) => (file, true, None),
                Err(e) => (open(0)?, false, Some(format!("O_DIRECT open refused: {e}"))),
            }
        } else {
            (open(0)?, false, None)
        };
        Ok(Self {
            file,
            tmp,
            target: target.to_owned(),
            direct,
            fallback,
            committed: false,
        })
    }

    /// Whether writes bypass the page cache: then `bytes`, its address and `offset` must be
    /// multiples of `expert_store::io::IO_ALIGN` (an `AlignedBuf` and padded lengths are).
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    /// The temporary file's path.
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Writes `bytes` at `offset`. A filesystem that took the `O_DIRECT` open but refuses the
    /// write gets this and every later write buffered.
    pub(crate) fn write_at(&mut self, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        match self.file.write_all_at(bytes, offset) {
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                self.file = std::fs::OpenOptions::new().write(true).open(&self.tmp)?;
                self.direct = false;
                self.fallback = Some(format!("O_DIRECT write refused: {e}"));
                self.file.write_all_at(bytes, offset)
            }
            result => result,
        }
    }

    /// Cuts the file to `len` bytes (direct writes are padded to whole blocks), syncs it,
    /// renames it over the target and syncs the directory (best effort: not every filesystem
    /// lets a directory be synced).
    pub(crate) fn commit(mut self, len: u64) -> std::io::Result<WriteReport> {
        self.file.set_len(len)?;
        self.file.sync_all()?;
        if !self.direct {
            let _ = drop_page_cache(&self.file, 0, len);
        }
        std::fs::rename(&self.tmp, &self.target)?;
        self.committed = true;
        if let Some(dir) = self.target.parent().filter(|d| !d.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(WriteReport {
            bytes: len,
            direct: self.direct,
            fallback: self.fallback.take(),
        })
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expert_store::io::{AlignedBuf, IO_ALIGN};

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("k3-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A committed file has exactly its bytes at the target and no temporary file is left; a
    /// writer dropped uncommitted leaves the target as it was and removes its file.
    #[test]
    fn a_file_appears_whole_or_not_at_all() {
        let dir = scratch();
        let target = dir.join("out.bin");
        std::fs::write(&target, b"old").unwrap();
        for direct in [true, false] {
            let mut page = AlignedBuf::zeroed(2 * IO_ALIGN);
            page[..5].copy_from_slice(b"hello");
            page[IO_ALIGN..IO_ALIGN + 3].copy_from_slice(b"end");
            let tmp = dir.join(format!("out.bin.tmp-{direct}"));
            let mut file = AtomicFile::create(&target, tmp.clone(), direct).unwrap();
            file.write_at(&page[IO_ALIGN..], IO_ALIGN as u64).unwrap();
            file.write_at(&page[..IO_ALIGN], 0).unwrap();
            let report = file.commit(IO_ALIGN as u64 + 3).unwrap();
            let bytes = std::fs::read(&target).unwrap();
            assert_eq!(bytes.len(), IO_ALIGN + 3);
            assert_eq!(
                (&bytes[..5], &bytes[IO_ALIGN..]),
                (&b"hello"[..], &b"end"[..])
            );
            assert_eq!(report.bytes, IO_ALIGN as u64 + 3);
            assert!(
                report.direct || !direct || report.fallback.is_some(),
                "{report:?}"
            );
            assert!(!tmp.exists());

            let dropped = AtomicFile::create(&target, dir.join("x.tmp"), direct).unwrap();
            assert!(dir.join("x.tmp").exists());
            drop(dropped);
            assert!(!dir.join("x.tmp").exists());
            assert_eq!(std::fs::read(&target).unwrap(), bytes);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
