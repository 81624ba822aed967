//! The OpenAI-compatible request bodies, their validation into the one type the engine
//! accepts ([`ValidRequest`]), and the error type every handler returns (OpenAI's error
//! object, one status per class). `chat` holds the chat request's validation (messages,
//! tools, the template's options, rendering).

mod chat;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use k3_model::chat::{Segment, ThinkingEffort};
use k3_model::sampling::SamplingParams;
use serde::Deserialize;
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

    /// A 400 about one field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
        }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 405 | 408 | 413 | 415 | 422 => "invalid_request_error",
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

/// Stop strings' bytes, all together, at most (400 above): they are matched incrementally, so
/// this bounds memory and the text held back from the client, not time per token.
pub const MAX_STOP_BYTES: usize = 16 << 10;

/// Fields shared by both endpoints (OpenAI names; the extras vLLM and others accept too).
#[derive(Debug, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    /// `null` is `false`, as for every other optional field.
    pub stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk with the usage (streams only).
    pub stream_options: Option<Value>,
    /// `{"token id": bias}`, each bias in [-100, 100].
    pub logit_bias: Option<Value>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    /// Token ids that end generation besides `<|end_of_msg|>` and `[EOS]` (vLLM's name).
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub logprobs: Value,
    pub top_logprobs: Option<i64>,
    pub n: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    /// `{"thinking": false}` turns thinking off (default on); `{"thinking_effort": E}` as the
    /// top-level field.
    pub chat_template_kwargs: Option<Value>,
    /// `low`, `high` or `max` (default: the server's `--thinking-effort`).
    pub thinking_effort: Option<Value>,
    /// `auto`, `none`, `required`; rendered as the chat template does.
    pub tool_choice: Option<Value>,
    /// `text`, `json_object` or `json_schema`; rendered as the chat template does.
    pub response_format: Option<Value>,
    #[serde(flatten)]
    pub common: CommonFields,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    /// Refused unless false: the prompt's log-probabilities are not computed.
    pub echo: Option<bool>,
    /// Refused unless empty: no fill-in-the-middle.
    pub suffix: Option<String>,
    /// Refused above 1, like `n`.
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub common: CommonFields,
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
    /// Log-probabilities of the chosen tokens.
    pub logprobs: bool,
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

/// The checked common fields, waiting for their prompt.
struct Checked {
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    stop_tokens: Vec<u32>,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

impl Checked {
    fn with(self, prompt: Prompt) -> ValidRequest {
        ValidRequest {
            prompt,
            sampling: self.sampling,
            max_tokens: self.max_tokens,
            stop: self.stop,
            stop_tokens: self.stop_tokens,
            stream: self.stream,
            include_usage: self.include_usage,
            logprobs: self.logprobs,
        }
    }
}

impl CommonFields {
    fn validate(&self, limits: &Limits) -> Result<Checked, ApiError> {
        if let Some(model) = &self.model
            && !crate::naming::accepts(&limits.model_names, model)
        {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model {model:?} does not exist; this server serves {}",
                    served_as(&limits.model_names)
                ),
                param: Some("model".into()),
            });
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n", "only n = 1 is supported"));
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => limits.max_tokens_default,
            Some(n) if n >= 1 && (n as usize) < limits.context => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "max_tokens must be between 1 and {}, got {n}",
                        limits.context - 1
                    ),
                ));
            }
        };
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1 or >= 0, got {k}"),
                ));
            }
        };
        let logprobs = match &self.logprobs {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_u64().is_some_and(|n| n > 0),
            other => {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("logprobs must be a boolean, got {other}"),
                ));
            }
        };
        let top_logprobs = match self.top_logprobs {
            None => 0,
            Some(n) if (0..=20).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be in [0, 20], got {n}"),
                ));
            }
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.unwrap_or_else(fresh_seed),
            top_logprobs,
            logit_bias: logit_bias(self.logit_bias.as_ref(), limits.vocab_size)?,
        };
        sampling
            .validate()
            .map_err(|e| ApiError::invalid(e.name, e.to_string()))?;
        let stop = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) if items.len() <= 4 => items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_owned).ok_or_else(|| {
                        ApiError::invalid(
                            "stop",
                            "stop must be a string or a list of up to 4 strings",
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::invalid(
                    "stop",
                    "stop must be a string or a list of up to 4 strings",
                ));
            }
        };
        let stop_bytes: usize = stop.iter().map(String::len).sum();
        if stop_bytes > MAX_STOP_BYTES {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop strings of {stop_bytes} bytes in all exceed the limit of {MAX_STOP_BYTES} bytes"
                ),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = match &self.stream_options {
            None | Some(Value::Null) => false,
            Some(_) if !stream => {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed with stream: true",
                ));
            }
            Some(Value::Object(options)) => {
                if let Some(key) = options.keys().find(|k| *k != "include_usage") {
                    return Err(ApiError::invalid(
                        "stream_options",
                        format!("stream_options.{key} is not supported (only include_usage)"),
                    ));
                }
                match options.get("include_usage") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        return Err(ApiError::invalid(
                            "stream_options",
                            format!("stream_options.include_usage must be a boolean, got {other}"),
                        ));
                    }
                }
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "stream_options",
                    format!("stream_options must be an object, got {other}"),
                ));
            }
        };
        Ok(Checked {
            sampling,
            max_tokens,
            stop,
            stop_tokens: self.stop_token_ids.clone().unwrap_or_default(),
            stream,
            include_usage,
            logprobs,
        })
    }
}

impl CompletionRequest {
    pub fn validate(self, limits: &Limits) -> Result<ValidRequest, ApiError> {
        let checked = self.common.validate(limits)?;
        if self.echo == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "echo is not supported (the prompt's log-probabilities are not computed)",
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "suffix",
                "suffix is not supported (no fill-in-the-middle)",
            ));
        }
        if let Some(best_of) = self.best_of
            && best_of != 1
        {
            return Err(ApiError::invalid(
                "best_of",
                format!("only best_of = 1 is supported, got {best_of}"),
            ));
        }
        let prompt = match self.prompt {
            Value::String(s) => s,
            _ => return Err(ApiError::invalid("prompt", "prompt must be a string")),
        };
        Ok(checked.with(Prompt::Text(prompt)))
    }
}

/// `logit_bias`: an object from token ids (as strings, OpenAI's form) to biases; each id below
/// `vocab_size`, each bias a number in [-100, 100] (the range is checked with the other
/// sampling values).
fn logit_bias(value: Option<&Value>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias must be an object from token ids to numbers, got {other}"),
            ));
        }
    };
    map.iter()
        .map(|(id, bias)| {
            let token = id
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "logit_bias key {id:?} is not a token id below the vocabulary size {vocab_size}"
                        ),
                    )
                })?;
            let bias = bias.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias[{id:?}] must be a number, got {bias}"),
                )
            })?;
            Ok((token, bias as f32))
        })
        .collect()
}
