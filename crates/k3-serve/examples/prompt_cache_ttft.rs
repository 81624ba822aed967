//! Time to first token of a chat's third turn with and without the prompt cache, side by side
//! in one run (no HTTP): the same greedy three-turn chat on an engine without the cache, then
//! on one with it; prints each turn's prompt and cached tokens and time to first token, the
//! speed-up of turn 3, whether the answers agree, and the cache's bytes against the state
//! size computed from the config.
//!
//! `cargo run --release -p k3-serve --example prompt_cache_ttft -- --model DIR [--threads 2]
//!  [--system-words 1900] [--user-words 60] [--context 8192] [--cold-last-only]`, and any of
//!  the library flags (`--help`). `--cold-last-only` runs the cached chat first and then only
//!  its turn 3 on an engine without the cache: the same comparison for two cold prefills
//!  instead of four (what makes a 16k-token point affordable on a slow host).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k3_cli::{Flag, Group, Kind};
use k3_model::builder::EngineOptions;
use k3_model::experts::ExpertOptions;
use k3_model::model::snapshot::state_bytes;
use k3_serve::api::{ChatRequest, Limits};
use k3_serve::engine::{
    EngineConfig, EngineHandle, Event, Job, PromptCacheOptions, encode_prompt, prompt_segments,
    spawn, wait_ready,
};
use serde_json::json;

const BINARY: &str = "prompt_cache_ttft";
const ANSWER_TOKENS: usize = 16;

fn flags() -> Vec<Flag> {
    let group = Group::new("Prompt cache");
    let mut table = vec![
        k3_cli::model_flag(group),
        Flag::value(
            "system-words",
            "N",
            Kind::Count,
            "1900",
            group,
            "words in the system prompt",
        ),
        Flag::value(
            "user-words",
            "N",
            Kind::Count,
            "60",
            group,
            "words in each user turn",
        ),
        Flag::value(
            "context",
            "N",
            Kind::Count,
            "8192",
            group,
            "context length the engine is built for (a 16k-token chat needs 20000)",
        ),
        Flag::switch(
            "cold-last-only",
            group,
            "run the chat with the cache first, then only its turn 3 without it (two cold prefills instead of four)",
        ),
    ];
    table.extend(k3_cli::library_flags_with_threads("2"));
    table
}

/// One turn's outcome.
struct Turn {
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft: Duration,
    answer: String,
}

fn main() -> Result<()> {
    let table = flags();
    let parsed = k3_cli::parse_or_exit(
        &table,
        BINARY,
        env!("CARGO_PKG_VERSION"),
        std::env::args().skip(1),
    );
    let model = std::path::PathBuf::from(parsed.get_str("model").expect("a required flag"));
    let words: (usize, usize) = (
        parsed.get_or_default(&table, "system-words")?,
        parsed.get_or_default(&table, "user-words")?,
    );
    let context: usize = parsed.get_or_default(&table, "context")?;
    let cold_last_only = parsed.has("cold-last-only");
    let mut options = EngineOptions {
        experts: ExpertOptions {
            usage_cache: false,
            ..ExpertOptions::default()
        },
        max_batch: 1,
        ctx: context,
        ..EngineOptions::default()
    };
    k3_cli::apply_library_flags(&parsed, &mut options)?;
    let threads: usize = parsed.get_or_default(&table, "threads")?;
    options.pool.threads = Some(threads);
    let mut results = Vec::new();
    // Turn 3's messages from the first run, replayed alone by the second with
    // --cold-last-only.
    let mut third: Option<Vec<serde_json::Value>> = None;
    let budgets: [usize; 2] = if cold_last_only {
        [4 << 30, 0]
    } else {
        [0, 4 << 30]
    };
    for budget_bytes in budgets {
        let (engine, _thread) = spawn(EngineConfig {
            model_dir: model.clone(),
            options: options.clone(),
            queue: 4,
            step_tokens: k3_model::model::PREFILL_CHUNK,
            prompt_cache: PromptCacheOptions {
                budget_bytes,
                dir: None,
            },
            panic_on_prompt: None,
            scripted_answers: Vec::new(),
            hold_load: false,
            max_mask: Duration::from_millis(200),
            spec: Default::default(),
        })?;
        if !wait_ready(&engine, Duration::from_secs(600)) {
            bail!("the model did not load");
        }
        let label = if budget_bytes == 0 {
            "no cache"
        } else {
            "cache"
        };
        let replay = third.as_deref().filter(|_| cold_last_only);
        let first_turn = if replay.is_some() { 3 } else { 1 };
        let (turns, messages) = chat(&engine, words, context, replay)?;
        third.get_or_insert(messages);
        for (i, t) in turns.iter().enumerate() {
            println!(
                "{label}: turn {}: {} prompt tokens, {} cached, time to first token {:.3} s",
                i + first_turn,
                t.prompt_tokens,
                t.cached_tokens,
                t.ttft.as_secs_f64()
            );
        }
        if let Some(stats) = *engine.metrics.prompt_cache.lock().unwrap() {
            println!(
                "{label}: {} snapshots, {} bytes held; {} hits, {} misses",
                stats.entries, stats.bytes_held, stats.hits, stats.misses
            );
            let last = turns.last().expect("a turn");
            println!(
                "{label}: state_bytes at turn 3's prompt ({} tokens): {} bytes",
                last.prompt_tokens,
                state_bytes(&engine.config, last.prompt_tokens)
            );
        }
        results.push(turns);
    }
    if cold_last_only {
        results.reverse();
    }
    let (cold, warm) = (
        results[0].last().expect("turn 3"),
        results[1].last().expect("turn 3"),
    );
    println!(
        "turn 3 ({} prompt tokens, {} cached): time to first token {:.3} s without the cache, {:.3} s with it: {:.1}x",
        warm.prompt_tokens,
        warm.cached_tokens,
        cold.ttft.as_secs_f64(),
        warm.ttft.as_secs_f64(),
        cold.ttft.as_secs_f64() / warm.ttft.as_secs_f64().max(1e-9)
    );
    let same = results[0]
        .iter()
        .rev()
        .zip(results[1].iter().rev())
        .all(|(a, b)| a.answer == b.answer);
    println!("answers identical with and without the cache: {same}");
    Ok(())
}

