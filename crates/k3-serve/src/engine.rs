//! The engine thread: it owns the model, admits jobs from a bounded queue, prefills each on
//! its own, and advances every active sequence together, one token per decode step
//! (continuous batching through `Model::decode_batch`, so a sequence's tokens do not depend on
//! who shares its steps). Each job's events go to its own channel; a closed channel (the
//! client went away) cancels the job at the next step.
//!
//! A panic in one job's work (its prefill, sampling, or output) fails that job with an error
//! event and the engine carries on; a panic in a batched decode step fails the jobs in that
//! step. The load's outcome is reported once ([`EngineHandle::wait_loaded`]), and `alive`
//! falls when the thread ends for any reason, so nothing waits on a dead engine.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use expert_store::{Checkpoint, StoreStats};
use k3_model::chat::{Delta, OutputParser, Segment, ToolCall};
use k3_model::config::K3Config;
use k3_model::experts::ExpertOptions;
use k3_model::model::{ExpertPlacement, Model, Session};
use k3_model::sampling::{Sampler, StopStrings};
use k3_model::tokenizer::Tokenizer;
use mxfp4_kernels::Kernels;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{Prompt, ValidRequest};

/// How the engine is set up (from the CLI).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_dir: PathBuf,
    pub kernels: Kernels,
    pub placement: numa_sched::PoolOptions,
    pub experts: ExpertOptions,
    /// Sequences advanced together at most.
    pub max_batch: usize,
    /// Tokens a sequence may hold (prompt and completion): sizes the KV cache in the plan.
    pub ctx: usize,
    /// Jobs waiting for a slot at most (more are refused: 429).
    pub queue: usize,
    pub prefill_chunk: usize,
    /// Reads every weight once before serving (`--scan`): a NaN/Inf in a float tensor or a
    /// 0xFF E8M0 scale fails the load, naming the tensors.
    pub scan: bool,
    /// Fault injection for tests: a text prompt equal to `.0` panics in its sampling step
    /// once `.1` tokens have been generated (0: right after its prefill). `None` in use.
    #[doc(hidden)]
    pub panic_on_prompt: Option<(String, usize)>,
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
    pub events: UnboundedSender<Event>,
    /// The request's id for the one info line logged when it ends (prompt and output token
    /// counts, time to first token, tokens/s, how it ended; never the prompt's text). `None`:
    /// no line (the one-shot run prints its own).
    pub log_id: Option<String>,
    /// When the request arrived: the time to first token counts from here.
    pub submitted: Instant,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queue_depth: AtomicI64,
    pub active: AtomicI64,
    /// Nanoseconds spent in decode steps (tokens/s = generated / this).
    pub decode_ns: AtomicU64,
    pub store: Mutex<Option<StoreStats>>,
}

/// The server's side of the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    jobs: mpsc::SyncSender<Job>,
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

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    Full,
    Stopped,
}

impl EngineHandle {
    /// Queues a job; refuses at once when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        match self.jobs.try_send(job) {
            Ok(()) => {
                self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(mpsc::TrySendError::Full(_)) => {
                self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Err(SubmitError::Full)
            }
            Err(mpsc::TrySendError::Disconnected(_)) => Err(SubmitError::Stopped),
        }
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
    let (jobs, queue) = mpsc::sync_channel(config.queue.max(1));
    let handle = EngineHandle {
        jobs,
        ready: Arc::new(AtomicBool::new(false)),
        alive: Arc::new(AtomicBool::new(true)),
        load: Arc::new(LoadOutcome::default()),
        metrics: Arc::new(Metrics::default()),
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
            if let Err(e) = run(config, &model_config, &tokenizer, queue, loaded, &metrics) {
                log::error!("engine stopped: {e:#}");
                guard.load.set(Err(format!("{e:#}")));
            }
            drop(guard);
        })?;
    Ok((handle, thread))
}

