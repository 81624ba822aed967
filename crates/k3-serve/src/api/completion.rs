//! `POST /v1/completions`: a plain-text prompt or one of token ids, and log-probabilities asked
//! for as OpenAI's completions API does (`logprobs: N`, the chosen token and N alternatives, N from 0 to 5).

use serde::Deserialize;
use serde_json::Value;

use super::common::{CommonFields, Logprobs};
use super::error::ApiError;
use super::fields::{field_names, object, typed, unknown};
use super::limits::Limits;
use super::valid::{Prompt, ValidRequest};

/// The most alternatives a completions request may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// The completions endpoint's own fields.
#[derive(Debug, Deserialize)]
struct CompletionFields {
    prompt: Value,
    /// Refused unless false: the prompt's log-probabilities are not computed.
    echo: Option<bool>,
    /// Refused unless empty: no fill-in-the-middle.
    suffix: Option<String>,
    /// Refused above 1, like `n`.
    best_of: Option<i64>,
    /// An integer from 0 to [`MAX_COMPLETION_LOGPROBS`].
    logprobs: Option<Value>,
}

/// `POST /v1/completions`, read from its JSON body.
#[derive(Debug)]
pub struct CompletionRequest {
    fields: CompletionFields,
    common: CommonFields,
    ignored: Vec<String>,
}

impl CompletionRequest {
    /// The request in `body`: a field of the wrong type is a 400 naming it; fields this
    /// server does not read are kept in [`Self::ignored`].
    pub fn from_json(body: &Value) -> Result<Self, ApiError> {
        let map = object(body)?;
        Ok(Self {
            fields: typed(body)?,
            common: typed(body)?,
            ignored: unknown(
                map,
                &[
                    field_names::<CompletionFields>(),
                    field_names::<CommonFields>(),
                ],
            ),
        })
    }

    /// The top-level fields of the body that this server does not read, in the body's order.
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }

    /// Checks the request against `limits`: the request the engine takes (its prompt plain
    /// text), or the 400 (404 for an unknown `model`) naming the field.
    pub fn validate(self, limits: &Limits) -> Result<ValidRequest, ApiError> {
        let fields = self.fields;
        let logprobs = match &fields.logprobs {
            None | Some(Value::Null) => Logprobs::default(),
            Some(value) => match value.as_u64() {
                Some(n) if n <= MAX_COMPLETION_LOGPROBS => Logprobs {
                    on: true,
                    top: n as usize,
                },
                _ => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!(
                            "logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} (the \
                             alternatives returned beside each chosen token), got {value}"
                        ),
                    ));
                }
            },
        };
        let checked = self.common.validate(limits, logprobs)?;
        if fields.echo == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "echo is not supported (the prompt's log-probabilities are not computed)",
            ));
        }
        if fields.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "suffix",
                "suffix is not supported (no fill-in-the-middle)",
            ));
        }
        if let Some(best_of) = fields.best_of
            && best_of != 1
        {
            return Err(ApiError::invalid(
                "best_of",
                format!("only best_of = 1 is supported, got {best_of}"),
            ));
        }
        let prompt = match fields.prompt {
            Value::String(s) => Prompt::Text(s),
            Value::Array(items) => Prompt::Tokens(token_ids(&items, limits.vocab_size)?),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "prompt must be a string or an array of token ids",
                ));
            }
        };
        Ok(checked.with(prompt))
    }
}

/// A prompt given as token ids: a non-empty array of integers below the vocabulary's size. An
/// array of strings or of arrays (OpenAI's several prompts in one request) is refused: one
/// prompt per request.
fn token_ids(items: &[Value], vocab: usize) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "prompt is an empty array: give a string or at least one token id",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            Some(id) => Err(ApiError::invalid(
                "prompt",
                format!("prompt[{i}] is token id {id}, outside the vocabulary of {vocab}"),
            )),
            None if item.is_string() || item.is_array() => Err(ApiError::invalid(
                "prompt",
                "one prompt per request: prompt is a string or an array of token ids, not a \
                 list of prompts",
            )),
            None => Err(ApiError::invalid(
                "prompt",
                format!("prompt[{i}] is {item}, not a token id (an integer from 0)"),
            )),
        })
        .collect()
}

impl<'de> Deserialize<'de> for CompletionRequest {
    /// Through [`CompletionRequest::from_json`]; its error's message becomes serde's.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let body = Value::deserialize(deserializer)?;
        Self::from_json(&body).map_err(|e| serde::de::Error::custom(e.message))
    }
}
