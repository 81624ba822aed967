//! The engine thread: it owns the model, admits jobs from a bounded queue (`queue`: a job
//! whose client went away leaves it at once), prefills each on
//! its own, and advances every active sequence together, one token per decode step
//! (continuous batching through `Model::decode_batch`, so a sequence's tokens do not depend on
//! who shares its steps). Each job's events go to its own channel; a closed channel (the
//! client went away) cancels the job at the next step.
//!
//! A panic in one job's work (its prefill, sampling, or output) fails that job with an error
//! event and the engine carries on; a panic in a batched decode step fails the jobs in that
//! step. The load's outcome is reported once ([`EngineHandle::wait_loaded`]), and `alive`
//! falls when the thread ends for any reason, so nothing waits on a dead engine.
//!
//! A job whose prompt extends a prefix in the prompt cache resumes from its snapshot and
//! prefills only the rest (`cache`); snapshots are kept at the end of each prompt, of each
//! answer, and of a chat's system block.
//!
//! This file holds the types the server sees and the thread's start; `run` the thread's loop
//! (the engine is assembled by `k3_model::builder`), `sequence` one job in flight, `prompt`
//! a request's prompt as tokens, `cache` the prompt cache's use.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use expert_store::StoreStats;
use k3_model::builder::EngineOptions;
use k3_model::chat::ToolCall;
use k3_model::config::K3Config;
use k3_model::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::ValidRequest;
use crate::prompt_cache::{Namespace, PromptCacheStats};

mod cache;
mod prompt;
mod queue;
mod run;
mod sequence;
mod state;

use queue::JobQueue;
pub use queue::SubmitError;

pub use cache::PromptCacheOptions;
pub use prompt::{
    encode_segments, encode_split, min_prompt_tokens, prompt_ids, prompt_segments, system_segments,
};
pub use state::StateFiles;

/// How the engine is set up (from the CLI).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_dir: PathBuf,
    /// What the engine is built with (`k3_model::builder`): kernels, pool, experts, resident
    /// trunk, `--scan`; its `max_batch` is the most sequences advanced together, its `ctx` the
    /// tokens a sequence may hold (prompt and completion).
    pub options: EngineOptions,
    /// Jobs waiting for a slot at most (more are refused: 429).
    pub queue: usize,
    pub prefill_chunk: usize,
    /// The prompt cache (off when its budget is 0).
    pub prompt_cache: PromptCacheOptions,
    /// Fault injection for tests: a text prompt equal to `.0` panics in its sampling step
    /// once `.1` tokens have been generated (0: right after its prefill). `None` in use.
    #[doc(hidden)]
    pub panic_on_prompt: Option<(String, usize)>,
    /// Test hook: a job whose prompt tokens are exactly `.0` answers `.1` (each token forced
    /// in turn, with its log-probability under the logits; sampling resumes if the script
    /// runs out first), so tests can drive the output parser and the prompt cache with a
    /// known answer on a random model. Empty in use.
    #[doc(hidden)]
    pub scripted_answers: Vec<(Vec<u32>, Vec<u32>)>,
}

/// A chosen token's text and log-probability, with the top alternatives'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What a job sends back.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New output: reasoning and content text, completed tool calls, and the chosen tokens'
    /// log-probabilities (token text, logprob, top alternatives) when asked.
    Delta {
        reasoning: String,
        content: String,
        tool_calls: Vec<ToolCall>,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens restored from the prompt cache instead of prefilled.
        cached_tokens: usize,
        /// Wall time of the prefill, and from its end to the last token.
        prefill: Duration,
        decode: Duration,
    },
    Error(String),
}

/// A request for the engine: checked, tokenized, with its reply channel.
#[derive(Debug)]
pub struct Job {
    pub request: ValidRequest,
    pub prompt_ids: Vec<u32>,
    /// How many of the first prompt tokens are a chat's system block (0: none known): the
    /// engine keeps a snapshot there for other conversations with the same system block.
    pub system_tokens: usize,
    /// The prompt cache's namespace: the job resumes only from, and leaves snapshots only
    /// for, requests of the same namespace (the server's: the tenant and `cache_salt`).
    pub cache_namespace: Namespace,
    pub events: UnboundedSender<Event>,
    /// The request's id for the one info line logged when it ends (prompt and output token
    /// counts, time to first token, tokens/s, how it ended; never the prompt's text). `None`:
    /// no line (the one-shot run prints its own).
    pub log_id: Option<String>,
    /// When the request arrived: the time to first token counts from here.
    pub submitted: Instant,
    /// The one-shot run's `--load-state` / `--save-state` (the server's requests: none).
    pub state: StateFiles,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Live jobs waiting for a batch slot (kept by the queue).
    pub queue_depth: Arc<AtomicI64>,
    pub active: AtomicI64,
    /// Nanoseconds spent in decode steps (tokens/s = generated / this).
    pub decode_ns: AtomicU64,
    pub store: Mutex<Option<StoreStats>>,
    /// The prompt cache's counters (`None`: the cache is off).
    pub prompt_cache: Mutex<Option<PromptCacheStats>>,
}

