//! Where a checkpoint's tensor bytes live: the mapped shard files, each tensor's entry (shard,
//! dtype, shape, byte range), the resident copy; and [`TensorRef`], a tensor handed out.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::Dtype;

/// A tensor found in a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// The name as stored (with the prefix, if the checkpoint has one).
    pub name: &'a str,
    /// The shard that holds it.
    pub path: &'a Path,
    /// Its dtype, from the header.
    pub dtype: Dtype,
    /// Its shape, from the header.
    pub shape: &'a [usize],
    /// Its first byte's offset in the file.
    pub offset: usize,
    /// Its bytes: in the file mapping, or in the resident copy ([`Checkpoint::make_resident`]).
    ///
    /// [`Checkpoint::make_resident`]: crate::Checkpoint::make_resident
    pub bytes: &'a [u8],
}

/// One mapped file.
#[derive(Debug)]
pub(super) struct Shard {
    pub(super) path: PathBuf,
    pub(super) map: Mmap,
}

/// Where a tensor lives: its shard, dtype, shape and absolute byte range in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) shard: usize,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) start: usize,
    pub(super) end: usize,
}

/// Tensors copied out of the file mappings into anonymous memory advised for huge pages.
#[derive(Debug)]
pub(super) struct Resident {
    pub(super) map: Mmap,
    /// Stored name -> byte range in `map`.
    pub(super) ranges: HashMap<String, std::ops::Range<usize>>,
}
