//! Teacher-forced decode benchmark: consumes a fixed token sequence one token at a time and
//! reports per-step time, the median ms/token, the weight bytes one token reads, the achieved
//! GB/s, and the FNV-1a 64 fingerprint of every step's logits and of them all. The achieved
//! bandwidth is given as a fraction of the machine's read bandwidth, probed between steps in
//! the same run with the same thread count (median of the per-step ratios).
//!
//! `cargo run --release -p k3-bench --bin teacher_forced_decode_bench -- --model DIR
//!  [--tokens 5,17,42,...] [--steps N] [--threads N] [--prefill-chunk N] [--kernel-tier T]
//!  [--logits-out FILE] [--resident-trunk]`; `--help` lists every flag with its default. The
//! flags are parsed by `k3-cli` (the library flags are k3-serve's too), and the engine is
//! assembled by `k3_model::builder`, as the server's is.
//!
//! `--resident-trunk` copies every text tensor but the routed experts out of the file mapping
//! into huge-page memory before decoding, each domain's rows of every matrix bound to its NUMA
//! node; the logits are the same.
//!
//! Routed experts: by default they are read through the file mapping. `--expert-cache N`
//! (experts per layer; 0 reads every expert on use), `--expert-cache-gb G` or
//! `--preload-experts` serve them from the expert store instead: O_DIRECT reads on
//! `--io-threads` threads (default 16), `--preload-experts` fills the cache first (a progress
//! bar, then time and GB/s), `--mlock` pins what is resident, `--expert-policy lru|usage`
//! picks the eviction policy, and the usage file (`k3-expert-usage.json` beside the shards, or
//! `--usage-file F`) orders the preload and seeds the usage policy unless `--no-usage-cache`.
//! Each step then also prints the time it waited on loads and the bytes it read; the run ends
//! with the store's statistics. Logits are the same bits either way.
//!
//! Placement: `--threads N` is the number of workers in all (default 1), split evenly over the
//! domains; `--numa` makes each NUMA node a domain, `--numa-fake N` splits the CPUs into N
//! synthetic domains, `--numa-threads N` puts N workers in every domain (instead of
//! `--threads`), `--hyperthreads` keeps hyperthread siblings (skipped by default). Workers are
//! pinned to their domain's CPUs; row blocks, head groups and lm_head shards are spread over
//! the domains, and so are every routed expert's rows (`--expert-placement split`, the
//! default) or each expert runs whole on its home domain (`home`). Logits are the same bits
//! for any of these.
//!
//! Without `--model` it first generates a synthetic checkpoint (`--preset`, default `k3-0.40b`:
//! the public 0.40B model's shapes, 0.75 GB, a few seconds) into a temporary directory that is
//! removed when it exits: the engine's main job on a built-in default.
//!
//! With `--prefill-chunk N` the tokens are consumed N at a time (layer-major, bit-identical to
//! N = 1); each chunk's time is divided among its tokens. `--threads N` runs the row blocks
//! and expert tasks on N pinned workers (one domain; bit-identical logits for any N).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use k3_model::builder::{BuildSink, Engine, EngineOptions};
use k3_model::config::K3Config;
use k3_model::model::{Model, Session};
use k3_model::profile::Profile;
use k3_model::synth::{SynthOptions, generate};

use crate::args::{Args, BINARY, bench_flags, parse, seeded_tokens};
use crate::decode::decode;
use crate::prefill::time_prefill;
use crate::sink::Stderr;

mod args;
mod decode;
mod prefill;
mod probe;
mod ranks;
mod report;
mod sink;

/// A session that has consumed the first `depth` of `tokens` (in forward passes of `chunk`
/// tokens, untimed, with a line saying how long it took), and the tokens after them. With
/// `fill` between 1 and `depth - 1`, only the first `fill` tokens are prefilled and their MLA
/// cache rows repeated up to the depth (`Session::repeat_context`: timing only, said so).
fn at_depth<'t>(
    model: &Model<'_>,
    tokens: &'t [usize],
    depth: usize,
    (chunk, fill): (usize, usize),
) -> Result<(Session, &'t [usize])> {
    anyhow::ensure!(
        depth < tokens.len(),
        "--depth {depth} leaves no token to time: --tokens gives {}",
        tokens.len()
    );
    anyhow::ensure!(
        fill <= depth,
        "--depth-fill {fill} is past --depth {depth}: it prefills that many of the depth's tokens"
    );
    let prefilled = if fill == 0 { depth } else { fill };
    let mut session = model.session();
    if prefilled > 0 {
        let start = Instant::now();
        model.prefill(&mut session, &tokens[..prefilled], chunk)?;
        let seconds = start.elapsed().as_secs_f64();
        eprintln!(
            "depth: {prefilled} tokens prefilled in chunks of {chunk} in {seconds:.1} s ({:.1} tokens/s, untimed)",
            prefilled as f64 / seconds
        );
    }
    if prefilled < depth {
        session.repeat_context(depth)?;
        eprintln!(
            "depth: the MLA caches' {prefilled} rows repeated to {depth} positions (--depth-fill): \
             the steps' attention works over {depth} positions, but the logits are those of no \
             real context"
        );
    }
    Ok((session, &tokens[depth..]))
}

