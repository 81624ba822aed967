//! What is wrong with a checkpoint, naming the file and the tensor.

use std::path::PathBuf;

use crate::file::ReadFileError;

/// What is wrong with a checkpoint, naming the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be opened, mapped or read.
    #[error("{path}: {source}")]
    Io {
        /// The file (or the checkpoint directory, for an anonymous mapping).
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The index or a shard is not a regular file (a FIFO, a device, ...), or the index is
    /// over its cap or not text (a failure to open or read is [`CheckpointError::Io`]).
    #[error(transparent)]
    File(ReadFileError),
    /// The directory holds neither weight file.
    #[error("{path}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights {
        /// The directory.
        path: PathBuf,
    },
    /// `model.safetensors.index.json` is not a valid index.
    #[error("{path}: bad index: {reason}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A shard's header does not parse, or its data ranges do not tile the file.
    #[error("{path}: bad safetensors header or data layout: {reason}")]
    Header {
        /// The shard.
        path: PathBuf,
        /// The `safetensors` crate's words.
        reason: String,
    },
    /// The index places a tensor in a shard that does not hold it.
    #[error("{path}: tensor {tensor} is listed in the index but not in this file")]
    NotInShard {
        /// The shard the index names.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// Two shards hold a tensor of the same name.
    #[error("tensor {tensor} is stored twice: in {first} and {second}")]
    Duplicate {
        /// The tensor.
        tensor: String,
        /// The shard met first.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// A tensor asked for is in no shard.
    #[error("tensor {tensor} is missing")]
    Missing {
        /// Its name as it would be stored (with the prefix, where the checkpoint has one).
        tensor: String,
    },
    /// A tensor has another dtype or shape than the caller expects.
    #[error("{path}: tensor {tensor}: expected {expected}, found {found}")]
    Mismatch {
        /// Its shard.
        path: PathBuf,
        /// Its stored name.
        tensor: String,
        /// What the caller expects (formats and shape).
        expected: String,
        /// What the header says.
        found: String,
    },
    /// A tensor's bytes do not make the kernels' view (a bad E8M0 scale, a length).
    #[error("{path}: tensor {tensor}: {source}")]
    View {
        /// Its shard.
        path: PathBuf,
        /// Its stored name.
        tensor: String,
        /// The kernels' check that failed.
        source: mxfp4_kernels::Error,
    },
}

impl From<ReadFileError> for CheckpointError {
    fn from(e: ReadFileError) -> Self {
        match e {
            ReadFileError::Io { path, source } => CheckpointError::Io { path, source },
            other => CheckpointError::File(other),
        }
    }
}

/// The checkpoint's result.
pub(crate) type Result<T, E = CheckpointError> = std::result::Result<T, E>;
