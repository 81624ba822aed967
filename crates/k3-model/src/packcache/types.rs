//! The pack cache's types: a cache file opened, the matrices it holds, what can go wrong.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::io::error::IoError;

/// One matrix the cache holds.
#[derive(Debug)]
pub struct PackedTensor {
    /// The matrix's name as stored in the checkpoint.
    pub name: String,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix (a multiple of 32).
    pub cols: usize,
    /// How its body holds it ([`crate::plan::PackAs::code`]): 0 packed BF16 (rows of
    /// `packed_body_bytes(1, cols)` bytes), 1 Q8_0 blocks, 2 MXFP4 codes then scales.
    pub format: u32,
    /// Where its body starts in the file.
    pub body: usize,
    /// The checksum of its body's bytes ([`crate::io::checksum`]), checked as it is first
    /// read ([`PackCache::verify`]).
    pub sum: u64,
    /// Its exception blocks (BF16, [`EXCEPTION_BYTES`] each), and per row the index of its
    /// first one (`rows + 1` entries).
    ///
    /// [`EXCEPTION_BYTES`]: mxfp4_kernels::packed::EXCEPTION_BYTES
    pub exceptions: Vec<u8>,
    /// Per row the index of its first exception block, and the total last: row `r`'s blocks are
    /// `row_exceptions[r]..row_exceptions[r + 1]`.
    pub row_exceptions: Vec<u32>,
}

impl PackedTensor {
    /// Bytes of its body.
    pub fn body_bytes(&self) -> usize {
        match self.format {
            1 => crate::plan::QuantFormat::Q8_0.bytes(self.rows, self.cols),
            2 => crate::plan::QuantFormat::MxFp4.bytes(self.rows, self.cols),
            _ => mxfp4_kernels::packed::packed_body_bytes(self.rows, self.cols),
        }
    }

    /// Bytes held in memory for it: exception blocks and row index.
    pub(super) fn side_bytes(&self) -> u64 {
        (self.exceptions.len() + 4 * self.row_exceptions.len()) as u64
    }
}

/// An opened pack cache.
#[derive(Debug)]
pub struct PackCache {
    pub(super) path: PathBuf,
    pub(super) tensors: Vec<PackedTensor>,
    pub(super) by_name: HashMap<String, usize>,
}

/// Why a cache could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum PackCacheError {
    /// Creating, writing, syncing, renaming or reading the cache file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The directory's filesystem has too little free space for the file.
    #[error(
        "{}: {} free, the pack cache needs {}",
        dir.display(),
        crate::units::gb(*free),
        crate::units::gb(*needed)
    )]
    Space {
        /// The directory.
        dir: PathBuf,
        /// Bytes free there.
        free: u64,
        /// Bytes the file needs: its bodies, a bound on its manifest, and some slack.
        needed: u64,
    },
    /// A matrix's body does not match its checksum: the file is damaged (and must not be
    /// used; the build writes it again).
    #[error("{}: the body of {tensor} does not match its checksum (the file is damaged)", path.display())]
    Damaged {
        /// The cache file.
        path: PathBuf,
        /// The matrix whose body was found changed.
        tensor: String,
    },
    /// Reading the checkpoint's rows, or packing them on the pool, failed.
    #[error(transparent)]
    Checkpoint(#[from] expert_store::CheckpointError),
    /// The packing reader's thread or the worker pool failed; holds why.
    #[error("worker pool: {0}")]
    Pool(String),
}

impl From<IoError> for PackCacheError {
    fn from(e: IoError) -> Self {
        match e {
            IoError::Checkpoint(e) => PackCacheError::Checkpoint(e),
            IoError::Pool(why) => PackCacheError::Pool(why),
        }
    }
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackCacheError + '_ {
    move |source| PackCacheError::Io {
        path: path.to_owned(),
        source,
    }
}