fn run(
    config: EngineConfig,
    model_config: &K3Config,
    tokenizer: &Tokenizer,
    queue: mpsc::Receiver<Job>,
    loaded: impl FnOnce(),
    metrics: &Metrics,
) -> Result<()> {
    let ckpt = Checkpoint::open(&config.model_dir)?;
    k3_model::checkpoint::validate(&ckpt, model_config)?;
    if config.scan {
        let started = Instant::now();
        let report = expert_store::scan::require_finite(&ckpt)?;
        log::info!(
            "--scan: {} tensors read, none holds NaN, Inf or a 0xFF scale ({:.1} s)",
            report.tensors.len(),
            started.elapsed().as_secs_f64()
        );
    }
    let run = k3_model::budget::RunShape {
        resident_trunk: false,
        max_batch: config.max_batch,
        ctx: config.ctx,
    };
    let plan = k3_model::budget::MemoryPlan::new(&ckpt, model_config, &config.experts, run)?
        .check(expert_store::io::memory_budget())?;
    log::info!("memory plan: {}", plan.describe());
    let pool = Arc::new(config.placement.build()?);
    log::info!("{}", pool.topology().describe());
    log::info!("{} compute threads", pool.threads());
    let store = config
        .experts
        .open(
            &ckpt,
            model_config,
            expert_store::io::memory_available(),
            &pool.topology().domains[0].cpus,
        )?
        .map(Arc::new);
    if let Some(store) = &store {
        store.place(
            pool.topology().domains.iter().map(|d| d.node).collect(),
            true,
        );
        if config.experts.preload {
            let report = store.preload(|_| {})?;
            log::info!(
                "preloaded {} experts, {:.2} GB in {:.1} s ({:.2} GB/s)",
                report.experts,
                report.bytes as f64 / 1e9,
                report.elapsed.as_secs_f64(),
                report.gbps()
            );
        }
    }
    let model = match &store {
        Some(s) => Model::with_expert_store(&ckpt, model_config, config.kernels, Arc::clone(s))?,
        None => Model::new(&ckpt, model_config, config.kernels)?,
    }
    .with_pool(pool)
    .with_expert_placement(ExpertPlacement::Split);
    let ends: Vec<u32> = ["<|end_of_msg|>", "[EOS]"]
        .iter()
        .filter_map(|s| tokenizer.special(s))
        .collect();
    loaded();
    log::info!("model loaded from {}", config.model_dir.display());

    let mut active: Vec<Sequence> = Vec::new();
    loop {
        // Admit: block only when idle.
        while active.len() < config.max_batch.max(1) {
            let job = if active.is_empty() {
                match queue.recv() {
                    Ok(job) => job,
                    Err(_) => {
                        // The server is gone: keep this run's expert use counts for the next
                        // start's preload order (unless --no-usage-cache).
                        if let (Some(store), Some(path)) =
                            (&store, config.experts.usage_path(&config.model_dir))
                        {
                            match store.usage().save(&path) {
                                Ok(()) => log::info!("expert usage saved to {}", path.display()),
                                Err(e) => log::warn!("expert usage not saved: {e}"),
                            }
                        }
                        return Ok(());
                    }
                }
            } else {
                match queue.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            };
            metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            metrics.requests.fetch_add(1, Ordering::Relaxed);
            metrics
                .prompt_tokens
                .fetch_add(job.prompt_ids.len() as u64, Ordering::Relaxed);
            let events = job.events.clone();
            if job.prompt_ids.is_empty() {
                // Nothing to prefill, so nothing to sample from (the server never sends one).
                let _ = events.send(Event::Error("the prompt has no tokens".into()));
                continue;
            }
            let panic_at = config
                .panic_on_prompt
                .as_ref()
                .filter(|(text, _)| matches!(&job.request.prompt, Prompt::Text(t) if t == text))
                .map(|&(_, at)| at);
            // One job's prefill and first token: a panic fails this job alone.
            let admitted = catch_unwind(AssertUnwindSafe(|| {
                let mut sequence = Sequence::new(job, &model, tokenizer, &ends);
                sequence.panic_at = panic_at;
                let tokens: Vec<usize> = sequence.prompt.iter().map(|&t| t as usize).collect();
                match model.prefill(&mut sequence.session, &tokens, config.prefill_chunk) {
                    Ok(logits) => sequence.advance(&logits, tokenizer, metrics),
                    Err(e) => sequence.fail(&e.to_string()),
                }
                sequence
            }));
            match admitted {
                Ok(sequence) if !sequence.finished => active.push(sequence),
                Ok(_) => {}
                Err(panic) => {
                    let _ = events.send(Event::Error(internal_error("prefill", &*panic)));
                }
            }
        }
        metrics.active.store(active.len() as i64, Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        let start = Instant::now();
        // A panic in the batched step cannot be laid at one job's door: it fails the jobs
        // that shared the step (their states may be half-advanced), and the engine goes on.
        let step = catch_unwind(AssertUnwindSafe(|| {
            let mut steps: Vec<(&mut Session, usize)> = active
                .iter_mut()
                .map(|s| (&mut s.session, s.last as usize))
                .collect();
            model.decode_batch(&mut steps)
        }));
        match step {
            Ok(Ok(logits)) => {
                for (sequence, logits) in active.iter_mut().zip(logits) {
                    let advanced = catch_unwind(AssertUnwindSafe(|| {
                        sequence.advance(&logits, tokenizer, metrics)
                    }));
                    if let Err(panic) = advanced {
                        sequence.fail(&internal_error("sampling", &*panic));
                    }
                }
            }
            Ok(Err(e)) => {
                for sequence in &mut active {
                    sequence.fail(&e.to_string());
                }
            }
            Err(panic) => {
                let message = internal_error("a decode step", &*panic);
                for sequence in &mut active {
                    sequence.fail(&message);
                }
            }
        }
        metrics
            .decode_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if let Some(store) = &store {
            *metrics.store.lock().unwrap_or_else(|p| p.into_inner()) = Some(store.stats());
        }
        active.retain(|s| !s.finished);
        metrics.active.store(active.len() as i64, Ordering::Relaxed);
    }
}

/// An error event's text for a panic in `stage` (the panic's own message included; the panic
/// hook has already printed it with its location on stderr).
fn internal_error(stage: &str, panic: &(dyn std::any::Any + Send)) -> String {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    log::error!("a request failed: internal error in {stage}: {message}");
    format!("internal error in {stage}: {message}")
}

/// Visible text of one kind (reasoning or content) on its way out: stop strings are matched
/// in it as it comes, and a tail that may begin one is held back.
struct Channel {
    stops: StopStrings,
    held: String,
}

impl Channel {
    /// Adds `text`, moving what may be sent to `out`; true when a stop string ended the
    /// text (it and everything after it are dropped).
    fn push(&mut self, text: &str, out: &mut String) -> bool {
        let base = self.held.len();
        self.held.push_str(text);
        if let Some((end, len)) = self.stops.scan(text) {
            // `held` keeps every byte a stop in progress may have begun at.
            self.held.truncate(base + end - len);
            out.push_str(&std::mem::take(&mut self.held));
            return true;
        }
        let send = self.held.len() - self.stops.pending().min(self.held.len());
        out.push_str(&self.held[..send]);
        self.held.drain(..send);
        false
    }

    /// Sends what is held: this text is over (the other kind began, or the output ended), so
    /// no stop can complete it any more.
    fn flush(&mut self, out: &mut String) {
        out.push_str(&std::mem::take(&mut self.held));
        self.stops.reset();
    }
}

/// One job in flight.
struct Sequence {
    session: Session,
    sampler: Sampler,
    parser: Option<OutputParser>,
    reasoning: Channel,
    content: Channel,
    prompt: Vec<u32>,
    events: UnboundedSender<Event>,
    ends: Vec<u32>,
    max_tokens: usize,
    logprobs: bool,
    generated: usize,
    last: u32,
    /// Output bytes not yet whole characters (plain completions).
    pending: Vec<u8>,
    finished: bool,
    log_id: Option<String>,
    submitted: Instant,
    admitted: Instant,
    prefilled: Option<Instant>,
    /// Fault injection (tests): panic in sampling once this many tokens are generated.
    panic_at: Option<usize>,
}

impl Sequence {
    fn new(job: Job, model: &Model<'_>, tokenizer: &Tokenizer, ends: &[u32]) -> Self {
        let Job {
            request,
            prompt_ids,
            events,
            log_id,
            submitted,
        } = job;
        let parser = match &request.prompt {
            Prompt::Chat { thinking, .. } => OutputParser::new(tokenizer, *thinking),
            Prompt::Text(_) => None,
        };
        Self {
            session: model.session(),
            sampler: Sampler::new(request.sampling.clone(), &prompt_ids),
            parser,
            reasoning: Channel {
                stops: StopStrings::new(request.stop.clone()),
                held: String::new(),
            },
            content: Channel {
                stops: StopStrings::new(request.stop.clone()),
                held: String::new(),
            },
            prompt: prompt_ids,
            events,
            ends: ends.iter().chain(&request.stop_tokens).copied().collect(),
            max_tokens: request.max_tokens,
            logprobs: request.logprobs,
            generated: 0,
            last: 0,
            pending: Vec::new(),
            finished: false,
            log_id,
            submitted,
            admitted: Instant::now(),
            prefilled: None,
            panic_at: None,
        }
    }

    fn fail(&mut self, message: &str) {
        let _ = self.events.send(Event::Error(message.to_owned()));
        self.log_end("error");
        self.finished = true;
    }

    /// The request's one log line (see [`Job::log_id`]).
    fn log_end(&self, how: &str) {
        let Some(id) = &self.log_id else { return };
        let ttft = self.prefilled.map_or("none".to_owned(), |t| {
            format!("{:.3} s", (t - self.submitted).as_secs_f64())
        });
        let rate = match self.prefilled {
            // The first token comes with the prefill; the rest are decode steps.
            Some(t) if self.generated > 1 => format!(
                "{:.2} tokens/s",
                (self.generated - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9)
            ),
            _ => "no decode steps".to_owned(),
        };
        log::info!(
            "{id}: {how}; {} prompt tokens, {} output tokens, time to first token {ttft}, {rate}",
            self.prompt.len(),
            self.generated,
        );
    }

    fn finish(&mut self, reason: &'static str) {
        self.log_end(reason);
        let prefilled = self.prefilled.unwrap_or(self.admitted);
        let _ = self.events.send(Event::Done {
            finish_reason: reason,
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.generated,
            prefill: prefilled - self.admitted,
            decode: prefilled.elapsed(),
        });
        self.finished = true;
    }

    /// Samples the next token from `logits` and sends what it adds.
    fn advance(&mut self, logits: &[f32], tokenizer: &Tokenizer, metrics: &Metrics) {
        if self.events.is_closed() {
            self.log_end("cancelled (the client went away)");
            self.finished = true;
            return;
        }
        self.prefilled.get_or_insert_with(Instant::now);
        if self.panic_at == Some(self.generated) {
            panic!("injected fault after {} tokens", self.generated);
        }
        let sampled = self.sampler.sample(logits);
        self.generated += 1;
        self.last = sampled.token;
        metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let text = |id: u32| tokenizer.decode(&[id]);
        let logprobs = if self.logprobs {
            vec![TokenLogprob {
                token: text(sampled.token),
                logprob: sampled.logprob,
                top: sampled.top.iter().map(|&(id, lp)| (text(id), lp)).collect(),
            }]
        } else {
            Vec::new()
        };
        if self.ends.contains(&sampled.token) {
            self.flush_held(logprobs);
            return self.finish("stop");
        }
        let bytes = tokenizer.decode_bytes(&[sampled.token]);
        let deltas = match &mut self.parser {
            Some(parser) => parser.push(sampled.token, &bytes),
            None => {
                self.pending.extend_from_slice(&bytes);
                let valid = match std::str::from_utf8(&self.pending) {
                    Ok(_) => self.pending.len(),
                    Err(e) => e.valid_up_to(),
                };
                let content = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
                vec![Delta::Content(content)]
            }
        };
        // Stop strings apply to reasoning and content alike, each on its own (a stop does not
        // span the switch from one to the other): cut at the first, hold back a possible start.
        let (mut reasoning, mut content, mut tool_calls) =
            (String::new(), String::new(), Vec::new());
        let mut stop = false;
        for delta in deltas {
            stop = match delta {
                Delta::Reasoning(t) => {
                    self.content.flush(&mut content);
                    self.reasoning.push(&t, &mut reasoning)
                }
                Delta::Content(t) => {
                    self.reasoning.flush(&mut reasoning);
                    self.content.push(&t, &mut content)
                }
                Delta::ToolCall(c) => {
                    tool_calls.push(c);
                    false
                }
            };
            if stop {
                break;
            }
        }
        if !(reasoning.is_empty()
            && content.is_empty()
            && tool_calls.is_empty()
            && logprobs.is_empty())
        {
            let _ = self.events.send(Event::Delta {
                reasoning,
                content,
                tool_calls,
                logprobs,
            });
        }
        if stop {
            self.finish("stop");
        } else if self.generated >= self.max_tokens {
            self.flush_held(Vec::new());
            self.finish("length");
        }
    }

    fn flush_held(&mut self, logprobs: Vec<TokenLogprob>) {
        let (mut reasoning, mut content) = (String::new(), String::new());
        self.reasoning.flush(&mut reasoning);
        self.content.flush(&mut content);
        if !reasoning.is_empty() || !content.is_empty() || !logprobs.is_empty() {
            let _ = self.events.send(Event::Delta {
                reasoning,
                content,
                tool_calls: Vec::new(),
                logprobs,
            });
        }
    }
}

/// A validated request's prompt as the pieces that are encoded each on its own (chat messages
/// rendered; plain text is one piece in which special-token strings are ordinary text).
pub fn prompt_segments(prompt: &Prompt) -> Vec<Segment> {
    match prompt {
        Prompt::Chat { segments, .. } => segments.clone(),
        Prompt::Text(text) => vec![Segment {
            text: text.clone(),
            special: false,
        }],
    }
}

/// The fewest tokens `segments` can encode to (see [`Tokenizer::min_tokens`]): a prompt can be
/// refused on its length before it is tokenized.
pub fn min_prompt_tokens(tokenizer: &Tokenizer, segments: &[Segment]) -> usize {
    segments
        .iter()
        .map(|s| tokenizer.min_tokens(s.text.len()))
        .sum()
}

/// The tokens of `segments`. A prompt with no tokens (an empty completion prompt) starts from
/// `[BOS]` where the tokenizer has one, as a document does: OpenAI's and llama.cpp's servers
/// answer an empty prompt that way. Without `[BOS]` it stays empty (the server refuses it).
pub fn encode_segments(tokenizer: &Tokenizer, segments: &[Segment]) -> Vec<u32> {
    let ids = k3_model::chat::encode(tokenizer, segments);
    if ids.is_empty() {
        return tokenizer.special("[BOS]").into_iter().collect();
    }
    ids
}

/// The tokens of a validated request's prompt.
pub fn prompt_ids(tokenizer: &Tokenizer, prompt: &Prompt) -> Vec<u32> {
    encode_segments(tokenizer, &prompt_segments(prompt))
}

/// Waits until the engine is ready (for the one-shot CLI and tests); false if the load
/// failed or took longer than `timeout`.
pub fn wait_ready(handle: &EngineHandle, timeout: Duration) -> bool {
    handle.wait_loaded(Some(timeout)).is_ok()
}
