//! The engine thread: it owns the model, admits jobs from a bounded queue, prefills each on
//! its own, and advances every active sequence together, one token per decode step
//! (continuous batching through `Model::decode_batch`, so a sequence's tokens do not depend on
//! who shares its steps). Each job's events go to its own channel; a closed channel (the
//! client went away) cancels the job at the next step.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use expert_store::{Checkpoint, StoreStats};
use k3_model::chat::{Delta, OutputParser, ToolCall};
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
    pub ready: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    pub tokenizer: Arc<Tokenizer>,
    pub config: Arc<K3Config>,
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
}

/// Starts the engine thread; it loads the model there and sets `ready` when it can serve.
/// The tokenizer and config are read here, so requests can be validated meanwhile.
pub fn spawn(config: EngineConfig) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let tokenizer =
        Arc::new(Tokenizer::from_dir(&config.model_dir).context("loading the tokenizer")?);
    let text = std::fs::read_to_string(config.model_dir.join("config.json"))
        .with_context(|| format!("reading {}/config.json", config.model_dir.display()))?;
    let model_config = Arc::new(K3Config::from_json(&text)?);
    let (jobs, queue) = mpsc::sync_channel(config.queue.max(1));
    let handle = EngineHandle {
        jobs,
        ready: Arc::new(AtomicBool::new(false)),
        metrics: Arc::new(Metrics::default()),
        tokenizer: Arc::clone(&tokenizer),
        config: Arc::clone(&model_config),
    };
    let (ready, metrics) = (Arc::clone(&handle.ready), Arc::clone(&handle.metrics));
    let thread = std::thread::Builder::new()
        .name("k3-engine".into())
        .spawn(move || {
            if let Err(e) = run(config, &model_config, &tokenizer, queue, &ready, &metrics) {
                log::error!("engine stopped: {e:#}");
            }
        })?;
    Ok((handle, thread))
}

fn run(
    config: EngineConfig,
    model_config: &K3Config,
    tokenizer: &Tokenizer,
    queue: mpsc::Receiver<Job>,
    ready: &AtomicBool,
    metrics: &Metrics,
) -> Result<()> {
    let ckpt = Checkpoint::open(&config.model_dir)?;
    k3_model::checkpoint::validate(&ckpt, model_config)?;
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
    let store = config
        .experts
        .open(&ckpt, model_config, expert_store::io::memory_available())?
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
    ready.store(true, Ordering::Release);
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
            let mut sequence = Sequence::new(job, &model, tokenizer, &ends);
            let tokens: Vec<usize> = sequence.prompt.iter().map(|&t| t as usize).collect();
            match model.prefill(&mut sequence.session, &tokens, config.prefill_chunk) {
                Ok(logits) => {
                    sequence.advance(&logits, tokenizer, metrics);
                    if !sequence.finished {
                        active.push(sequence);
                    }
                }
                Err(e) => sequence.fail(&e.to_string()),
            }
        }
        metrics.active.store(active.len() as i64, Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        let start = Instant::now();
        let mut steps: Vec<(&mut Session, usize)> = active
            .iter_mut()
            .map(|s| (&mut s.session, s.last as usize))
            .collect();
        match model.decode_batch(&mut steps) {
            Ok(logits) => {
                for (sequence, logits) in active.iter_mut().zip(logits) {
                    sequence.advance(&logits, tokenizer, metrics);
                }
            }
            Err(e) => {
                for sequence in &mut active {
                    sequence.fail(&e.to_string());
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

/// One job in flight.
struct Sequence {
    session: Session,
    sampler: Sampler,
    parser: Option<OutputParser>,
    stops: StopStrings,
    prompt: Vec<u32>,
    events: UnboundedSender<Event>,
    ends: Vec<u32>,
    max_tokens: usize,
    logprobs: bool,
    generated: usize,
    last: u32,
    /// Output bytes not yet whole characters (plain completions).
    pending: Vec<u8>,
    /// Visible text held back because it may begin a stop string.
    held: String,
    finished: bool,
    admitted: Instant,
    prefilled: Option<Instant>,
}

impl Sequence {
    fn new(job: Job, model: &Model<'_>, tokenizer: &Tokenizer, ends: &[u32]) -> Self {
        let Job {
            request,
            prompt_ids,
            events,
        } = job;
        let parser = match &request.prompt {
            Prompt::Chat { thinking, .. } => OutputParser::new(tokenizer, *thinking),
            Prompt::Text(_) => None,
        };
        Self {
            session: model.session(),
            sampler: Sampler::new(request.sampling.clone(), &prompt_ids),
            parser,
            stops: StopStrings::new(request.stop.clone()),
            prompt: prompt_ids,
            events,
            ends: ends.iter().chain(&request.stop_tokens).copied().collect(),
            max_tokens: request.max_tokens,
            logprobs: request.logprobs,
            generated: 0,
            last: 0,
            pending: Vec::new(),
            held: String::new(),
            finished: false,
            admitted: Instant::now(),
            prefilled: None,
        }
    }

    fn fail(&mut self, message: &str) {
        let _ = self.events.send(Event::Error(message.to_owned()));
        self.finished = true;
    }

    fn finish(&mut self, reason: &'static str) {
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
            self.finished = true; // the client went away
            return;
        }
        self.prefilled.get_or_insert_with(Instant::now);
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
        let (mut reasoning, mut content, mut tool_calls) =
            (String::new(), String::new(), Vec::new());
        match &mut self.parser {
            Some(parser) => {
                for delta in parser.push(sampled.token, &bytes) {
                    match delta {
                        Delta::Reasoning(t) => reasoning.push_str(&t),
                        Delta::Content(t) => content.push_str(&t),
                        Delta::ToolCall(c) => tool_calls.push(c),
                    }
                }
            }
            None => {
                self.pending.extend_from_slice(&bytes);
                let valid = match std::str::from_utf8(&self.pending) {
                    Ok(_) => self.pending.len(),
                    Err(e) => e.valid_up_to(),
                };
                content = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
            }
        }
        // Stop strings on the visible content: cut at the first, hold back a possible start.
        self.held.push_str(&content);
        let mut stop = false;
        if let Some(at) = self.stops.find(&self.held) {
            self.held.truncate(at);
            stop = true;
        }
        let keep = if stop {
            0
        } else {
            self.stops.hold_back(&self.held)
        };
        let content = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
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
        let content = std::mem::take(&mut self.held);
        if !content.is_empty() || !logprobs.is_empty() {
            let _ = self.events.send(Event::Delta {
                reasoning: String::new(),
                content,
                tool_calls: Vec::new(),
                logprobs,
            });
        }
    }
}

/// The tokens of a validated request's prompt.
pub fn prompt_ids(tokenizer: &Tokenizer, prompt: &Prompt) -> Vec<u32> {
    match prompt {
        Prompt::Chat { segments, .. } => k3_model::chat::encode(tokenizer, segments),
        Prompt::Text(text) => tokenizer.encode(text, false),
    }
}

/// Waits until the engine is ready (for the one-shot CLI and tests).
pub fn wait_ready(handle: &EngineHandle, timeout: Duration) -> bool {
    let start = Instant::now();
    while !handle.ready.load(Ordering::Acquire) {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}
