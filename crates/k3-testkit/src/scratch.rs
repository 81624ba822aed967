//! [`Scratch`]: a fresh directory for one test, removed on drop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, empty directory under the temporary directory, removed with everything in it when
/// this drops (also when the test panics).
///
/// Named `k3-{tag}-{process id}-{n}`, `n` counting the directories this process made: tests
/// of one binary run on parallel threads and the same test binary may run twice at once, so
/// neither shares a directory with another.
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// A fresh directory for `tag` (what the test is, for a reader of `/tmp`). Panics when it
    /// cannot be made: a test has nothing to do without it.
    pub fn new(tag: &str) -> Self {
        match Self::try_new(tag) {
            Ok(scratch) => scratch,
            Err(e) => panic!("cannot make a scratch directory for {tag}: {e}"),
        }
    }

    /// As [`Scratch::new`], returning the error instead of panicking (for tools, which
    /// report it).
    pub fn try_new(tag: &str) -> std::io::Result<Self> {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("k3-{tag}-{}-{n}", std::process::id()));
        // A directory of the same name left by an earlier process with this id.
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::Scratch;

    #[test]
    fn each_scratch_is_fresh_and_removed_on_drop() {
        let a = Scratch::new("testkit");
        let b = Scratch::new("testkit");
        assert_ne!(a.path(), b.path());
        assert!(a.path().is_dir());
        assert_eq!(std::fs::read_dir(a.path()).unwrap().count(), 0);
        std::fs::create_dir(a.path().join("nested")).unwrap();
        std::fs::write(a.path().join("nested/file"), b"x").unwrap();
        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists());
        assert!(b.path().is_dir());
    }
}
