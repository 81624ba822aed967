//! `k3-serve`: one-shot generation (`--prompt`) or the OpenAI-compatible server (`--serve`).
//!
//! Every flag is in one table, `k3_serve::cli::k3_serve_flags` (`k3-serve --help` prints it
//! with the defaults; the parser and the library flags are `k3-cli`'s, shared with the decode
//! bench); `--flag value`, `--flag=value` and the llama-server / vLLM spellings
//! (`-m`, `-t`, `--ctx-size`, ...) are accepted. A mistake on the command line prints one line
//! and exits 2; a failure after that (a model that does not load) prints its report and
//! exits 1.
//!
//! Without `--model` it generates the `tiny` synthetic checkpoint once into a cache directory
//! (`$XDG_CACHE_HOME/k3/tiny`, else `~/.cache/k3/tiny`) and uses it. A model that fails to
//! load ends the process with the reason, in both modes.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use k3_model::builder::EngineOptions;
use k3_model::packcache::PackCachePlace;

mod follower;
use k3_model::chat::ThinkingEffort;
use k3_serve::api::{ChatRequest, CompletionRequest, Limits};
use k3_serve::auth::{ApiKeys, require_api_key};
use k3_serve::cli::{self, Flag, Outcome, Parsed, UsageError};
use k3_serve::conn::{ConnLimits, serve};
use k3_serve::engine::{EngineConfig, Event, Job, PromptCacheOptions, prompt_ids, spawn};
use k3_serve::naming;
use k3_serve::server::{AppState, app};
use serde_json::{Value, json};

const BINARY: &str = "k3-serve";
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `max_tokens` when neither `--max-tokens` nor a request gives it.
const ONE_SHOT_MAX_TOKENS: usize = 32;
const SERVER_MAX_TOKENS: usize = 256;

struct Args {
    model: Option<PathBuf>,
    serve: bool,
    host: String,
    port: u16,
    /// What the engine is built with: the library flags, `--scan`, `--max-batch`, `--ctx`.
    engine: EngineOptions,
    queue: usize,
    conn: ConnLimits,
    prompt: Option<String>,
    /// `--raw`: the one-shot prompt is plain text, not a user message.
    raw: bool,
    /// `--load-state`, `--save-state` (one-shot only).
    state: k3_serve::engine::StateFiles,
    /// `--max-tokens`: the one-shot run's tokens, the server's default.
    max_tokens: Option<usize>,
    /// One-shot only (the server takes each request's).
    temperature: f32,
    seed: u64,
    /// Thinking when nothing else says (`--no-think` turns it off).
    thinking: bool,
    /// The chat template's `thinking_effort` for requests that give none.
    thinking_effort: ThinkingEffort,
    /// `--api-key` (each), `K3_API_KEY` and the lines of `--api-key-file`.
    api_keys: Vec<String>,
    served_model_names: Vec<String>,
    /// `--prompt-cache-gb` (`None`: the default share of the memory budget).
    prompt_cache_gb: Option<f64>,
    prompt_cache_dir: Option<PathBuf>,
}

