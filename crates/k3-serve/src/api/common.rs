//! The fields both endpoints share (sampling, limits, stops, streaming, `cache_salt`) and their
//! checks; each endpoint adds its own fields (the prompt, the log-probabilities in its shape).

use axum::http::StatusCode;
use k3_model::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::limits::Limits;
use super::valid::{Prompt, ValidRequest};
use crate::naming::accepts;

/// Stop strings' bytes, all together, at most (400 above): they are matched incrementally, so
/// this bounds memory and the text held back from the client, not time per token.
pub const MAX_STOP_BYTES: usize = 16 << 10;

/// `cache_salt`'s bytes at most.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// Fields shared by both endpoints (OpenAI names; the extras vLLM and others accept too).
#[derive(Debug, Deserialize)]
pub(crate) struct CommonFields {
    model: Option<String>,
    /// `null` is `false`, as for every other optional field.
    stream: Option<bool>,
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
    pub n: Option<i64>,
    /// Namespaces the prompt cache within the tenant (vLLM's name): only requests with the
    /// same API key and the same salt share cached prefixes.
    pub cache_salt: Option<String>,
    /// `false` turns speculative decoding off for this request (it never changes the output,
    /// only how many tokens a pass verifies; on by default where the server has `--spec`).
    pub speculative: Option<bool>,
}

/// Log-probabilities as an endpoint asks for them: whether, and how many alternatives.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Logprobs {
    pub(super) on: bool,
    pub(super) top: usize,
}

/// The checked common fields, waiting for their prompt.
#[derive(Debug)]
pub(super) struct Checked {
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    stop_tokens: Vec<u32>,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    cache_salt: Option<String>,
    speculative: bool,
}

impl Checked {
    pub(super) fn with(self, prompt: Prompt) -> ValidRequest {
        ValidRequest {
            prompt,
            sampling: self.sampling,
            max_tokens: self.max_tokens,
            stop: self.stop,
            stop_tokens: self.stop_tokens,
            stream: self.stream,
            include_usage: self.include_usage,
            logprobs: self.logprobs,
            cache_salt: self.cache_salt,
            constraint: None,
            speculative: self.speculative,
        }
    }
}

impl CommonFields {
    pub(super) fn validate(
        &self,
        limits: &Limits,
        logprobs: Logprobs,
    ) -> Result<Checked, ApiError> {
        if let Some(model) = &self.model
            && !accepts(&limits.model_names, model)
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
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.unwrap_or_else(fresh_seed),
            top_logprobs: logprobs.top,
            logit_bias: logit_bias(self.logit_bias.as_ref(), limits.vocab_size)?,
        };
        sampling
            .validate()
            .map_err(|e| ApiError::invalid(e.name, e.to_string()))?;
        let stop = self.stops()?;
        let stream = self.stream.unwrap_or(false);
        let include_usage = self.include_usage(stream)?;
        let cache_salt = match &self.cache_salt {
            None => None,
            Some(salt) if salt.is_empty() => {
                return Err(ApiError::invalid(
                    "cache_salt",
                    "cache_salt must be a non-empty string when given",
                ));
            }
            Some(salt) if salt.len() > MAX_CACHE_SALT_BYTES => {
                return Err(ApiError::invalid(
                    "cache_salt",
                    format!(
                        "cache_salt of {} bytes exceeds the limit of {MAX_CACHE_SALT_BYTES} bytes",
                        salt.len()
                    ),
                ));
            }
            Some(salt) => Some(salt.clone()),
        };
        Ok(Checked {
            sampling,
            max_tokens,
            stop,
            stop_tokens: self.stop_token_ids.clone().unwrap_or_default(),
            stream,
            include_usage,
            logprobs: logprobs.on,
            cache_salt,
            speculative: self.speculative.unwrap_or(true),
        })
    }

    /// `stop`: a string or a list of up to 4, together at most [`MAX_STOP_BYTES`].
    fn stops(&self) -> Result<Vec<String>, ApiError> {
        let bad =
            || ApiError::invalid("stop", "stop must be a string or a list of up to 4 strings");
        let stop = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) if items.len() <= 4 => items
                .iter()
                .map(|v| v.as_str().map(str::to_owned).ok_or_else(bad))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(bad()),
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
        Ok(stop)
    }

    /// `stream_options.include_usage` (only with `stream: true`).
    fn include_usage(&self, stream: bool) -> Result<bool, ApiError> {
        match &self.stream_options {
            None | Some(Value::Null) => Ok(false),
            Some(_) if !stream => Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed with stream: true",
            )),
            Some(Value::Object(options)) => {
                if let Some(key) = options.keys().find(|k| *k != "include_usage") {
                    return Err(ApiError::invalid(
                        "stream_options",
                        format!("stream_options.{key} is not supported (only include_usage)"),
                    ));
                }
                match options.get("include_usage") {
                    None | Some(Value::Null) => Ok(false),
                    Some(Value::Bool(b)) => Ok(*b),
                    Some(other) => Err(ApiError::invalid(
                        "stream_options",
                        format!("stream_options.include_usage must be a boolean, got {other}"),
                    )),
                }
            }
            Some(other) => Err(ApiError::invalid(
                "stream_options",
                format!("stream_options must be an object, got {other}"),
            )),
        }
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
fn fresh_seed() -> u64 {
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
