//! What is wrong with a config, and the limits every size in one is checked against.

/// What is wrong with a config, naming the field (a dotted path from the text config).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not JSON; holds serde_json's message.
    #[error("config is not valid JSON: {0}")]
    Json(String),
    /// A field the forward pass needs is in neither `text_config` nor the root.
    #[error("config field {field} is missing")]
    Missing {
        /// Dotted path of the field.
        field: String,
    },
    /// A field holds a JSON value of the wrong kind (a string where a number belongs).
    #[error("config field {field} should be {expected}, found {found}")]
    WrongType {
        /// Dotted path of the field.
        field: String,
        /// What it should be ("a string", "a non-negative integer").
        expected: &'static str,
        /// What it is: a scalar as written, or "a list" / "an object".
        found: String,
    },
    /// A field's value is out of range or contradicts another field.
    #[error("config field {field} is invalid: {reason}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong, with the value and the limit.
        reason: String,
    },
    /// A field's value is valid for the architecture family but not what K3 (and so this
    /// engine) implements, such as a router other than sigmoid.
    #[error("config field {field} = {value} is not supported: {reason}")]
    Unsupported {
        /// Dotted path of the field.
        field: String,
        /// The value found.
        value: String,
        /// What K3 uses instead.
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