/// The command line (without the program name) as [`Args`]; `None` when `--help` or
/// `--version` was printed.
fn parse(
    table: &[Flag],
    args: impl IntoIterator<Item = String>,
) -> Result<Option<Args>, UsageError> {
    let mut p = match cli::parse(table, args)? {
        Outcome::Run(parsed) => parsed,
        Outcome::Help => {
            print!("{}", cli::render_help(table, BINARY, VERSION));
            return Ok(None);
        }
        Outcome::Version => {
            print!("{}", cli::render_version(BINARY, VERSION));
            return Ok(None);
        }
    };
    p.fill_from_env(table, |var| std::env::var(var).ok())?;
    let mut engine = EngineOptions {
        scan: p.switch("scan"),
        max_batch: p.get_or_default(table, "max-batch")?,
        ctx: p.get_or_default(table, "ctx")?,
        ..EngineOptions::default()
    };
    cli::apply_library_flags(&p, &mut engine)?;
    if engine.pack_cache == PackCachePlace::Auto(None) {
        // Where the checkpoint's directory is read-only, the pack cache goes to the user's.
        engine.pack_cache = PackCachePlace::Auto(Some(user_cache_dir().join("k3")));
    }
    let seconds = |name: &str| -> Result<Duration, UsageError> {
        Ok(Duration::from_secs_f64(p.get_or_default(table, name)?))
    };
    let a = Args {
        model: p.get_str("model").map(PathBuf::from),
        serve: p.switch("serve"),
        host: p.get_or_default(table, "host")?,
        port: p.get_or_default(table, "port")?,
        engine,
        queue: p.get_or_default(table, "queue")?,
        conn: ConnLimits {
            header: seconds("header-timeout-s")?,
            body: seconds("body-timeout-s")?,
            idle: seconds("idle-timeout-s")?,
            max_connections: p.get_or_default(table, "max-connections")?,
        },
        prompt: p.get_str("prompt").map(str::to_owned),
        raw: p.switch("raw"),
        state: k3_serve::engine::StateFiles {
            load: p.get_str("load-state").map(PathBuf::from),
            save: p.get_str("save-state").map(PathBuf::from),
        },
        max_tokens: p.get_usize("max-tokens")?,
        temperature: p.get_f32("temperature")?.unwrap_or(0.0),
        seed: p.get_u64("seed")?.unwrap_or(0),
        thinking: !p.switch("no-think"),
        thinking_effort: p.get_or_default(table, "thinking-effort")?,
        api_keys: api_keys(&p)?,
        served_model_names: p
            .all("served-model-name")
            .into_iter()
            .map(str::to_owned)
            .collect(),
        prompt_cache_gb: p.get_f64("prompt-cache-gb")?,
        prompt_cache_dir: p.get_str("prompt-cache-dir").map(PathBuf::from),
    };
    check_mode(&p, &a)?;
    if let (true, Some(dir)) = (a.serve, &a.prompt_cache_dir) {
        check_prompt_cache_dir(dir)?;
    }
    Ok(Some(a))
}

/// Every `--api-key` (or `K3_API_KEY`), then the keys in `--api-key-file` (one per line,
/// trimmed; blank lines skipped). A file that cannot be read, or holds no key, is a usage
/// error.
fn api_keys(p: &Parsed) -> Result<Vec<String>, UsageError> {
    let mut keys: Vec<String> = p.all("api-key").into_iter().map(str::to_owned).collect();
    if let Some(path) = p.get_str("api-key-file") {
        let text = std::fs::read_to_string(path)
            .map_err(|e| UsageError::Other(format!("--api-key-file {path}: {e}")))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .map(str::to_owned),
        );
        if keys.len() == before {
            return Err(UsageError::Other(format!(
                "--api-key-file {path} holds no key (one key per line)"
            )));
        }
    }
    Ok(keys)
}

/// The flags that belong to one mode, given in the other.
fn check_mode(p: &Parsed, a: &Args) -> Result<(), UsageError> {
    match (a.serve, &a.prompt) {
        (false, None) => Err(UsageError::Other(
            "give --prompt TEXT for a one-shot generation, or --serve to start the server; see --help".into(),
        )),
        (true, Some(_)) => Err(UsageError::Other(
            "--prompt is for a one-shot run and --serve starts the server: give one of them".into(),
        )),
        (true, None) => {
            for name in ["temperature", "seed", "raw", "load-state", "save-state"] {
                if p.has(name) {
                    return Err(UsageError::Other(format!(
                        "--{name} is for a one-shot run; the server takes each request's {name}"
                    )));
                }
            }
            Ok(())
        }
        (false, Some(_)) => {
            for name in [
                "served-model-name",
                "host",
                "port",
                "max-connections",
                "queue",
                "prompt-cache-gb",
                "prompt-cache-dir",
                "api-key-file",
            ] {
                if p.has(name) {
                    log::warn!("--{name} applies to the server (--serve) and is ignored by a one-shot run");
                }
            }
            Ok(())
        }
    }
}