/// A generated checkpoint's directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> Result<()> {
    // The libraries' log lines (an mlock failure, buffered expert reads, ...) on stderr.
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .format_timestamp(None)
        .init();
    let ranks = Arc::new(numa_sched::Ranks::join()?);
    let leader = ranks.is_leader();
    let table = bench_flags();
    let args: Args = match parse(&table, std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => return Ok(()),
        Err(e) => {
            // A usage error: one line, exit 2 (as k3-serve).
            eprintln!("{BINARY}: {e}");
            std::process::exit(2);
        }
    };
    let mut generated = None;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = std::env::temp_dir().join(format!("k3-decode-synth-{}", std::process::id()));
            let scratch = generated.insert(Scratch(dir));
            let start = Instant::now();
            let options = SynthOptions::new(args.preset);
            let report =
                generate(&scratch.0, &options).context("generating the synthetic checkpoint")?;
            (leader).then(|| eprintln!(
                "no --model: generated a synthetic {} checkpoint ({:.2} GB, {} tensors) in {:.1} s at {}",
                args.preset,
                report.bytes as f64 / 1e9,
                report.tensors,
                start.elapsed().as_secs_f64(),
                scratch.0.display()
            ));
            scratch.0.clone()
        }
    };
    let config_text = k3_model::config::read_config_text(&model_dir)?;
    let config = K3Config::from_json(&config_text)?;
    // The KV cache the memory plan counts: one sequence of every token consumed.
    let options = EngineOptions {
        ctx: args.tokens.as_ref().map_or(
            args.depth + args.prefill.unwrap_or(0).max(args.steps),
            Vec::len,
        ),
        ranks: Arc::clone(&ranks),
        ..args.engine.clone()
    };
    // Under mpirun, ranks other than 0 print their startup line and errors only.
    // The build's lines about an option end with its flag; so does a failure's message.
    let mut quiet = |_: &str| {};
    let mut stderr = k3_cli::FlagHints(Stderr::default());
    let sink: &mut dyn BuildSink = if leader { &mut stderr } else { &mut quiet };
    let engine = Engine::build(&model_dir, config, &options, sink)
        .map_err(|e| anyhow::anyhow!(k3_cli::with_flags(&e)))?;
    let share = engine.rank_share(&ranks);
    if ranks.size() > 1 {
        eprintln!("{}", share.describe(&ranks));
    }
    let model = engine.model()?;
    // `--profile`: every rank profiles its part (rank 0 prints each rank's attention).
    let profile = Arc::new(Profile::new());
    let model = if args.profile {
        model.with_profile(Arc::clone(&profile))
    } else {
        model
    };
    if !leader {
        return ranks::follow(model, &ranks, &model_dir, &share, &profile);
    }
    let tokens = match &args.tokens {
        Some(tokens) => tokens.clone(),
        None => seeded_tokens(
            args.depth + args.prefill.unwrap_or(0).max(args.steps),
            engine.config().vocab_size,
        ),
    };
    // `--depth N`: the first N tokens prefilled, untimed; the timed work starts there.
    let (session, tokens) = at_depth(
        &model,
        &tokens,
        args.depth,
        (args.depth_chunk, args.depth_fill),
    )?;
    model.reset_profile();
    if let Some(n) = args.prefill {
        let timed = time_prefill(
            &model,
            &session,
            tokens,
            n,
            args.prefill_chunk,
            args.profile.then_some(&*profile),
        );
        ranks::finish(model, &ranks, &model_dir, &share, &profile, None);
        return timed;
    }
    let collectives = decode(&model, session, &engine, &args, tokens, &profile, &ranks)?;
    // The profile covers the steps after the first chunk (see `decode`).
    let profiled = tokens.len() - tokens.len().min(args.prefill_chunk);
    ranks::finish(
        model,
        &ranks,
        &model_dir,
        &share,
        &profile,
        Some((collectives, tokens.len(), profiled)),
    );
    match engine.save_usage() {
        Some((path, Ok(()))) => eprintln!("expert usage saved to {}", path.display()),
        Some((_, Err(e))) => eprintln!("warning: expert usage not saved: {e}"),
        None => {}
    }
    Ok(())
}
