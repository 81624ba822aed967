//! The engine thread: it owns the model, admits jobs from a bounded queue (`queue`: a job
//! whose client went away leaves it at once), and advances every active sequence in steps:
//! each step is one forward pass (`Model::step`) over every decoding sequence's next token and
//! chunks of the prompts being prefilled, within a token budget (`schedule`), so a long
//! prompt advances chunk by chunk while the other streams keep producing tokens, and the
//! weights are read once a step for all of them. The pass is batch-invariant: a sequence's
//! tokens do not depend on who shares its steps or how its prompt is cut. Each job's events go
//! to its own channel; a closed channel (the client went away) cancels the job at the next
//! step boundary, mid-prefill too.
//!
//! A panic in one job's admission or sampling fails that job with an error event and the
//! engine carries on; a panic in a step fails the jobs in that step. The load's outcome is reported once ([`EngineHandle::wait_loaded`]), and `alive`
//! falls when the thread ends for any reason, so nothing waits on a dead engine.
//!
//! A job whose prompt extends a prefix in the prompt cache resumes from its snapshot and
//! prefills only the rest (`cache`); snapshots are kept at the end of each prompt, of each
//! answer, and of a chat's system block.
//!
//! This file only names the parts, bottom-up: `prompt` a request's prompt as tokens, `state`
//! the one-shot run's state files, `cache` the prompt cache's use, `job` a request for the
//! engine and its events, `metrics` the counters, `config` the setup, `queue` the admission
//! queue, `constrain` a sequence's output constraint, `sequence` one job in flight, `schedule` what a step feeds, `run` the thread's loop (the engine is assembled by
//! `k3_model::builder`), `handle` the server's side and the thread's start.

pub(crate) mod cache;
pub(crate) mod config;
pub(crate) mod constrain;
pub(crate) mod handle;
pub(crate) mod job;
pub(crate) mod metrics;
pub(crate) mod prompt;
pub(crate) mod queue;
mod run;
mod schedule;
mod sequence;
pub(crate) mod speculate;
pub(crate) mod state;

pub use cache::PromptCacheOptions;
pub use config::EngineConfig;
pub use handle::{EngineHandle, spawn, wait_ready};
pub use job::{Event, Job, TokenLogprob, TopLogprob};
pub use metrics::{BUCKETS, Histogram, Metrics};
pub use prompt::{
    encode_prompt, encode_segments, encode_split, prompt_ids, prompt_segments, system_segments,
};
pub use queue::SubmitError;
pub use speculate::SpecOptions;
pub use state::StateFiles;