/// `--prompt-cache-dir`: a directory, or a path the engine can make one (its parent is a
/// directory: the engine creates the last directory only, so a mistyped path is not built).
/// Checked here, before the model loads, which would otherwise come first and the cache's
/// failure only as a warning after it.
fn check_prompt_cache_dir(dir: &Path) -> Result<(), UsageError> {
    use std::io::ErrorKind::{NotADirectory, NotFound};
    let refuse = |why: String| {
        Err(UsageError::Other(format!(
            "--prompt-cache-dir {}: {why}",
            dir.display()
        )))
    };
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => return refuse("exists and is not a directory".into()),
        Err(e) if !matches!(e.kind(), NotFound | NotADirectory) => return refuse(e.to_string()),
        Err(_) => {}
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let shown = parent.display();
    match std::fs::metadata(parent) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => refuse(format!("its parent {shown} is not a directory")),
        Err(e) if e.kind() == NotADirectory => {
            refuse(format!("its parent {shown} is not a directory"))
        }
        Err(e) if e.kind() == NotFound => refuse(format!(
            "its parent {shown} does not exist (only the last directory is created)"
        )),
        Err(e) => refuse(format!("its parent {shown}: {e}")),
    }
}

/// A usage error: one line, exit 2, whatever `RUST_BACKTRACE` says.
fn usage_exit(message: impl std::fmt::Display) -> ! {
    eprintln!("{BINARY}: {message}");
    std::process::exit(2);
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

/// The prompt cache `--prompt-cache-gb` and `--prompt-cache-dir` ask for; without
/// `--prompt-cache-gb`, a tenth of the memory budget (`--memory-gb`, else the memory this
/// process may allocate at startup; 1 GiB where that cannot be read). The choice is logged;
/// the engine's memory plan sets these bytes aside (`EngineOptions::prompt_cache_bytes`).
fn prompt_cache_options(args: &Args) -> PromptCacheOptions {
    const GIB: f64 = (1u64 << 30) as f64;
    let budget = match args.engine.memory_bytes {
        Some(bytes) => Some(expert_store::io::MemoryBudget {
            bytes,
            source: "--memory-gb".into(),
            limit: true,
        }),
        None => expert_store::io::memory_budget(),
    };
    let (budget_bytes, why) = match args.prompt_cache_gb {
        Some(gb) => ((gb * GIB) as usize, "--prompt-cache-gb".to_owned()),
        None => match budget {
            Some(budget) => (
                (budget.bytes / 10) as usize,
                format!(
                    "a tenth of the {:.1} GiB memory budget ({})",
                    budget.bytes as f64 / GIB,
                    budget.source
                ),
            ),
            None => (1 << 30, "the memory budget is unknown".to_owned()),
        },
    };
    if budget_bytes == 0 {
        log::info!("prompt cache off (--prompt-cache-gb 0)");
    } else {
        log::info!(
            "prompt cache: {:.2} GiB of snapshots in memory ({why}){}",
            budget_bytes as f64 / GIB,
            args.prompt_cache_dir
                .as_ref()
                .map_or(String::new(), |d| format!(", spilled to {}", d.display()))
        );
    }
    PromptCacheOptions {
        budget_bytes,
        dir: args.prompt_cache_dir.clone(),
    }
}

/// The user's cache directory: `$XDG_CACHE_HOME`, else `$HOME/.cache`, else the temporary
/// directory.
fn user_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
}

