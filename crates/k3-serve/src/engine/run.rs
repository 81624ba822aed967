//! The engine thread's loop: build the engine (`k3_model::builder`), then admit jobs while
//! there is room (each restored from the longest prefix in the prompt cache), and run steps:
//! one forward pass over every decoding sequence's next token and chunks of the prompts being
//! prefilled, within `--step-tokens` (`schedule`), catching a panic in one job's work so the
//! others carry on. Snapshots go to the prompt cache at the end of a chat's system block, of
//! each prompt and of each answer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Result;
use k3_model::builder::Engine;
use k3_model::config::K3Config;
use k3_model::model::snapshot::file::Identity;
use k3_model::model::{Model, Session, Want};
use k3_model::tokenizer::Tokenizer;

use super::cache::EngineCache;
use super::config::EngineConfig;
use super::job::Event;
use super::metrics::Metrics;
use super::queue::{JobQueue, Pop};
use super::schedule::{self, Feed, Standing};
use super::sequence::Sequence;
use super::speculate::{Candidate, Speculator};
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
    if config.hold_load {
        log::warn!("the load is held for ever (K3_SERVE_TEST_HOLD_LOAD, a test hook)");
        loop {
            std::thread::park();
        }
    }
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
    // Its numerics (the kernel tier's sums, a requantised trunk) are part of it: a state
    // resumed under other numerics would not give the cold run's bits.
    let (tier, trunk) = (engine.kernels().tier(), config.options.trunk_format);
    let identify = || Identity::of(engine.checkpoint(), model_config).with_numerics(tier, trunk);
    let identity = || identity_cell.get_or_init(identify);
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
    let mut cache = EngineCache::open(&config.prompt_cache, identify);
    *metrics
        .prompt_cache
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = cache.stats();
    loaded();
    log::info!("model loaded from {}", config.model_dir.display());

    let budget = config.step_tokens.max(1);
    log::info!(
        "steps of at most {budget} tokens (--step-tokens): each running stream's next token, \
         then chunks of the prompts being prefilled, oldest first"
    );
    let mut speculator = Speculator::new(config.spec);
    if config.spec.ngram {
        log::info!(
            "speculative decoding: n-gram drafts of up to {} tokens a step (--spec-max-draft), \
             checked in the step's pass; {} MB of earlier answers to draft from \
             (--spec-cache-mb); the output is the same bits as without",
            config.spec.max_draft,
            config.spec.cache_bytes >> 20
        );
    }
    let mut active: Vec<Sequence> = Vec::new();
    loop {
        // Admit: block only when idle. `--max-batch` counts the sequences being prefilled too.
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
            // Admission restores what the prompt cache (or a state file) holds; the prompt's
            // rest is prefilled by the steps. A panic here fails this job alone.
            let admitted = catch_unwind(AssertUnwindSafe(|| {
                let mut sequence = Sequence::new(job, &model, tokenizer, &ends, config.max_mask);
                metrics.queue_wait.observe(sequence.queue_wait());
                sequence.panic_at = panic_at;
                if let Some((_, answer)) = config
                    .scripted_answers
                    .iter()
                    .find(|(prompt, _)| *prompt == sequence.prompt)
                {
                    sequence.script = answer.iter().copied().collect();
                }
                let tokens: Vec<usize> = sequence.prompt.iter().map(|&t| t as usize).collect();
                let start = match sequence.state.load.clone() {
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
                sequence.fed_prompt = start;
                sequence.drafting = speculator.drafting(sequence.speculative, &sequence.prompt);
                sequence
            }));
            match admitted {
                Ok(sequence) if !sequence.finished => active.push(sequence),
                Ok(_) => {}
                Err(panic) => {
                    let _ = events.send(Event::Error(internal_error("admission", &*panic)));
                }
            }
        }
        // A sequence whose client went away leaves at this step boundary, mid-prefill too.
        active.retain_mut(|s| !s.cancel_if_gone());
        metrics.active.store(active.len() as i64, Ordering::Relaxed);
        *metrics
            .prompt_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cache.stats();
        if active.is_empty() {
            continue;
        }
        let started = Instant::now();
        // Drafts first, within the budget the decodes leave (a prompt being prefilled keeps
        // at least one token of it).
        let decodes = active
            .iter()
            .filter(|s| s.fed_prompt >= s.prompt.len())
            .count();
        let prefilling = active.len() > decodes;
        let room = budget.saturating_sub(decodes + usize::from(prefilling));
        let candidates: Vec<Candidate<'_>> = active
            .iter_mut()
            .filter(|s| s.fed_prompt >= s.prompt.len())
            .filter_map(|s| {
                let (room, namespace) = (s.room(), s.cache_namespace);
                Some(Candidate {
                    drafting: s.drafting.as_mut()?,
                    namespace,
                    room,
                })
            })
            .collect();
        speculator.plan(candidates, decodes, room);
        fn drafts(s: &Sequence) -> &[u32] {
            s.drafting.as_ref().map_or(&[], |d| &d.draft[..])
        }
        let standings: Vec<Standing> = active
            .iter()
            .map(|s| Standing {
                fed: s.fed_prompt,
                prompt: s.prompt.len(),
                // A system block not cached yet: its prompt stops there once, for a snapshot
                // (the same bits as one prefill: chunking never changes them).
                stop_at: cache.is_on().then_some(s.system_tokens),
                drafts: drafts(s).len(),
            })
            .collect();
        let feeds = schedule::plan(&standings, budget);
        let inputs: Vec<Vec<usize>> = feeds
            .iter()
            .map(|(i, feed)| match feed {
                Feed::Decode => std::iter::once(active[*i].last)
                    .chain(drafts(&active[*i]).iter().copied())
                    .map(|t| t as usize)
                    .collect(),
                Feed::Prompt(range) => active[*i].prompt[range.clone()]
                    .iter()
                    .map(|&t| t as usize)
                    .collect(),
            })
            .collect();
        // Logits after each token of a verify pass, after the last of a decode or of a
        // prompt's last chunk, none for the chunks before.
        let wants: Vec<Want> = feeds
            .iter()
            .map(|(i, feed)| match feed {
                Feed::Decode if drafts(&active[*i]).is_empty() => Want::Last,
                Feed::Decode => Want::All,
                Feed::Prompt(range) if range.end == active[*i].prompt.len() => Want::Last,
                Feed::Prompt(_) => Want::None,
            })
            .collect();
        let (decodes, prompt_tokens) = feeds.iter().fold((0, 0), |(d, p), (_, f)| match f {
            Feed::Decode => (d + 1, p),
            Feed::Prompt(r) => (d, p + r.len()),
        });
        let step_tokens: usize = inputs.iter().map(Vec::len).sum();
        // A verify pass's tokens can be taken back: the session keeps what that needs.
        for ((i, _), want) in feeds.iter().zip(&wants) {
            if *want == Want::All {
                active[*i].session.checkpoint();
            }
        }
        // A panic in the step cannot be laid at one job's door: it fails the jobs that shared
        // the step (their states may be half-advanced), and the engine goes on.
        let pass_started = Instant::now();
        let step = catch_unwind(AssertUnwindSafe(|| {
            let mut in_step: Vec<Option<&mut Sequence>> = active.iter_mut().map(Some).collect();
            let mut groups: Vec<(&mut Session, &[usize])> = feeds
                .iter()
                .zip(&inputs)
                .map(|((i, _), tokens)| {
                    let sequence = in_step[*i].take().expect("one feed per sequence a step");
                    (&mut sequence.session, &tokens[..])
                })
                .collect();
            model.step_rows(&mut groups, &wants)
        }));
        if matches!(step, Ok(Ok(_))) {
            speculator.observe(step_tokens, pass_started.elapsed().as_secs_f64());
        }
        match step {
            Ok(Ok(rows)) => {
                for ((i, feed), mut rows) in feeds.iter().zip(rows) {
                    let sequence = &mut active[*i];
                    let (stage, logits) = match feed {
                        Feed::Decode if rows.len() > 1 => {
                            verify(sequence, &model, rows, tokenizer, metrics);
                            continue;
                        }
                        Feed::Decode => {
                            sequence.count_pass();
                            ("sampling", rows.pop())
                        }
                        Feed::Prompt(range) => {
                            sequence.fed_prompt = range.end;
                            let logits = rows.pop();
                            // A snapshot at the system block's end and at the prompt's (the
                            // prefix as ids only then: not on every chunk of a long prompt).
                            if cache.is_on()
                                && (range.end == sequence.system_tokens || logits.is_some())
                            {
                                let tokens: Vec<usize> = sequence.prompt[..range.end]
                                    .iter()
                                    .map(|&t| t as usize)
                                    .collect();
                                cache.save(sequence.cache_namespace, &tokens, &sequence.session);
                            }
                            ("prefill", logits)
                        }
                    };
                    let Some(logits) = logits else { continue };
                    let advanced = catch_unwind(AssertUnwindSafe(|| {
                        sequence.advance(&logits, tokenizer, metrics)
                    }));
                    if let Err(panic) = advanced {
                        sequence.fail(&internal_error(stage, &*panic));
                    }
                }
            }
            Ok(Err(e)) => {
                for (i, _) in &feeds {
                    active[*i].fail(&e.to_string());
                }
            }
            Err(panic) => {
                let message = internal_error("a step", &*panic);
                for (i, _) in &feeds {
                    active[*i].fail(&message);
                }
            }
        }
        metrics
            .decode_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        metrics.steps.fetch_add(1, Ordering::Relaxed);
        metrics
            .step_decode_tokens
            .fetch_add(decodes, Ordering::Relaxed);
        metrics
            .step_prefill_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        if let Some(store) = &store {
            *metrics.store.lock().unwrap_or_else(|p| p.into_inner()) = Some(store.stats());
        }
        // The end of each answer: the next turn of its chat resumes here, and later answers
        // of its namespace may draft from it.
        for sequence in active.iter().filter(|s| s.completed && s.output.len() > 1) {
            cache.save(sequence.cache_namespace, &sequence.fed(), &sequence.session);
        }
        for sequence in active
            .iter()
            .filter(|s| s.completed && s.drafting.is_some())
        {
            speculator.remember(sequence.cache_namespace, &sequence.output);
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

/// A verify pass's rows for `sequence` (its last token and drafts fed, logits after each): the
/// sampler draws from each row in turn, as decoding one token a step would, while the token
/// drawn is the draft fed after it; then the session goes back to just after the last row
/// used, so it holds exactly the tokens that decoding one by one would have fed.
fn verify(
    sequence: &mut Sequence,
    model: &Model<'_>,
    rows: Vec<Vec<f32>>,
    tokenizer: &Tokenizer,
    metrics: &Metrics,
) {
    let draft = sequence
        .drafting
        .as_mut()
        .map(|d| std::mem::take(&mut d.draft))
        .unwrap_or_default();
    let Some(start) = sequence.session.checkpoint_position() else {
        return sequence.fail("internal error in a verify pass: no checkpoint");
    };
    sequence.count_pass();
    sequence.begin_verify();
    let (mut used, mut accepted) = (0, 0);
    for (i, row) in rows.iter().enumerate() {
        let before = sequence.output.len();
        let advanced = catch_unwind(AssertUnwindSafe(|| {
            sequence.advance(row, tokenizer, metrics)
        }));
        if let Err(panic) = advanced {
            return sequence.fail(&internal_error("sampling", &*panic));
        }
        used += 1;
        // A token was drawn (not a cancel) and it is the draft fed after this row.
        let matched = sequence.output.len() > before && draft.get(i) == Some(&sequence.last);
        accepted += usize::from(matched);
        if sequence.finished || !matched {
            break;
        }
    }
    metrics
        .spec_drafted
        .fetch_add(draft.len() as u64, Ordering::Relaxed);
    metrics
        .spec_accepted
        .fetch_add(accepted as u64, Ordering::Relaxed);
    metrics.spec_passes.fetch_add(1, Ordering::Relaxed);
    if let Some(drafting) = &mut sequence.drafting {
        drafting.record(draft.len(), accepted);
    }
    if used == rows.len() {
        sequence.session.commit();
    } else if let Err(e) = model.rollback(&mut sequence.session, start + used) {
        sequence.fail(&format!("internal error in a verify pass: {e}"));
    }
    // An end during the pass goes out now, its log line counting the pass's drafts.
    sequence.end_verify();
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
