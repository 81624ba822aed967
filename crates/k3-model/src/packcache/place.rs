//! Where the pack cache lives: beside the checkpoint, or in a directory the caller gives where
//! the checkpoint's is read-only; the file is named by the checkpoint's identity.

use std::path::{Path, PathBuf};

/// Where the pack cache is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackCachePlace {
    /// Beside the checkpoint, else in the directory given (k3-serve gives
    /// `$XDG_CACHE_HOME/k3`; the library reads no environment).
    Auto(Option<PathBuf>),
    /// In this directory.
    Dir(PathBuf),
    /// Nowhere: streamed matrices are read as stored.
    Off,
}

impl Default for PackCachePlace {
    fn default() -> Self {
        Self::Auto(None)
    }
}

impl PackCachePlace {
    /// The directories to try, in order, for a checkpoint in `checkpoint_dir` (none: off).
    pub fn dirs(&self, checkpoint_dir: &Path) -> Vec<PathBuf> {
        match self {
            Self::Auto(fallback) => std::iter::once(checkpoint_dir.to_owned())
                .chain(fallback.clone())
                .collect(),
            Self::Dir(dir) => vec![dir.clone()],
            Self::Off => Vec::new(),
        }
    }
}

/// What [`PackCache::open_or_write`] did.
///
/// [`PackCache::open_or_write`]: crate::packcache::PackCache::open_or_write
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A matching file was there.
    Opened,
    /// The file was written (`why`: none was there, or what made the one there stale), in
    /// `seconds`.
    Written {
        /// Why it was written: none was there, or what made the one there stale.
        why: String,
        /// Wall time of the write, in seconds.
        seconds: f64,
    },
}

/// The cache file's name for a checkpoint of `identity`
/// (`model::snapshot::checkpoint_identity`).
pub(crate) fn file_name(identity: u64) -> String {
    format!("k3-packed-{identity:016x}.bin")
}
