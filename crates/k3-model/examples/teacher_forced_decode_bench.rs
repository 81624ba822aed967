//! Teacher-forced decode benchmark: consumes a fixed token sequence one token at a time and
//! reports per-step time, the median ms/token, the weight bytes one token reads, the achieved
//! GB/s, and the FNV-1a 64 fingerprint of every step's logits and of them all. The achieved
//! bandwidth is given as a fraction of the machine's read bandwidth, probed between steps in
//! the same run with the same thread count (median of the per-step ratios).
//!
//! `cargo run --release -p k3-model --example teacher_forced_decode_bench -- --model DIR
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

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use expert_store::store::PreloadProgress;
use k3_cli::{Flag, Group, Kind, Outcome, UsageError};
use k3_model::builder::{BuildSink, Engine, EngineOptions};
use k3_model::config::K3Config;
use k3_model::experts::stats_report;
use k3_model::inventory::BytePlan;
use k3_model::model::{ExpertPlacement, Model, fingerprint};
use k3_model::plan::Plan;
use k3_model::profile::{Bucket, Profile};
use k3_model::shares::RankShare;
use k3_model::synth::{Preset, SynthOptions, generate};

const BINARY: &str = "teacher_forced_decode_bench";

/// The section of `--help` for the bench's own flags.
const BENCH: Group = Group::new("Benchmark");

/// The presets `--preset` generates.
const PRESETS: &[&str] = &["tiny", "k3-0.40b", "k3-wide"];

/// Every flag the bench takes: its own, then the library flags (`--threads` defaulting to 1),
/// then `--expert-placement`.
fn bench_flags() -> Vec<Flag> {
    use Kind::*;
    let mut table = vec![
        Flag::value(
            "model",
            "DIR",
            Text,
            "a checkpoint of --preset, generated into a temporary directory",
            BENCH,
            "checkpoint directory: config.json and *.safetensors",
        ),
        Flag::value(
            "preset",
            "NAME",
            Choice(PRESETS),
            "k3-0.40b",
            BENCH,
            "the synthetic checkpoint generated without --model: tiny, k3-0.40b or k3-wide",
        ),
        Flag::value(
            "tokens",
            "IDS",
            Text,
            "--steps ids of a fixed seeded sequence",
            BENCH,
            "the token ids consumed, comma-separated",
        ),
        Flag::value(
            "steps",
            "N",
            Count,
            "16",
            BENCH,
            "tokens consumed (without --tokens)",
        ),
        Flag::value(
            "prefill-chunk",
            "N",
            Count,
            "1",
            BENCH,
            "tokens consumed per forward pass (layer-major; the same bits for any N)",
        ),
        Flag::value(
            "prefill",
            "N",
            Count,
            "none: decode",
            BENCH,
            "time a prefill of the first N tokens (median of five) instead of decoding",
        ),
        Flag::value(
            "logits-out",
            "FILE",
            Text,
            "none",
            BENCH,
            "write every step's logits to FILE (f32, little-endian)",
        ),
        Flag::value(
            "probe-mb",
            "N",
            Whole,
            "512",
            BENCH,
            "size in MiB of the read-bandwidth probe run between steps (0: no probe; under a \
             memory limit, off unless it fits beside the memory plan)",
        ),
        Flag::switch(
            "profile",
            BENCH,
            "print where the timed steps' wall time went, by bucket",
        ),
    ];
    table.extend(k3_cli::library_flags_with_threads("1"));
    table.push(Flag::value(
        "expert-placement",
        "WHERE",
        Choice(&["split", "home"]),
        "split",
        Group::NUMA,
        "every routed expert's rows spread over the domains (split), or each whole on its home domain",
    ));
    table
}

#[derive(Debug)]
struct Args {
    model: Option<PathBuf>,
    /// Generated when there is no `--model` (default `k3-0.40b`).
    preset: Preset,
    tokens: Option<Vec<usize>>,
    steps: usize,
    prefill_chunk: usize,
    logits_out: Option<PathBuf>,
    /// `--probe-mb N`: the read probe's buffer in MiB (0: no probe).
    probe_mb: usize,
    /// `--prefill N`: time a prefill of the first N tokens instead of decoding.
    prefill: Option<usize>,
    /// `--profile`: print where the timed steps' wall time went, by bucket.
    profile: bool,
    /// The library flags and `--expert-placement` (`ctx` is set once the tokens are known).
    engine: EngineOptions,
}