/// The cached `tiny` checkpoint, generated on first use.
fn default_model() -> Result<PathBuf> {
    let base = user_cache_dir();
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
    // Under mpirun: ranks other than 0 print their startup line and errors only.
    let ranks = Arc::new(numa_sched::Ranks::join()?);
    // The libraries' log lines (an mlock failure, buffered expert reads, ...) on stderr.
    env_logger::Builder::new()
        .filter_level(if ranks.is_leader() {
            log::LevelFilter::Info
        } else {
            log::LevelFilter::Error
        })
        .format_timestamp(None)
        .init();
    let table = cli::k3_serve_flags();
    let mut args = match parse(&table, std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => return Ok(()),
        Err(e) => usage_exit(e),
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => default_model()?,
    };
    args.engine.ranks = Arc::clone(&ranks);
    if !ranks.is_leader() {
        return follower::follow(&model_dir, &args.engine);
    }
    let ctx = args.engine.ctx;
    let prompt_cache = if args.serve {
        prompt_cache_options(&args)
    } else {
        PromptCacheOptions::default()
    };
    // The memory plan counts the prompt cache's bytes with the weights'.
    args.engine.prompt_cache_bytes = prompt_cache.budget_bytes as u64;
    let (engine, engine_thread) = spawn(EngineConfig {
        model_dir: model_dir.clone(),
        options: args.engine.clone(),
        queue: args.queue,
        prefill_chunk: k3_model::model::PREFILL_CHUNK,
        prompt_cache,
        panic_on_prompt: None,
        scripted_answers: Vec::new(),
    })?;
    if let Some(max) = engine.max_positions
        && ctx > max
    {
        bail!(
            "--ctx {} exceeds the model's max_position_embeddings of {max}",
            ctx
        );
    }
    // The config's model id, a Hugging Face cache path's repo, or the directory's name.
    let config_json: Value = std::fs::read_to_string(model_dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    let model_names = naming::served_names(
        naming::default_served_name(&model_dir, &config_json),
        &args.served_model_names,
    );
    let max_tokens_default = args.max_tokens.unwrap_or(if args.serve {
        SERVER_MAX_TOKENS.min(ctx.saturating_sub(1)).max(1)
    } else {
        ONE_SHOT_MAX_TOKENS
    });
    if max_tokens_default >= ctx {
        usage_exit(format!(
            "max_tokens {max_tokens_default} (--max-tokens) leaves no room for a prompt in --ctx {}; lower one or raise the other",
            ctx
        ));
    }
    let limits = Limits {
        model_names,
        max_tokens_default,
        context: ctx,
        thinking_effort: args.thinking_effort,
        thinking: args.thinking,
        vocab_size: engine.config.vocab_size,
        created,
    };
    if !args.serve {
        return one_shot(&engine, &limits, &args);
    }
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
    let api_key = ApiKeys::new(&args.api_keys);
    if api_key.is_set() {
        log::info!(
            "API key required on /v1 (/health and /metrics are open); {} key{}, each its own \
             prompt-cache tenant",
            api_key.len(),
            if api_key.len() == 1 { "" } else { "s" }
        );
    } else {
        log::info!("no --api-key: the API is open to anyone who can reach the port");
    }
    // The HTTP runtime is deliberately unpinned: its two threads sleep on sockets and touch
    // no weights, and the compute pool's CPUs are the ones worth keeping for compute.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let waiter = engine.clone();
    let loaded = Arc::clone(&engine.ready);
    let (host, port) = (args.host.clone(), args.port);
    let served = runtime.block_on(async move {
        let address = format!("{host}:{port}");
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("binding {address}"))?;
        let also = &limits.model_names[1..];
        log::info!(
            "serving {:?}{} on http://{}",
            limits.model_name(),
            if also.is_empty() {
                String::new()
            } else {
                format!(" (also as {})", also.join(", "))
            },
            listener.local_addr()?
        );
        let state = AppState {
            engine,
            limits: Arc::new(limits),
        };
        let router = app(state).layer(axum::middleware::from_fn_with_state(
            api_key,
            require_api_key,
        ));
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
            served = serve(listener, router, conn, shutdown) => served?,
            why = load_failed => bail!("the model did not load: {why}"),
        }
        // The router (and with it the engine's queue) is gone: the engine finishes what it
        // runs, saves the usage counts and stops. A model still loading is not waited for:
        // the load may take minutes, or wait on a file for ever, and holds nothing to save;
        // the process's exit ends it.
        if loaded.load(Ordering::Acquire) {
            let _ = engine_thread.join();
        } else {
            log::info!("the model had not loaded: not waiting for the load");
        }
        Ok(())
    });
    // Nothing blocking is left to wait for.
    runtime.shutdown_background();
    served
}

