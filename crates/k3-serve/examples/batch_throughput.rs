//! Batched decode throughput through the engine (no HTTP): one greedy stream, then `--streams`
//! concurrent greedy streams, alternating `--rounds` times; prints each run's aggregate
//! tokens/s and the ratio.
//!
//! `cargo run --release -p k3-serve --example batch_throughput -- --model DIR [--threads 2]
//!  [--streams 4] [--tokens 64] [--rounds 3]`, and any of the library flags (`--help`).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use k3_cli::{Flag, Group, Kind};
use k3_model::builder::EngineOptions;
use k3_model::experts::ExpertOptions;
use k3_model::sampling::SamplingParams;
use k3_serve::api::{Prompt, ValidRequest};
use k3_serve::engine::{EngineConfig, EngineHandle, Event, Job, prompt_ids, spawn, wait_ready};

const BINARY: &str = "batch_throughput";

/// The example's flags, then the library flags (`--threads` defaulting to 2).
fn flags() -> Vec<Flag> {
    let group = Group::new("Throughput");
    let mut table = vec![
        k3_cli::model_flag(group),
        Flag::value(
            "streams",
            "N",
            Kind::Count,
            "4",
            group,
            "concurrent greedy streams",
        ),
        Flag::value("tokens", "N", Kind::Count, "64", group, "tokens per stream"),
        Flag::value(
            "rounds",
            "N",
            Kind::Count,
            "3",
            group,
            "one stream, then N, this often",
        ),
    ];
    table.extend(k3_cli::library_flags_with_threads("2"));
    table
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
    let streams: usize = parsed.get_or_default(&table, "streams")?;
    let tokens: usize = parsed.get_or_default(&table, "tokens")?;
    let rounds: usize = parsed.get_or_default(&table, "rounds")?;
    let mut options = EngineOptions {
        experts: ExpertOptions {
            usage_cache: false,
            ..ExpertOptions::default()
        },
        max_batch: streams,
        ctx: 4096,
        ..EngineOptions::default()
    };
    k3_cli::apply_library_flags(&parsed, &mut options)?;
    let threads: usize = parsed.get_or_default(&table, "threads")?;
    options.pool.threads = Some(threads);
    let (engine, _thread) = spawn(EngineConfig {
        model_dir: model.clone(),
        options,
        queue: 64,
        panic_on_prompt: None,
        scripted_answers: Vec::new(),
        hold_load: false,
        max_mask: Duration::from_millis(200),
        spec: Default::default(),
        step_tokens: 8,
        prompt_cache: Default::default(),
    })?;
    if !wait_ready(&engine, Duration::from_secs(600)) {
        bail!("the model did not load");
    }
    println!(
        "{} with {threads} threads, {tokens} greedy tokens per stream",
        model.display()
    );
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let (one, one_decode) = run(&engine, 1, tokens)?;
        let (many, many_decode) = run(&engine, streams, tokens)?;
        println!(
            "round {round}: 1 stream {one:.2} tokens/s ({one_decode:.2} in decode steps); {streams} streams {many:.2} tokens/s in all ({many_decode:.2} in decode steps); ratio {:.2} ({:.2} in decode steps)",
            many / one,
            many_decode / one_decode
        );
        ratios.push(many_decode / one_decode);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median ratio in decode steps {:.2} over {rounds} rounds",
        ratios[ratios.len() / 2]
    );
    Ok(())
}

/// `streams` concurrent greedy streams of `tokens` tokens: aggregate tokens/s over the wall time
/// from submission to the last token, and over the engine's decode steps alone (the tokens
/// those steps made, each stream's first token coming from its prefill).
fn run(engine: &EngineHandle, streams: usize, tokens: usize) -> Result<(f64, f64)> {
    let metrics = &engine.metrics;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let (generated0, requests0, decode0) = (
        load(&metrics.generated_tokens),
        load(&metrics.requests),
        load(&metrics.decode_ns),
    );
    let start = Instant::now();
    let mut receivers = Vec::new();
    for s in 0..streams {
        let request = ValidRequest {
            prompt: Prompt::Text(format!("Stream {s}:")),
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            max_tokens: tokens,
            stop: Vec::new(),
            stop_tokens: Vec::new(),
            stream: true,
            include_usage: false,
            logprobs: false,
            cache_salt: None,
            constraint: None,
            speculative: true,
        };
        let ids = prompt_ids(&engine.tokenizer, &request.prompt);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        engine
            .submit(Job {
                request,
                prompt_ids: ids,
                system_tokens: 0,
                cache_namespace: Default::default(),
                events: tx,
                log_id: None,
                submitted: Instant::now(),
                state: Default::default(),
                grammar: None,
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        receivers.push(rx);
    }
    let mut generated = 0;
    for mut rx in receivers {
        while let Some(event) = rx.blocking_recv() {
            match event {
                Event::Done {
                    completion_tokens, ..
                } => generated += completion_tokens,
                Event::Error(e) => bail!("{e}"),
                Event::Delta { .. } => {}
            }
        }
    }
    let wall = generated as f64 / start.elapsed().as_secs_f64();
    let stepped =
        (load(&metrics.generated_tokens) - generated0) - (load(&metrics.requests) - requests0);
    let decode_s = (load(&metrics.decode_ns) - decode0) as f64 / 1e9;
    Ok((wall, stepped as f64 / decode_s))
}