/// The command line as [`Args`]; `None` when `--help` or `--version` was printed.
fn parse(
    table: &[Flag],
    args: impl IntoIterator<Item = String>,
) -> Result<Option<Args>, UsageError> {
    let p = match k3_cli::parse(table, args)? {
        Outcome::Run(parsed) => parsed,
        Outcome::Help => {
            print!(
                "{}",
                k3_cli::render_help(table, BINARY, env!("CARGO_PKG_VERSION"))
            );
            return Ok(None);
        }
        Outcome::Version => {
            print!(
                "{}",
                k3_cli::render_version(BINARY, env!("CARGO_PKG_VERSION"))
            );
            return Ok(None);
        }
    };
    let mut engine = EngineOptions::default();
    k3_cli::apply_library_flags(&p, &mut engine)?;
    engine
        .pool
        .threads
        .get_or_insert(p.get_or_default(table, "threads")?);
    engine.expert_placement = match p.get_str("expert-placement") {
        Some("home") => ExpertPlacement::Home,
        _ => ExpertPlacement::Split,
    };
    let model = p.get_str("model").map(PathBuf::from);
    if model.is_some() && p.has("preset") {
        return Err(UsageError::Other(
            "--preset generates a checkpoint; it cannot go with --model".into(),
        ));
    }
    let tokens = p
        .get_str("tokens")
        .map(|ids| {
            ids.split(',')
                .map(|t| {
                    t.trim().parse().map_err(|_| UsageError::BadValue {
                        flag: "--tokens".into(),
                        value: ids.to_owned(),
                        want: "comma-separated token ids".into(),
                    })
                })
                .collect::<Result<Vec<usize>, _>>()
        })
        .transpose()?;
    Ok(Some(Args {
        model,
        preset: p
            .get_str("preset")
            .unwrap_or("k3-0.40b")
            .parse()
            .map_err(UsageError::Other)?,
        tokens,
        steps: p.get_or_default(table, "steps")?,
        prefill_chunk: p.get_or_default(table, "prefill-chunk")?,
        logits_out: p.get_str("logits-out").map(PathBuf::from),
        probe_mb: p.get_or_default(table, "probe-mb")?,
        prefill: p.get_usize("prefill")?,
        profile: p.switch("profile"),
        engine,
    }))
}

/// Timed steps between two read-bandwidth probes.
const PROBE_EVERY: usize = 4;

/// The read probe's buffer: `requested` bytes (`--probe-mb`), or why there is none. Under a
/// memory limit (a cgroup's, `--memory-gb`) the plan may fill the limit, and the buffer's
/// pages count against it: allocated outside the plan it got the bench OOM-killed in a cgroup
/// of 0.9x the model. So there it runs only if it fits what the plan leaves of the limit
/// (its safety margin kept).
fn probe_bytes(requested: u64, plan: &Plan) -> Result<u64, String> {
    if requested == 0 {
        return Err("--probe-mb 0".into());
    }
    let Some(limit) = plan.budget.as_ref().filter(|b| b.limit) else {
        return Ok(requested);
    };
    let left = limit
        .bytes
        .saturating_sub(plan.margin)
        .saturating_sub(plan.memory.total());
    if requested <= left {
        return Ok(requested);
    }
    Err(format!(
        "off: its {} MiB do not fit the {:.3} GB the memory plan leaves of the {:.3} GB limit \
         ({})",
        requested >> 20,
        left as f64 / 1e9,
        limit.bytes as f64 / 1e9,
        limit.source
    ))
}