/// The one-shot run: `--prompt` as a user message, validated as the server validates a chat
/// request (the same `ChatRequest::validate`), or with `--raw` as plain text (a completion
/// request), checked against `--ctx`, then generated; from `--load-state`'s state when given,
/// and with `--save-state` writing the state after the answer. The
/// answer goes to stdout; the reasoning (marked `[reasoning]`, dimmed on a terminal), the
/// `[answer]` mark and the timing line go to stderr, so `k3-serve --prompt ... > out.txt`
/// keeps the answer alone.
fn one_shot(engine: &k3_serve::engine::EngineHandle, limits: &Limits, args: &Args) -> Result<()> {
    let body = json!({
        "messages": [{"role": "user", "content": args.prompt.clone().unwrap_or_default()}],
        "max_tokens": limits.max_tokens_default,
        "temperature": args.temperature,
        "seed": args.seed,
        "stream": true,
    });
    let request = if args.raw {
        let mut body = body;
        let object = body.as_object_mut().expect("a JSON object");
        object.remove("messages");
        object.insert(
            "prompt".into(),
            json!(args.prompt.clone().unwrap_or_default()),
        );
        let request: CompletionRequest =
            serde_json::from_value(body).context("building the request")?;
        request.validate(limits)
    } else {
        let request: ChatRequest = serde_json::from_value(body).context("building the request")?;
        request.validate(limits)
    };
    let request = request.unwrap_or_else(|e| {
        let flag = match e.param.as_deref() {
            Some("max_tokens") => "--max-tokens",
            Some("temperature") => "--temperature",
            Some("seed") => "--seed",
            _ => "--prompt",
        };
        usage_exit(format!("{flag}: {}", e.message))
    });
    if let Err(why) = engine.wait_loaded(None) {
        bail!("the model did not load: {why}");
    }
    let ids = prompt_ids(&engine.tokenizer, &request.prompt);
    if ids.len() + request.max_tokens > limits.context {
        usage_exit(format!(
            "the prompt ({} tokens, chat template included) plus --max-tokens {} exceeds --ctx {}",
            ids.len(),
            request.max_tokens,
            limits.context
        ));
    }
    let max_tokens = request.max_tokens;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit(Job {
            request,
            prompt_ids: ids,
            system_tokens: 0,
            cache_namespace: Default::default(),
            events: tx,
            log_id: None,
            submitted: start,
            state: args.state.clone(),
        })
        .map_err(|e| anyhow::anyhow!("could not queue the prompt: {e:?}"))?;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    let (dim, undim) = if err.is_terminal() {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let (mut in_reasoning, mut reasoned, mut answered) = (false, false, false);
    let mut tokens = 0;
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::Delta {
                reasoning, content, ..
            } => {
                if !reasoning.is_empty() {
                    if !in_reasoning {
                        write!(err, "[reasoning]\n{dim}")?;
                        in_reasoning = true;
                        reasoned = true;
                    }
                    write!(err, "{reasoning}")?;
                    err.flush()?;
                }
                if !content.is_empty() {
                    if in_reasoning {
                        writeln!(err, "{undim}")?;
                        in_reasoning = false;
                    }
                    if reasoned && !answered {
                        writeln!(err, "[answer]")?;
                    }
                    answered = true;
                    write!(out, "{content}")?;
                    out.flush()?;
                }
            }
            Event::Done {
                finish_reason,
                completion_tokens,
                prompt_tokens,
                cached_tokens,
                prefill,
                decode,
            } => {
                tokens = completion_tokens;
                if in_reasoning {
                    writeln!(err, "{undim}")?;
                }
                if answered {
                    writeln!(out)?;
                } else if reasoned && finish_reason == "length" {
                    writeln!(
                        err,
                        "[no answer: the {max_tokens} tokens ran out while thinking; raise --max-tokens or give --no-think]"
                    )?;
                }
                let total = start.elapsed().as_secs_f64();
                let prefill = prefill.as_secs_f64();
                // Tokens restored from --load-state instead of prefilled.
                let prompt_tokens = if cached_tokens > 0 {
                    format!("{prompt_tokens} ({cached_tokens} restored from --load-state)")
                } else {
                    prompt_tokens.to_string()
                };
                // The first token comes with the prefill; the rest are decode steps, so one
                // token has no decode rate.
                if completion_tokens <= 1 {
                    let unit = if completion_tokens == 1 {
                        "token"
                    } else {
                        "tokens"
                    };
                    writeln!(
                        err,
                        "{completion_tokens} {unit} ({finish_reason}); prefill of {prompt_tokens} tokens {prefill:.3} s ({total:.2} s in all)"
                    )?;
                } else {
                    writeln!(
                        err,
                        "{completion_tokens} tokens ({finish_reason}); prefill of {prompt_tokens} tokens {prefill:.3} s, then {:.2} tokens/s decoding ({total:.2} s in all)",
                        (completion_tokens - 1) as f64 / decode.as_secs_f64().max(1e-9),
                    )?;
                }
            }
            Event::Error(message) => bail!("generation failed: {message}"),
        }
    }
    if tokens == 0 {
        bail!("no tokens were generated");
    }
    Ok(())
}
