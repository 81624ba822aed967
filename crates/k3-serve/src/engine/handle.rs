//! The server's side of the engine ([`EngineHandle`]) and the thread's start ([`spawn`]): the
//! tokenizer and config are read before the thread starts, so requests can be validated while
//! the model loads; the load's outcome is reported once, and `alive` falls when the thread
//! ends for any reason.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use k3_model::config::K3Config;
use k3_model::tokenizer::Tokenizer;
use k3_structured::{Grammar, Vocabulary};

use super::config::EngineConfig;
use super::constrain::compile_constraint;
use super::job::Job;
use super::metrics::Metrics;
use super::queue::{JobQueue, Sender, SubmitError};
use super::run::run;
use crate::api::error::ApiError;
use crate::api::limits::Limits;
use crate::api::structured::OutputConstraint;

/// The server's side of the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    /// The queue closes when the last clone of the handle is gone.
    jobs: Arc<Sender>,
    /// The model is loaded and the engine serves.
    pub ready: Arc<AtomicBool>,
    /// The engine thread runs (false once it has ended: a failed load, a panic outside any
    /// one job's work, or shutdown).
    pub alive: Arc<AtomicBool>,
    load: Arc<LoadOutcome>,
    /// The counters `/metrics` shows.
    pub metrics: Arc<Metrics>,
    /// The checkpoint's tokenizer, read before the model loads (requests are tokenized on
    /// the server's side).
    pub tokenizer: Arc<Tokenizer>,
    /// The checkpoint's `config.json`.
    pub config: Arc<K3Config>,
    /// `max_position_embeddings` of `config.json`, where it gives one.
    pub max_positions: Option<usize>,
    /// The tokenizer's vocabulary as output constraints need it (a token trie), built by
    /// the first constrained request (or the failure to build it, kept).
    vocabulary: Arc<OnceLock<Result<Arc<Vocabulary>, String>>>,
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
    /// The vocabulary output constraints are compiled against: built once, on first use
    /// (call it off the async runtime: it walks every token of the tokenizer).
    pub fn vocabulary(&self) -> Result<Arc<Vocabulary>, String> {
        self.vocabulary
            .get_or_init(|| {
                Vocabulary::new(&self.tokenizer, self.config.vocab_size)
                    .map_err(|e| format!("building the token trie for output constraints: {e}"))
            })
            .clone()
    }

    /// Compiles a request's output constraint against [`Self::vocabulary`] within `limits`
    /// (on the caller's thread: the handlers' blocking pool, or the one-shot run before the
    /// model has loaded): a 400 naming the field the library refuses, a 500 if the
    /// vocabulary cannot be built.
    pub fn compile_constraint(
        &self,
        constraint: &OutputConstraint,
        limits: &Limits,
    ) -> Result<Grammar, ApiError> {
        let vocabulary = self
            .vocabulary()
            .map_err(|e| ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, e))?;
        compile_constraint(&vocabulary, constraint, limits)
    }

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
    // A regular file under its cap (a FIFO or a device is refused, not waited on or read).
    let text = k3_model::config::read_config_text(&config.model_dir)
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
        jobs: Arc::new(Sender(Arc::clone(&queue))),
        ready: Arc::new(AtomicBool::new(false)),
        alive: Arc::new(AtomicBool::new(true)),
        load: Arc::new(LoadOutcome::default()),
        metrics,
        tokenizer: Arc::clone(&tokenizer),
        config: Arc::clone(&model_config),
        max_positions,
        vocabulary: Arc::default(),
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
            if let Err(e) = run(config, &model_config, &tokenizer, queue, loaded, &metrics) {
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
