//! The engine thread's loop: build the engine (`k3_model::builder`), then admit jobs while
//! there is room, prefill each on its own (from the longest prefix in the prompt cache), and
//! advance every active sequence one token per batched decode step, catching a panic in one
//! job's work so the others carry on. Snapshots go to the prompt cache at the end of a chat's
//! system block, of each prompt and of each answer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Result;
use k3_model::builder::Engine;
use k3_model::config::K3Config;
use k3_model::model::Session;
use k3_model::model::snapshot::file::Identity;
use k3_model::tokenizer::Tokenizer;

use super::cache::EngineCache;
use super::config::EngineConfig;
use super::job::Event;
use super::metrics::Metrics;
use super::queue::{JobQueue, Pop};
use super::sequence::Sequence;
use super::state;
use crate::api::valid::Prompt;

pub(super) fn run(
    config: EngineConfig,
    model_config: &K3Config,
    tokenizer: &Tokenizer,
    queue: Arc<JobQueue>,
    loaded: impl FnOnce(),
    metrics: &Metrics,
) -> Result<()> {
    // The build's lines about an option end with its flag; so does a failure's message.
    let engine = Engine::build(
        &config.model_dir,
        model_config.clone(),
        &config.options,
        &mut k3_cli::FlagHints(|line: &str| log::info!("{line}")),
    )
    .map_err(|e| anyhow::anyhow!(k3_cli::with_flags(&e)))?;
    let ranks = &config.options.ranks;
    if ranks.size() > 1 {
        log::info!("{}", engine.rank_share(ranks).describe(ranks));
    }
    let model = engine.model()?;
    let store = engine.store();
    let ends: Vec<u32> = ["<|end_of_msg|>", "[EOS]"]
        .iter()
        .filter_map(|s| tokenizer.special(s))
        .collect();
    // The checkpoint's identity for state files, computed on first use (it hashes headers).
    let identity_cell = std::cell::OnceCell::new();
    let identity = || identity_cell.get_or_init(|| Identity::of(engine.checkpoint(), model_config));
    // `--save-state`: once a job's answer is complete, its session's state goes to the file;
    // a failure is the job's error (its answer has been sent; the one-shot run exits non-zero).
    let save_state = |sequence: &Sequence| {
        let Some(path) = sequence.state.save.as_ref().filter(|_| sequence.completed) else {
            return;
        };
        match state::save(path, identity(), &sequence.session, &sequence.fed()) {
            Ok(line) => log::info!("{line}"),
            Err(message) => {
                let _ = sequence.events.send(Event::Error(message));
            }
        }
    };
    let mut cache = EngineCache::open(&config.prompt_cache, || {
        Identity::of(engine.checkpoint(), model_config)
    });
    *metrics
        .prompt_cache
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = cache.stats();
    loaded();
    log::info!("model loaded from {}", config.model_dir.display());

    let mut active: Vec<Sequence> = Vec::new();
    loop {
        // Admit: block only when idle.
        while active.len() < config.options.max_batch.max(1) {
            let job = match queue.pop(active.is_empty()) {
                Pop::Job(job) => *job,
                Pop::Empty => break,
                Pop::Closed if !active.is_empty() => break,
                Pop::Closed => {
                    // The server is gone: keep this run's expert use counts for the next
                    // start's preload order (unless --no-usage-cache).
                    match engine.save_usage() {
                        Some((path, Ok(()))) => {
                            log::info!("expert usage saved to {}", path.display())
                        }
                        Some((_, Err(e))) => log::warn!("expert usage not saved: {e}"),
                        None => {}
                    }
                    return Ok(());
                }
            };
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
                if let Some((_, answer)) = config
                    .scripted_answers
                    .iter()
                    .find(|(prompt, _)| *prompt == sequence.prompt)
                {
                    sequence.script = answer.iter().copied().collect();
                }
                let tokens: Vec<usize> = sequence.prompt.iter().map(|&t| t as usize).collect();
                let mut start = match sequence.state.load.clone() {
                    // A state file named by the one-shot run: it, or a clear error.
                    Some(path) => {
                        match state::load(&path, identity(), &model, &mut sequence.session, &tokens)
                        {
                            Ok(n) => n,
                            Err(message) => {
                                sequence.fail(&message);
                                return sequence;
                            }
                        }
                    }
                    None => cache.resume(
                        &model,
                        sequence.cache_namespace,
                        &mut sequence.session,
                        &tokens,
                    ),
                };
                sequence.cached_tokens = start;
                // A system block not cached yet: prefill to its end first and keep a snapshot
                // there (the same bits as one prefill: chunking never changes them).
                let system = sequence.system_tokens;
                if cache.is_on() && system > start && system < tokens.len() {
                    let chunk = config.prefill_chunk;
                    if let Err(e) =
                        model.prefill(&mut sequence.session, &tokens[start..system], chunk)
                    {
                        sequence.fail(&e.to_string());
                        return sequence;
                    }
                    cache.save(
                        sequence.cache_namespace,
                        &tokens[..system],
                        &sequence.session,
                    );
                    start = system;
                }
                match model.prefill(
                    &mut sequence.session,
                    &tokens[start..],
                    config.prefill_chunk,
                ) {
                    Ok(logits) => {
                        sequence.advance(&logits, tokenizer, metrics);
                        cache.save(sequence.cache_namespace, &tokens, &sequence.session);
                        save_state(&sequence);
                    }
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
        *metrics
            .prompt_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cache.stats();
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
        // The end of each answer: the next turn of its chat resumes here.
        for sequence in active.iter().filter(|s| s.completed && s.output.len() > 1) {
            cache.save(sequence.cache_namespace, &sequence.fed(), &sequence.session);
        }
        for sequence in active.iter().filter(|s| s.finished) {
            save_state(sequence);
        }
        *metrics
            .prompt_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cache.stats();
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
