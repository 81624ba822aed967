//! What a forward pass or a model's load can fail with.

use expert_store::StoreError;
use expert_store::checkpoint::CheckpointError;

/// Errors of model construction and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Kernel(#[from] mxfp4_kernels::Error),
    #[error("worker pool: {0}")]
    Pool(String),
    /// A memory plan that does not match the checkpoint it is applied to.
    #[error("memory plan: {0}")]
    Plan(String),
    #[error("token {token} is outside the vocabulary of {vocab}")]
    Token { token: usize, vocab: usize },
    /// An expert could not be read: this step fails (the session is then mid-step and must
    /// be reset); the model and other sessions carry on.
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the expert store's experts are {store}, the config's {config}")]
    StoreLayout { store: String, config: String },
}

pub(super) type Result<T, E = ModelError> = std::result::Result<T, E>;

impl From<crate::io::error::IoError> for ModelError {
    fn from(e: crate::io::error::IoError) -> Self {
        match e {
            crate::io::error::IoError::Checkpoint(e) => ModelError::Checkpoint(e),
            crate::io::error::IoError::Pool(why) => ModelError::Pool(why),
        }
    }
}
