//! What a forward pass or a model's load can fail with.

use expert_store::StoreError;
use expert_store::checkpoint::CheckpointError;

/// Errors of model construction and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor is missing, of the wrong shape or format, or unreadable in the checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A kernel refused its operands (a shape the loader should have caught).
    #[error(transparent)]
    Kernel(#[from] mxfp4_kernels::Error),
    /// The worker pool could not start or run a dispatch, or a helper thread stopped; holds
    /// why.
    #[error("worker pool: {0}")]
    Pool(String),
    /// A memory plan that does not match the checkpoint it is applied to.
    #[error("memory plan: {0}")]
    Plan(String),
    /// The pack cache a resident load read from is damaged (a body unlike its checksum), or
    /// could not be read.
    #[error(transparent)]
    PackCache(#[from] crate::packcache::types::PackCacheError),
    /// A token id given to the model is not below `vocab_size`.
    #[error("token {token} is outside the vocabulary of {vocab}")]
    Token {
        /// The token id.
        token: usize,
        /// The config's `vocab_size`.
        vocab: usize,
    },
    /// An expert could not be read: this step fails (the session is then mid-step and must
    /// be reset); the model and other sessions carry on.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A session taken back to a position its checkpoint does not cover
    /// ([`Model::rollback`](crate::model::Model::rollback)); holds why.
    #[error("rollback: {0}")]
    Rollback(String),
    /// A session's context cannot be repeated to the depth asked
    /// ([`Session::repeat_context`](crate::model::Session::repeat_context)); holds why.
    #[error("repeat context: {0}")]
    Repeat(String),
    /// The ranks disagree about a sequence (a mirror of its MLA caches missing or shorter
    /// than rank 0 announced); holds which.
    #[error("ranks: {0}")]
    Ranks(String),
    /// An expert store opened with another layout than the config implies
    /// ([`Model::with_expert_store`](crate::model::Model::with_expert_store)).
    #[error("the expert store's experts are {store}, the config's {config}")]
    StoreLayout {
        /// The store's layout, as it prints.
        store: String,
        /// The config's [`expert_layout`](crate::inventory::expert_layout), as it prints.
        config: String,
    },
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
