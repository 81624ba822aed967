//! The server's side of validation: what a request is checked against and what it gets when it
//! leaves a field out ([`Limits`]).

use k3_model::chat::ThinkingEffort;

use crate::naming::FALLBACK_NAME;

/// Limits the validation checks against, and the server's defaults for what a request leaves
/// out.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The names a request's `model` may give (see [`crate::naming::served_names`]); the
    /// first is the one reported. Never empty.
    pub model_names: Vec<String>,
    /// `max_tokens` when a request gives none (`--max-tokens`).
    pub max_tokens_default: usize,
    /// The context: prompt plus generated tokens.
    pub context: usize,
    /// The chat requests' `thinking_effort` when they give none.
    pub thinking_effort: ThinkingEffort,
    /// Whether a chat request thinks when its `chat_template_kwargs` does not say (on unless
    /// `--no-think`).
    pub thinking: bool,
    /// Token ids are below this (`logit_bias` keys).
    pub vocab_size: usize,
    /// How long a request's output constraint may take to compile (`--max-constraint-compile-ms`).
    pub max_compile: std::time::Duration,
    /// How long one token's output-constraint mask may take (`--max-mask-ms`).
    pub max_mask: std::time::Duration,
    /// When the model started being served, in seconds since the Unix epoch: `/v1/models`'
    /// `created`.
    pub created: u64,
}

impl Limits {
    /// The name responses report: the first of [`Self::model_names`].
    pub fn model_name(&self) -> &str {
        self.model_names
            .first()
            .map_or(FALLBACK_NAME, String::as_str)
    }
}