/// The server's side of the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    /// The queue closes when the last clone of the handle is gone.
    jobs: Arc<queue::Sender>,
    /// The model is loaded and the engine serves.
    pub ready: Arc<AtomicBool>,
    /// The engine thread runs (false once it has ended: a failed load, a panic outside any
    /// one job's work, or shutdown).
    pub alive: Arc<AtomicBool>,
    load: Arc<LoadOutcome>,
    pub metrics: Arc<Metrics>,
    pub tokenizer: Arc<Tokenizer>,
    pub config: Arc<K3Config>,
    /// `max_position_embeddings` of `config.json`, where it gives one.
    pub max_positions: Option<usize>,
}

/// The load's outcome, set once, and waited on.
#[derive(Debug, Default)]
struct LoadOutcome {
    outcome: Mutex<Option<Result<(), String>>>,
    changed: Condvar,
}

impl LoadOutcome {
    /// Records the outcome unless one is recorded already.
    fn set(&self, outcome: Result<(), String>) {
        let mut slot = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(outcome);
            self.changed.notify_all();
        }
    }
}

/// Marks the engine dead when its thread ends, however it ends.
struct AliveGuard {
    alive: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    load: Arc<LoadOutcome>,
}

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.ready.store(false, Ordering::Release);
        self.alive.store(false, Ordering::Release);
        let why = if std::thread::panicking() {
            "the engine thread panicked while loading the model"
        } else {
            "the engine stopped before the model loaded"
        };
        self.load.set(Err(why.into()));
    }
}

impl EngineHandle {
    /// Queues a job; refuses at once when the queue is full (of jobs whose clients are
    /// still there). Dropping the receiver of the job's events takes it out of the queue.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        let submitted = self.jobs.0.submit(job);
        if submitted == Err(SubmitError::Full) {
            self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        }
        submitted
    }

    /// The jobs waiting for a batch slot now (those whose client went away not counted).
    pub fn queue_depth(&self) -> usize {
        self.jobs.0.depth()
    }

    /// Blocks until the model has loaded (`Ok`) or failed to (`Err`: why), at most
    /// `timeout` (`None`: as long as that takes).
    pub fn wait_loaded(&self, timeout: Option<Duration>) -> Result<(), String> {
        let slot = self.load.outcome.lock().unwrap_or_else(|p| p.into_inner());
        let slot = match timeout {
            Some(timeout) => {
                self.load
                    .changed
                    .wait_timeout_while(slot, timeout, |s| s.is_none())
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => self
                .load
                .changed
                .wait_while(slot, |s| s.is_none())
                .unwrap_or_else(|p| p.into_inner()),
        };
        slot.clone().unwrap_or_else(|| {
            Err(format!(
                "the model did not load within {} s",
                timeout.unwrap_or_default().as_secs_f64()
            ))
        })
    }
}

/// Starts the engine thread; it loads the model there and sets `ready` when it can serve.
/// The tokenizer and config are read here, so requests can be validated meanwhile.
pub fn spawn(config: EngineConfig) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let tokenizer =
        Arc::new(Tokenizer::from_dir(&config.model_dir).context("loading the tokenizer")?);
    let text = std::fs::read_to_string(config.model_dir.join("config.json"))
        .with_context(|| format!("reading {}/config.json", config.model_dir.display()))?;
    let model_config = Arc::new(K3Config::from_json(&text)?);
    let max_positions = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|root| {
            root.get("text_config")
                .and_then(|t| t.get("max_position_embeddings"))
                .or_else(|| root.get("max_position_embeddings"))
                .and_then(serde_json::Value::as_u64)
        })
        .map(|n| n as usize);
    let metrics = Arc::new(Metrics::default());
    let queue = JobQueue::new(config.queue, Arc::clone(&metrics.queue_depth));
    let handle = EngineHandle {
        jobs: Arc::new(queue::Sender(Arc::clone(&queue))),
        ready: Arc::new(AtomicBool::new(false)),
        alive: Arc::new(AtomicBool::new(true)),
        load: Arc::new(LoadOutcome::default()),
        metrics,
        tokenizer: Arc::clone(&tokenizer),
        config: Arc::clone(&model_config),
        max_positions,
    };
    let guard = AliveGuard {
        alive: Arc::clone(&handle.alive),
        ready: Arc::clone(&handle.ready),
        load: Arc::clone(&handle.load),
    };
    let metrics = Arc::clone(&handle.metrics);
    // Deliberately unpinned: the engine thread loads the model and drives the pool; each
    // step's work runs inside `Pool::install` on the pinned workers, not on this thread.
    let thread = std::thread::Builder::new()
        .name("k3-engine".into())
        .spawn(move || {
            let load = Arc::clone(&guard.load);
            let loaded = || {
                guard.ready.store(true, Ordering::Release);
                load.set(Ok(()));
            };
            if let Err(e) = run::run(config, &model_config, &tokenizer, queue, loaded, &metrics) {
                log::error!("engine stopped: {e:#}");
                guard.load.set(Err(format!("{e:#}")));
            }
            drop(guard);
        })?;
    Ok((handle, thread))
}

/// Waits until the engine is ready (for the one-shot CLI and tests); false if the load
/// failed or took longer than `timeout`.
pub fn wait_ready(handle: &EngineHandle, timeout: Duration) -> bool {
    handle.wait_loaded(Some(timeout)).is_ok()
}
