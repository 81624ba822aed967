//! `k3-serve`: one-shot generation (`--prompt`) or the OpenAI-compatible server (`--serve`).
//!
//! ```text
//! k3-serve [--model DIR] [--serve] [--host 127.0.0.1] [--port 8000] [--threads N] [--numa]
//!          [--numa-fake N] [--numa-threads N] [--expert-cache N] [--expert-cache-gb G]
//!          [--preload-experts] [--mlock] [--no-usage-cache] [--max-batch N] [--ctx N]
//!          [--queue N] [--kernel-tier T] [--header-timeout-s S] [--body-timeout-s S]
//!          [--idle-timeout-s S] [--max-connections N] [--prompt TEXT] [--max-tokens N]
//!          [--temperature T] [--seed S] [--no-think] [--thinking-effort low|high|max]
//! ```
//! Without `--model` it generates the `tiny` synthetic checkpoint once into a cache directory
//! (`$XDG_CACHE_HOME/k3/tiny`, else `~/.cache/k3/tiny`) and uses it. A model that fails to
//! load ends the process with the reason, in both modes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k3_model::chat::{ChatOptions, Message, ThinkingEffort, render};
use k3_model::experts::ExpertOptions;
use k3_model::sampling::SamplingParams;
use k3_serve::api::{Limits, Prompt, ValidRequest};
use k3_serve::conn::{ConnLimits, serve};
use k3_serve::engine::{EngineConfig, Event, Job, prompt_ids, spawn};
use k3_serve::server::{AppState, app};
use mxfp4_kernels::{Kernels, Tier};

struct Args {
    model: Option<PathBuf>,
    serve: bool,
    host: String,
    port: u16,
    placement: numa_sched::PoolOptions,
    experts: ExpertOptions,
    max_batch: usize,
    ctx: usize,
    queue: usize,
    tier: Option<Tier>,
    conn: ConnLimits,
    prompt: Option<String>,
    max_tokens: usize,
    temperature: f32,
    seed: u64,
    thinking: bool,
    /// The chat template's `thinking_effort` for requests that give none.
    thinking_effort: ThinkingEffort,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        model: None,
        serve: false,
        host: "127.0.0.1".into(),
        port: 8000,
        placement: numa_sched::PoolOptions {
            threads: Some(1),
            ..Default::default()
        },
        experts: ExpertOptions::default(),
        max_batch: 8,
        ctx: 4096,
        queue: 64,
        tier: None,
        conn: ConnLimits::default(),
        prompt: None,
        max_tokens: 32,
        temperature: 0.0,
        seed: 0,
        thinking: true,
        thinking_effort: ThinkingEffort::Max,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(PathBuf::from(value()?)),
            "--serve" => a.serve = true,
            "--host" => a.host = value()?,
            "--port" => a.port = value()?.parse().context("--port is a port number")?,
            "--max-batch" => a.max_batch = count(&flag, &value()?)?,
            "--ctx" => a.ctx = count(&flag, &value()?)?,
            "--queue" => a.queue = count(&flag, &value()?)?,
            "--kernel-tier" => a.tier = Some(value()?.parse()?),
            "--header-timeout-s" => a.conn.header = seconds(&flag, &value()?)?,
            "--body-timeout-s" => a.conn.body = seconds(&flag, &value()?)?,
            "--idle-timeout-s" => a.conn.idle = seconds(&flag, &value()?)?,
            "--max-connections" => a.conn.max_connections = count(&flag, &value()?)?,
            "--prompt" => a.prompt = Some(value()?),
            "--max-tokens" => a.max_tokens = count(&flag, &value()?)?,
            "--temperature" => {
                a.temperature = value()?.parse().context("--temperature is a number")?
            }
            "--seed" => a.seed = value()?.parse().context("--seed is a number")?,
            "--no-think" => a.thinking = false,
            "--thinking-effort" => {
                a.thinking_effort = value()?.parse().context("--thinking-effort")?
            }
            "-h" | "--help" => {
                println!(
                    "usage: k3-serve [--model DIR] [--serve] [--host H] [--port P] [--threads N] [--numa] [--numa-fake N] [--numa-threads N] [--expert-cache N] [--expert-cache-gb G] [--preload-experts] [--mlock] [--no-usage-cache] [--max-batch N] [--ctx N] [--queue N] [--kernel-tier T] [--header-timeout-s S] [--body-timeout-s S] [--idle-timeout-s S] [--max-connections N] [--prompt TEXT] [--max-tokens N] [--temperature T] [--seed S] [--no-think] [--thinking-effort low|high|max]\n\n  connection limits (--serve): --header-timeout-s S (a request head, from the connection or its first byte; default {}), --body-timeout-s S (a request body, from the head's end; default {}), --idle-timeout-s S (a kept-alive connection with nothing in flight; default {}), --max-connections N (open at once, more get 503; default {})",
                    ConnLimits::default().header.as_secs_f64(),
                    ConnLimits::default().body.as_secs_f64(),
                    ConnLimits::default().idle.as_secs_f64(),
                    ConnLimits::default().max_connections,
                );
                std::process::exit(0);
            }
            other => {
                let known = a
                    .experts
                    .apply_flag(other, || it.next())
                    .map_err(anyhow::Error::msg)?
                    || a.placement
                        .apply_flag(other, || it.next())
                        .map_err(anyhow::Error::msg)?;
                if !known {
                    bail!("unknown flag {other:?} (see --help)");
                }
            }
        }
    }
    if !a.serve && a.prompt.is_none() {
        bail!("give --prompt TEXT for a one-shot generation, or --serve to start the server");
    }
    Ok(a)
}

