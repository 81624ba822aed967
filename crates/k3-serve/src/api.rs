//! The OpenAI-compatible request bodies, their validation into the one type the engine
//! accepts ([`ValidRequest`]), and the error type every handler returns ([`ApiError`]:
//! OpenAI's error object, one status per class). This file only names the parts, bottom-up:
//! `error` the error, `valid` the validated request, `limits` what validation checks
//! against, `fields` reads a body into typed fields (a wrong type is a 400 naming the field;
//! unknown fields are listed, not dropped silently), `common` checks the fields both
//! endpoints share, `chat` and `completion` each endpoint's own, `structured` what a chat's answer is
//! constrained to.

pub(crate) mod chat;
pub(crate) mod common;
pub(crate) mod completion;
pub(crate) mod error;
mod fields;
pub(crate) mod limits;
pub(crate) mod structured;
pub(crate) mod valid;

pub use chat::{ChatRequest, MAX_TOP_LOGPROBS};
pub use common::{MAX_CACHE_SALT_BYTES, MAX_STOP_BYTES};
pub use completion::{CompletionRequest, MAX_COMPLETION_LOGPROBS};
pub use error::ApiError;
pub use limits::Limits;
pub use structured::OutputConstraint;
pub use valid::{Prompt, ValidRequest};