/// `words` words of filler text, different for each `seed`.
fn filler(seed: usize, words: usize) -> String {
    let vocabulary = [
        "state", "cache", "token", "prefix", "layer", "kernel", "expert", "model", "turn",
        "server", "latent", "window", "decode", "memory", "budget", "answer",
    ];
    (0..words)
        .map(|i| vocabulary[(i * 7 + seed * 13 + i / 5) % vocabulary.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// A three-turn greedy chat; each turn resends the conversation so far. Returns the turns and
/// turn 3's messages; with `replay`, runs those messages alone as turn 3.
fn chat(
    engine: &EngineHandle,
    (system_words, user_words): (usize, usize),
    context: usize,
    replay: Option<&[serde_json::Value]>,
) -> Result<(Vec<Turn>, Vec<serde_json::Value>)> {
    let limits = Limits {
        model_names: vec!["k3".into()],
        max_tokens_default: ANSWER_TOKENS,
        context,
        thinking_effort: k3_model::chat::ThinkingEffort::Max,
        thinking: false,
        vocab_size: engine.config.vocab_size,
        max_compile: Duration::from_secs(2),
        max_mask: Duration::from_millis(200),
        created: 0,
    };
    let mut messages = vec![json!({"role": "system", "content": filler(0, system_words)})];
    let mut turns = Vec::new();
    let mut third = Vec::new();
    let first = if replay.is_some() { 3 } else { 1 };
    for turn in first..=3 {
        match replay {
            Some(replayed) => messages = replayed.to_vec(),
            None => messages.push(json!({"role": "user", "content": filler(turn, user_words)})),
        }
        if turn == 3 {
            third = messages.clone();
        }
        let request: ChatRequest = serde_json::from_value(json!({
            "model": "k3", "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0,
        }))?;
        let request = request
            .validate(&limits)
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        let segments = prompt_segments(&request.prompt);
        let (ids, system_tokens) = encode_prompt(&engine.tokenizer, &request.prompt, &segments);
        if ids.len() + ANSWER_TOKENS > context {
            bail!("turn {turn}'s prompt of {} tokens is too long", ids.len());
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        engine
            .submit(Job {
                request,
                prompt_ids: ids,
                system_tokens,
                cache_namespace: Default::default(),
                events: tx,
                log_id: None,
                submitted: start,
                state: Default::default(),
                grammar: None,
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let mut answer = String::new();
        let outcome = loop {
            match rx.blocking_recv().context("the engine went away")? {
                Event::Delta { content, .. } => answer.push_str(&content),
                // The first token is sampled as the prefill ends: its time is the prefill's
                // (the queue is empty, one request at a time).
                Event::Done {
                    prompt_tokens,
                    cached_tokens,
                    prefill,
                    ..
                } => break (prompt_tokens, cached_tokens, prefill),
                Event::Error(e) => bail!("turn {turn} failed: {e}"),
            }
        };
        messages.push(json!({"role": "assistant", "content": answer}));
        turns.push(Turn {
            prompt_tokens: outcome.0,
            cached_tokens: outcome.1,
            ttft: outcome.2,
            answer: answer.clone(),
        });
    }
    Ok((turns, third))
}
