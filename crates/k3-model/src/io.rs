//! Bulk reading and writing below the model: the checkpoint's rows read in chunks on an I/O
//! thread and packed on the pool (the resident trunk's load and the pack cache's write share
//! them), the checksum of the engine's own files, and one atomic file writer (`O_DIRECT` where
//! the filesystem takes it, renamed into place whole) that the pack cache and the snapshot
//! files both write through.

pub(crate) mod atomic;
pub(crate) mod checksum;
pub(crate) mod chunks;
pub(crate) mod error;
