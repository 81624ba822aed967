//! What is wrong with a config, and the limits every size in one is checked against.

/// What is wrong with a config, naming the field (a dotted path from the text config).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("config is not valid JSON: {0}")]
    Json(String),
    #[error("config field {field} is missing")]
    Missing { field: String },
    #[error("config field {field} should be {expected}, found {found}")]
    WrongType {
        field: String,
        expected: &'static str,
        found: String,
    },
    #[error("config field {field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
    #[error("config field {field} = {value} is not supported: {reason}")]
    Unsupported {
        field: String,
        value: String,
        reason: &'static str,
    },
}

pub(super) type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// The largest width, count or length a config may give (K3's largest is the 1,048,576-token
/// `max_position_embeddings`): a bigger value is a damaged file, and refusing it here keeps
/// every tensor size the loader computes far from overflow (two such factors fit in 2^48).
pub const MAX_DIM: usize = 1 << 24;

/// The largest `vocab_size` (token ids are `u32`; K3 has 163,840).
pub const MAX_VOCAB: usize = 1 << 24;

/// The most elements a tensor or state derived from three config factors may have.
pub(super) const MAX_ELEMENTS: u128 = 1 << 40;