/// `--prefill N`: a prompt of the first N tokens through `Model::prefill` in chunks of
/// `--prefill-chunk` (logits for the last token only), five times on fresh sessions; prints
/// the median time and tokens/s.
fn time_prefill(
    model: &Model<'_>,
    tokens: &[usize],
    n: usize,
    chunk: usize,
    profile: Option<&Profile>,
) -> Result<()> {
    if tokens.len() < n {
        bail!("--prefill {n} needs at least {n} tokens (--steps or --tokens)");
    }
    let mut times = Vec::new();
    let mut fp = 0;
    for run in 0..5 {
        if run == 1 {
            // The first run pays a mapped trunk's page faults.
            profile.inspect(|p| p.reset());
        }
        let mut session = model.session();
        let start = Instant::now();
        let last = model.prefill(&mut session, &tokens[..n], chunk)?;
        times.push(start.elapsed().as_secs_f64());
        fp = fingerprint(&last);
    }
    if let Some(p) = profile {
        let total = std::time::Duration::from_secs_f64(times[1..].iter().sum());
        print_profile(p, total, 4 * n, "prefill profile over runs 2-5", None);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "prefill: {n} tokens in chunks of {chunk}: median {:.3} ms = {:.2} tokens/s; last logits fingerprint {fp:016x}",
        median * 1e3,
        n as f64 / median
    );
    Ok(())
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
    let args = match parse(&table, std::env::args().skip(1)) {
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
    let config_text =
        std::fs::read_to_string(model_dir.join("config.json")).context("reading config.json")?;
    let config = K3Config::from_json(&config_text)?;
    // The KV cache the memory plan counts: one sequence of every token consumed.
    let options = EngineOptions {
        ctx: args.tokens.as_ref().map_or(args.steps, Vec::len),
        ranks: Arc::clone(&ranks),
        ..args.engine.clone()
    };
    // Under mpirun, ranks other than 0 print their startup line and errors only.
    let mut quiet = |_: &str| {};
    let sink: &mut dyn BuildSink = if leader {
        &mut Stderr::default()
    } else {
        &mut quiet
    };
    let engine = Engine::build(&model_dir, config, &options, sink)?;
    let share = RankShare::of(&engine.checkpoint, &ranks);
    if ranks.size() > 1 {
        eprintln!("{}", share.describe(&ranks));
    }
    let (config, pool, store) = (&engine.config, &engine.pool, &engine.store);
    let model = engine.model()?;
    if !leader {
        return ranks::follow(model, &ranks, &model_dir, &share);
    }
    let profile = Arc::new(Profile::new());
    let model = if args.profile {
        model.with_profile(Arc::clone(&profile))
    } else {
        model
    };
    let plan = BytePlan::new(config);
    let tokens: Vec<usize> = match args.tokens {
        Some(tokens) => tokens,
        None => {
            // A fixed seeded sequence (SplitMix64) of `--steps` ids.
            let mut state = 0x4B33u64;
            (0..args.steps)
                .map(|_| {
                    state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    ((z ^ (z >> 31)) % config.vocab_size as u64) as usize
                })
                .collect()
        }
    };
    if let Some(n) = args.prefill {
        let timed = time_prefill(
            &model,
            &tokens,
            n,
            args.prefill_chunk,
            args.profile.then_some(&*profile),
        );
        ranks::finish(model, &ranks, &model_dir, &share, None);
        return timed;
    }
    let mut out = match &args.logits_out {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| path.display().to_string())?,
        )),
        None => None,
    };
    // The read-bandwidth reference, measured in the same run with the same number of pinned
    // threads: the STREAM-like sum of the kernel benchmarks (benches::read_all) over 512 MiB,
    // after every `PROBE_EVERY` timed steps (or the chunk that reaches them), so each step is
    // paired with the bandwidth the machine gave at that moment (this host is shared: it
    // drifts by tens of percent within a minute). A probe flushes the caches and the next
    // step pays for it, so probing after every step would understate the decode.
    // `--probe-mb 0` turns it off, and so does a memory limit it does not fit (`probe_bytes`).
    let probe_pool = benches::Pool::new(pool.threads())?;
    let probe_size = probe_bytes((args.probe_mb as u64) << 20, &engine.plan);
    if let Err(why) = &probe_size
        && args.probe_mb > 0
    {
        eprintln!("read probe {why}");
    }
    let buffer = probe_size
        .as_ref()
        .ok()
        .map(|&bytes| benches::bandwidth_buffer(bytes as usize));
    let probe = || buffer.as_ref().map(|b| benches::read_rate(&probe_pool, b));
    probe(); // warm: the first pass also faults the buffer's pages in
    if let Some(store) = &store {
        store.reset_stats(); // the preload's reads are not the decode's
    }
    let mut session = model.session();
    let collectives = ranks.stats();
    let mut times = Vec::with_capacity(tokens.len());
    let mut reads = Vec::with_capacity(tokens.len());
    let mut ratios = Vec::with_capacity(tokens.len());
    let mut pending = Vec::new();
    let mut combined = Vec::with_capacity(tokens.len() * 8);
    let mut step = 0;
    let mut profiled = std::time::Duration::ZERO;
    for chunk in tokens.chunks(args.prefill_chunk) {
        let start = Instant::now();
        let before = store.as_ref().map(|s| s.stats());
        let rows = model.score(&mut session, chunk, chunk.len())?;
        let elapsed = start.elapsed();
        if step == 0 {
            // The first chunk pays the page faults of a mapped trunk: not a steady step.
            profile.reset();
        } else {
            profiled += elapsed;
        }
        let per_token = elapsed.as_secs_f64() / chunk.len() as f64;
        // With the store: this chunk's wait on loads and bytes read, per token.
        let loads = match (&store, before) {
            (Some(store), Some(before)) => {
                let after = store.stats();
                let n = chunk.len() as f64;
                format!(
                    "  waited {:7.3} ms, read {:8.1} MB",
                    (after.wait - before.wait).as_secs_f64() * 1e3 / n,
                    (after.bytes_read - before.bytes_read) as f64 / 1e6 / n
                )
            }
            _ => String::new(),
        };
        pending.extend(std::iter::repeat_n(per_token, chunk.len()));
        if pending.len() >= PROBE_EVERY || step + chunk.len() == tokens.len() {
            match probe() {
                Some(read) => {
                    reads.push(read);
                    ratios.extend(
                        pending
                            .drain(..)
                            .map(|t| plan.bytes_per_token as f64 / t / read),
                    );
                }
                None => pending.clear(),
            }
        }
        for (&token, logits) in chunk.iter().zip(&rows) {
            times.push(per_token);
            let fp = fingerprint(logits);
            combined.extend_from_slice(&fp.to_le_bytes());
            println!(
                "step {step:4} token {token:6}  {:9.3} ms  fingerprint {fp:016x}{loads}",
                per_token * 1e3
            );
            if let Some(out) = &mut out {
                for v in logits {
                    out.write_all(&v.to_le_bytes())?;
                }
            }
            step += 1;
        }
    }
    if let Some(mut out) = out {
        out.flush()?;
    }
    let collectives = ranks.stats().since(&collectives);
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    // Mean over the steps after the first (which pays a mapped trunk's page faults), the way
    // llama-bench reports tg after its warm-up run.
    let mean_time = if times.len() > 1 {
        times[1..].iter().sum::<f64>() / (times.len() - 1) as f64
    } else {
        times[0]
    };
    let median_time = median(&mut times);
    let probed = !reads.is_empty();
    let median_read = if probed { median(&mut reads) } else { 0.0 };
    let median_ratio = if probed { median(&mut ratios) } else { 0.0 };
    let combined_fp = combined.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let fraction = if probed {
        println!(
            "read bandwidth, measured after every {PROBE_EVERY} steps ({} threads): median {:.2} GB/s, range {:.2}-{:.2}",
            pool.threads(),
            median_read / 1e9,
            reads[0] / 1e9,
            reads[reads.len() - 1] / 1e9,
        );
        format!(
            "{:.0}% of the read bandwidth (median of per-step ratios to the read measured next)",
            100.0 * median_ratio
        )
    } else {
        format!("no read probe ({})", probe_size.err().unwrap_or_default())
    };
    println!(
        "{} steps: median {:.3} ms/token, mean after the first {:.3} ms/token; {} weight bytes per token; {:.2} GB/s; {fraction}; combined fingerprint {combined_fp:016x}",
        tokens.len(),
        median_time * 1e3,
        mean_time * 1e3,
        plan.bytes_per_token,
        plan.bytes_per_token as f64 / median_time / 1e9,
    );
    if args.profile {
        let first = tokens.len().min(args.prefill_chunk);
        print_profile(
            &profile,
            profiled,
            tokens.len() - first,
            "decode profile over the steps after the first chunk",
            probed.then_some((&plan, median_read)),
        );
    }
    if let Some(store) = &store {
        print!("{}", stats_report(store, &store.stats(), tokens.len()));
    }
    ranks::finish(
        model,
        &ranks,
        &model_dir,
        &share,
        Some((collectives, tokens.len())),
    );
    match engine.save_usage() {
        Some((path, Ok(()))) => eprintln!("expert usage saved to {}", path.display()),
        Some((_, Err(e))) => eprintln!("warning: expert usage not saved: {e}"),
        None => {}
    }
    Ok(())
}

