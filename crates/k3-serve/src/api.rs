//! The OpenAI-compatible request bodies, their validation into the one type the engine
//! accepts ([`ValidRequest`]), and the error type every handler returns (OpenAI's error
//! object, one status per class). `fields` reads a body into typed fields (a wrong type is a
//! 400 naming the field; unknown fields are listed, not dropped silently), `common` checks
//! the fields both endpoints share, `chat` and `completion` each endpoint's own.

mod chat;
mod common;
mod completion;
mod fields;

pub use chat::{ChatRequest, MAX_TOP_LOGPROBS};
pub use common::{CommonFields, MAX_CACHE_SALT_BYTES, MAX_STOP_BYTES};
pub use completion::{CompletionRequest, MAX_COMPLETION_LOGPROBS};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use k3_model::chat::{Segment, ThinkingEffort};
use k3_model::sampling::SamplingParams;
use serde_json::{Value, json};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// A 400 about one field (`""`: the body as a whole).
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: (!param.is_empty()).then(|| param.into()),
        }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 405 | 408 | 413 | 414 | 415 | 422 | 431 | 505 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16().to_string(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// What a request asks the engine for, checked.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Extra stop tokens.
    pub stop_tokens: Vec<u32>,
    pub stream: bool,
    /// A last stream chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Log-probabilities of the chosen tokens (with `sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// `cache_salt`: with the tenant (the API key), the prompt cache's namespace.
    pub cache_salt: Option<String>,
}

/// The prompt: chat messages rendered with XTML (rendered while validating, so a conversation
/// the template refuses is a 400), or plain text.
#[derive(Debug, Clone)]
pub enum Prompt {
    Chat {
        segments: Vec<Segment>,
        /// How many of the first segments are the system block (tools, thinking effort,
        /// leading system messages), which conversations with the same setup share.
        system_segments: usize,
        thinking: bool,
        /// Whether the output's tool calls are parsed as calls (`tool_choice` other than
        /// `none`); when not, a call the model makes anyway comes back as content.
        tool_calls: bool,
    },
    Text(String),
}

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
    /// When the model started being served, in seconds since the Unix epoch: `/v1/models`'
    /// `created`.
    pub created: u64,
}

impl Limits {
    /// The name responses report: the first of [`Self::model_names`].
    pub fn model_name(&self) -> &str {
        self.model_names
            .first()
            .map_or(crate::naming::FALLBACK_NAME, String::as_str)
    }
}

/// `"a"`, or `"a" (also "b", "c")`.
fn served_as(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    match quoted.split_first() {
        None => String::new(),
        Some((first, [])) => first.clone(),
        Some((first, rest)) => format!("{first} (also {})", rest.join(", ")),
    }
}

/// A seed for a request that gives none: fresh for every request, so two identical unseeded
/// requests at a temperature above 0 differ, as with OpenAI and vLLM. From std's `RandomState`
/// (its keys come from the operating system's random source, once per thread, then advance
/// per instance) over the time and a process-wide counter.
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    hasher.write_u128(now.as_nanos());
    hasher.finish()
}
