//! The HTTP side: `app(state)` builds the router — `POST /v1/chat/completions` and
//! `/v1/completions` (JSON or SSE), `GET /v1/models`, `/health`, `/metrics` — over an
//! [`EngineHandle`](crate::engine::EngineHandle). Every error is OpenAI's error object with
//! its status, 404 and 405 included. Prompts are tokenized on the blocking pool, after a
//! length check that needs no tokenizing, so no prompt holds up the async threads.
//!
//! This file only names the parts, bottom-up: `status` the answers counted by status code,
//! `state` what the handlers share, `answer` a job's events as OpenAI's JSON (one body, or SSE
//! chunks), `handlers` the endpoints, `metrics` the Prometheus text, `router` the router.

pub(crate) mod answer;
pub(crate) mod handlers;
pub(crate) mod metrics;
pub(crate) mod router;
pub(crate) mod state;
pub(crate) mod status;

pub use router::{MAX_BODY, app};
pub use state::AppState;
pub use status::StatusCounts;