/// `--profile`'s table: each bucket's wall time per token over `tokens` timed tokens (`total`)
/// and its share; with `roof` (the byte plan and the run's median read) also the weights the
/// bucket reads per token and that rate against the read (a bucket's own roofline).
fn print_profile(
    profile: &Profile,
    total: std::time::Duration,
    tokens: usize,
    title: &str,
    roof: Option<(&BytePlan, f64)>,
) {
    if tokens == 0 {
        println!("{title}: no timed tokens (needs more than one chunk)");
        return;
    }
    let per_token = |d: std::time::Duration| d.as_secs_f64() / tokens as f64;
    let step = per_token(total);
    print!(
        "{title} ({:.3} ms per token):\n| bucket | ms per token | share |",
        step * 1e3
    );
    match roof {
        Some((_, read)) => println!(
            " weight MB/token | GB/s | % of read ({:.1} GB/s) |\n|---|---|---|---|---|---|",
            read / 1e9
        ),
        None => println!("\n|---|---|---|"),
    }
    let mut accounted = 0.0;
    for (bucket, time) in Bucket::ALL.iter().zip(profile.totals()) {
        let t = per_token(time);
        let bytes = roof.map_or(0, |(plan, _)| bucket.bytes_per_token(plan));
        if t == 0.0 && bytes == 0 {
            continue;
        }
        accounted += t;
        print!(
            "| {} | {:.4} | {:.1}% |",
            bucket.name(),
            t * 1e3,
            100.0 * t / step
        );
        match roof {
            Some((_, read)) => {
                let rate = if t > 0.0 { bytes as f64 / t } else { 0.0 };
                println!(
                    " {:.1} | {:.2} | {:.0}% |",
                    bytes as f64 / 1e6,
                    rate / 1e9,
                    100.0 * rate / read
                );
            }
            None => println!(),
        }
    }
    let other = step - accounted;
    println!(
        "| other (embedding, norms, AttnRes mixes, expert sums) | {:.4} | {:.1}% |{}",
        other * 1e3,
        100.0 * other / step,
        if roof.is_some() { " | | |" } else { "" }
    );
}

/// The build's lines on stderr, and the expert preload's progress as a bar (GB/s, ETA),
/// cleared by the next line.
#[derive(Default)]
struct Stderr {
    bar: Option<indicatif::ProgressBar>,
}

impl BuildSink for Stderr {
    fn line(&mut self, line: &str) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        eprintln!("{line}");
    }

    fn preload_progress(&mut self, progress: PreloadProgress) {
        let bar = self.bar.get_or_insert_with(|| {
            indicatif::ProgressBar::new(0).with_style(
                indicatif::ProgressStyle::with_template(
                    "preloading experts {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
                )
                .expect("a valid template"),
            )
        });
        bar.set_length(progress.bytes_total);
        bar.set_position(progress.bytes_done);
    }
}

#[path = "teacher_forced_decode_bench/ranks.rs"]
mod ranks;

#[cfg(test)]
#[path = "teacher_forced_decode_bench/tests.rs"]
mod tests;
