//! `k3-serve`: one-shot generation (`--prompt`) or the OpenAI-compatible server (`--serve`).
//!
//! Every flag is in one table, `k3_serve::cli::k3_serve_flags` (`k3-serve --help` prints it
//! with the defaults; the parser and the library flags are `k3-cli`'s, shared with the decode
//! bench); `--flag value`, `--flag=value` and the llama-server / vLLM spellings
//! (`-m`, `-t`, `--ctx-size`, `-np`, ...) are accepted. A mistake on the command line (a
//! `--model` that is no checkpoint directory included) prints one line and exits 2; a failure
//! after that (a model that does not load) prints its report and exits 1.
//!
//! Without `--model` it generates the `tiny` synthetic checkpoint once into a cache directory
//! (`$XDG_CACHE_HOME/k3/tiny`, else `~/.cache/k3/tiny`) and uses it. A model that fails to
//! load ends the process with the reason, in both modes.
//!
//! This file is the startup every run shares (the engine, the served names, the limits); the
//! binary's other files, bottom-up: `startup` what is set up before the engine, `args` the
//! command line, `follower` the ranks but 0 under `mpirun`, `one_shot` the `--prompt` run,
//! `serving` the server. (`lib.rs` does not declare them: they are the binary's.)

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Result, bail};
use k3_serve::api::Limits;
use k3_serve::cli;
use k3_serve::engine::{EngineConfig, PromptCacheOptions, spawn};
use k3_serve::naming;
use serde_json::Value;

mod args;
mod follower;
mod one_shot;
mod serving;
mod startup;

use args::usage_exit;
use one_shot::one_shot;
use startup::{default_model, prompt_cache_options};

/// `max_tokens` when neither `--max-tokens` nor a request gives it: a one-shot run's, and the
/// server's (at most the context less one).
const ONE_SHOT_MAX_TOKENS: usize = 32;
const SERVER_MAX_TOKENS: usize = 256;

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
    let mut args = match args::parse(&table, std::env::args().skip(1)) {
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
        prompt_cache_options(
            args.engine.memory_bytes,
            args.prompt_cache_gb,
            args.prompt_cache_dir.clone(),
        )
    } else {
        PromptCacheOptions::default()
    };
    // The memory plan counts the prompt cache's bytes with the weights'.
    args.engine.prompt_cache_bytes = prompt_cache.budget_bytes as u64;
    let (engine, engine_thread) = spawn(EngineConfig {
        model_dir: model_dir.clone(),
        options: args.engine.clone(),
        queue: args.queue,
        step_tokens: args.step_tokens,
        prompt_cache,
        panic_on_prompt: None,
        scripted_answers: Vec::new(),
        hold_load: std::env::var_os("K3_SERVE_TEST_HOLD_LOAD").is_some_and(|v| v == "1"),
        max_mask: args.max_mask,
        spec: args.spec,
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
    let config_json: Value = k3_model::config::read_config_text(&model_dir)
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
        max_compile: args.max_compile,
        max_mask: args.max_mask,
        created,
    };
    if !args.serve {
        let outcome = one_shot(&engine, &limits, &args);
        // The queue closes with the last handle: the engine then saves the expert usage
        // counts (the next start's preload order) and stops. Returning at once let the
        // process end before the file was written (none, or a partial `.tmp`). As the server
        // does, a model that never loaded is not waited for: it holds nothing to save.
        let loaded = engine.ready.load(std::sync::atomic::Ordering::Acquire);
        drop(engine);
        if loaded {
            let _ = engine_thread.join();
        }
        return outcome;
    }
    serving::serve_http(args, engine, engine_thread, limits)
}