fn count(flag: &str, value: &str) -> Result<usize> {
    let n: usize = value
        .parse()
        .with_context(|| format!("{flag} is a count"))?;
    if n == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(n)
}

/// A duration in seconds, positive and finite.
fn seconds(flag: &str, value: &str) -> Result<Duration> {
    let s: f64 = value
        .parse()
        .with_context(|| format!("{flag} is a number of seconds, got {value:?}"))?;
    if !(s.is_finite() && s > 0.0 && s < 1e9) {
        bail!("{flag} must be a positive number of seconds below 1e9, got {value}");
    }
    Ok(Duration::from_secs_f64(s))
}

/// Raises the soft limit on open files to the hard one, as servers do (each connection is a
/// descriptor), and returns the limit in force.
fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live, writable one.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` through a pointer to a live one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur)
}

/// The cached `tiny` checkpoint, generated on first use.
fn default_model() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("k3").join("tiny");
    if !dir.join("config.json").exists() {
        let partial = base
            .join("k3")
            .join(format!("tiny.partial-{}", std::process::id()));
        let options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
        k3_model::synth::generate(&partial, &options).context("generating the tiny checkpoint")?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&partial, &dir).context("placing the tiny checkpoint")?;
        eprintln!(
            "no --model: generated the synthetic `tiny` checkpoint in {}",
            dir.display()
        );
    }
    Ok(dir)
}

fn main() -> Result<()> {
    // The libraries' log lines (an mlock failure, buffered expert reads, ...) on stderr.
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Info)
        .format_timestamp(None)
        .init();
    let args = parse()?;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => default_model()?,
    };
    let kernels = match args.tier {
        Some(tier) => Kernels::new(tier)?,
        None => Kernels::detect(),
    };
    log::info!("kernel tier {}", kernels.tier());
    let (engine, engine_thread) = spawn(EngineConfig {
        model_dir: model_dir.clone(),
        kernels,
        placement: args.placement,
        experts: args.experts.clone(),
        max_batch: args.max_batch,
        ctx: args.ctx,
        queue: args.queue,
        prefill_chunk: k3_model::model::PREFILL_CHUNK,
        panic_on_prompt: None,
    })?;
    if let Some(max) = engine.max_positions
        && args.ctx > max
    {
        bail!(
            "--ctx {} exceeds the model's max_position_embeddings of {max}",
            args.ctx
        );
    }
    let limits = Limits {
        model_name: model_dir
            .file_name()
            .map_or("k3".into(), |n| n.to_string_lossy().into_owned()),
        max_tokens_default: 256,
        context: args.ctx,
        thinking_effort: args.thinking_effort,
        vocab_size: engine.config.vocab_size,
    };
    if args.serve {
        let mut conn = args.conn;
        // A descriptor per connection, and some for the checkpoint's files and the rest.
        if let Some(open_files) = raise_open_files_limit() {
            let room = usize::try_from(open_files.saturating_sub(256))
                .unwrap_or(usize::MAX)
                .max(1);
            if conn.max_connections > room {
                log::warn!(
                    "--max-connections {} lowered to {room}: the open-files limit is {open_files}",
                    conn.max_connections
                );
                conn.max_connections = room;
            }
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let waiter = engine.clone();
        let served = runtime.block_on(async move {
            let address = format!("{}:{}", args.host, args.port);
            let listener = tokio::net::TcpListener::bind(&address)
                .await
                .with_context(|| format!("binding {address}"))?;
            log::info!(
                "serving {} on http://{}",
                limits.model_name,
                listener.local_addr()?
            );
            let state = AppState {
                engine,
                limits: Arc::new(limits),
            };
            let shutdown = async {
                // Ctrl-C or SIGTERM (what service managers send).
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = async { match &mut term { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
                }
                log::info!("shutting down: finishing open responses");
            };
            // The model loads while the server answers 503 "loading"; if it fails to load,
            // the process ends with the reason rather than answering 503 forever.
            let load_failed = async {
                match tokio::task::spawn_blocking(move || waiter.wait_loaded(None)).await {
                    Ok(Ok(())) => std::future::pending().await,
                    Ok(Err(why)) => why,
                    Err(e) => format!("waiting for the load failed: {e}"),
                }
            };
            tokio::select! {
                served = serve(listener, app(state), conn, shutdown) => served?,
                why = load_failed => bail!("the model did not load: {why}"),
            }
            // The router (and with it the engine's queue) is gone: the engine finishes what it
            // runs, saves the usage counts and stops.
            let _ = engine_thread.join();
            Ok(())
        });
        // Nothing blocking is left to wait for.
        runtime.shutdown_background();
        return served;
    }
    // One-shot generation.
    if let Err(why) = engine.wait_loaded(None) {
        bail!("the model did not load: {why}");
    }
    let request = ValidRequest {
        prompt: Prompt::Chat {
            segments: render(
                &[Message {
                    role: "user".into(),
                    content: args.prompt.clone().unwrap_or_default(),
                    ..Message::default()
                }],
                None,
                &ChatOptions {
                    thinking: args.thinking,
                    thinking_effort: args.thinking_effort,
                    ..ChatOptions::default()
                },
            )?,
            thinking: args.thinking,
        },
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed,
            ..SamplingParams::default()
        },
        max_tokens: args.max_tokens,
        stop: Vec::new(),
        stop_tokens: Vec::new(),
        stream: true,
        include_usage: false,
        logprobs: false,
    };
    let ids = prompt_ids(&engine.tokenizer, &request.prompt);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit(Job {
            request,
            prompt_ids: ids,
            events: tx,
        })
        .map_err(|e| anyhow::anyhow!("could not queue the prompt: {e:?}"))?;
    let mut tokens = 0;
    use std::io::Write;
    let mut out = std::io::stdout();
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::Delta {
                reasoning, content, ..
            } => {
                write!(out, "{reasoning}{content}")?;
                out.flush()?;
            }
            Event::Done {
                finish_reason,
                completion_tokens,
                prompt_tokens,
                prefill,
                decode,
            } => {
                tokens = completion_tokens;
                println!();
                // The first token comes with the prefill; the rest are decode steps.
                println!(
                    "{completion_tokens} tokens ({finish_reason}); prefill of {prompt_tokens} tokens {:.3} s, then {:.2} tokens/s decoding ({:.2} s in all)",
                    prefill.as_secs_f64(),
                    completion_tokens.saturating_sub(1) as f64 / decode.as_secs_f64().max(1e-9),
                    start.elapsed().as_secs_f64()
                );
            }
            Event::Error(message) => bail!("generation failed: {message}"),
        }
    }
    if tokens == 0 {
        bail!("no tokens were generated");
    }
    Ok(())
}
