//! What is wrong with a checkpoint, naming the file and the tensor.

use std::path::PathBuf;

/// What is wrong with a checkpoint, naming the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { path: PathBuf },
    #[error("{path}: bad index: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("{path}: bad safetensors header or data layout: {reason}")]
    Header { path: PathBuf, reason: String },
    #[error("{path}: tensor {tensor} is listed in the index but not in this file")]
    NotInShard { path: PathBuf, tensor: String },
    #[error("tensor {tensor} is stored twice: in {first} and {second}")]
    Duplicate {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("tensor {tensor} is missing")]
    Missing { tensor: String },
    #[error("{path}: tensor {tensor}: expected {expected}, found {found}")]
    Mismatch {
        path: PathBuf,
        tensor: String,
        expected: String,
        found: String,
    },
    #[error("{path}: tensor {tensor}: {source}")]
    View {
        path: PathBuf,
        tensor: String,
        source: mxfp4_kernels::Error,
    },
}

/// The checkpoint's result.
pub(crate) type Result<T, E = CheckpointError> = std::result::Result<T, E>;
