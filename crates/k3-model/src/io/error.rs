//! What a bulk read or pack can fail with: the checkpoint's file, or the thread or pool that
//! did the work.

use expert_store::CheckpointError;

/// A failed bulk read or pack.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IoError {
    /// Reading the checkpoint's file failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The I/O thread or the worker pool failed.
    #[error("worker pool: {0}")]
    Pool(String),
}

/// `source` on reading `path` of the checkpoint.
pub(crate) fn checkpoint_io(path: std::path::PathBuf, source: std::io::Error) -> IoError {
    IoError::Checkpoint(CheckpointError::Io { path, source })
}
