//! Teacher-forced decode benchmark: consumes a fixed token sequence one token at a time and
//! reports per-step time, the median ms/token, the weight bytes one token reads, the achieved
//! GB/s, and the FNV-1a 64 fingerprint of every step's logits and of them all. The achieved
//! bandwidth is given as a fraction of the machine's read bandwidth, probed between steps in
//! the same run with the same thread count (median of the per-step ratios).
//!
//! `cargo run --release -p k3-model --example teacher_forced_decode_bench -- --model DIR
//!  [--tokens 5,17,42,...] [--steps N] [--threads N] [--prefill-chunk N] [--kernel-tier T]
//!  [--logits-out FILE] [--resident-trunk]`
//!
//! `--resident-trunk` copies every text tensor but the routed experts out of the file mapping
//! into huge-page memory before decoding (`Checkpoint::make_resident`); the logits are the same.
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
use expert_store::{Checkpoint, ExpertStore};
use k3_model::checkpoint::{trunk_tensor_names, validate};
use k3_model::config::K3Config;
use k3_model::experts::{ExpertOptions, stats_report};
use k3_model::inventory::BytePlan;
use k3_model::model::{ExpertPlacement, Model, fingerprint};
use k3_model::profile::{Bucket, Profile};
use k3_model::synth::{Preset, SynthOptions, generate};
use mxfp4_kernels::{Kernels, Tier};

struct Args {
    model: Option<PathBuf>,
    /// Generated when there is no `--model` (default `k3-0.40b`).
    preset: Preset,
    tokens: Option<Vec<usize>>,
    steps: usize,
    threads: usize,
    prefill_chunk: usize,
    tier: Option<Tier>,
    logits_out: Option<PathBuf>,
    resident_trunk: bool,
    experts: ExpertOptions,
    /// `--prefill N`: time a prefill of the first N tokens instead of decoding.
    prefill: Option<usize>,
    placement: numa_sched::PoolOptions,
    expert_placement: ExpertPlacement,
    /// `--profile`: print where the timed steps' wall time went, by bucket.
    profile: bool,
}

fn parse() -> Result<Args> {
    let mut args = Args {
        model: None,
        preset: Preset::K3_040B,
        tokens: None,
        steps: 16,
        threads: 1,
        prefill_chunk: 1,
        tier: None,
        logits_out: None,
        resident_trunk: false,
        experts: ExpertOptions::default(),
        prefill: None,
        placement: numa_sched::PoolOptions::default(),
        expert_placement: ExpertPlacement::default(),
        profile: false,
    };
    let mut preset = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = Some(PathBuf::from(value()?)),
            "--preset" => preset = Some(value()?.parse::<Preset>().map_err(anyhow::Error::msg)?),
            "--tokens" => {
                args.tokens = Some(
                    value()?
                        .split(',')
                        .map(|t| t.trim().parse().context("--tokens are comma-separated ids"))
                        .collect::<Result<_>>()?,
                )
            }
            "--steps" => args.steps = value()?.parse().context("--steps is a count")?,
            "--threads" => args.threads = value()?.parse().context("--threads is a count")?,
            "--prefill-chunk" => {
                args.prefill_chunk = value()?.parse().context("--prefill-chunk is a count")?
            }
            "--kernel-tier" => args.tier = Some(value()?.parse()?),
            "--logits-out" => args.logits_out = Some(PathBuf::from(value()?)),
            "--resident-trunk" => args.resident_trunk = true,
            "--profile" => args.profile = true,
            "--prefill" => args.prefill = Some(value()?.parse().context("--prefill is a count")?),
            "--expert-placement" => {
                args.expert_placement = match value()?.as_str() {
                    "split" => ExpertPlacement::Split,
                    "home" => ExpertPlacement::Home,
                    other => bail!("--expert-placement is split or home, not {other:?}"),
                }
            }
            "-h" | "--help" => {
                println!(
                    "usage: teacher_forced_decode_bench [--model DIR | --preset tiny|k3-0.40b|k3-wide] [--tokens IDS] [--steps N] [--threads N] [--prefill-chunk N] [--kernel-tier T] [--logits-out FILE] [--resident-trunk] [--expert-cache N | --expert-cache-gb G] [--preload-experts] [--mlock] [--no-usage-cache] [--usage-file F] [--expert-policy lru|usage] [--io-threads N] [--prefill N] [--numa | --numa-fake N] [--numa-threads N] [--hyperthreads] [--expert-placement split|home] [--profile]"
                );
                std::process::exit(0);
            }
            other => {
                let value = || it.next();
                let known = args
                    .experts
                    .apply_flag(other, value)
                    .map_err(anyhow::Error::msg)?
                    || args
                        .placement
                        .apply_flag(other, || it.next())
                        .map_err(anyhow::Error::msg)?;
                if !known {
                    bail!("unknown flag {other:?} (see --help)");
                }
            }
        }
    }
    match (preset, &args.model) {
        (Some(_), Some(_)) => bail!("--preset generates a checkpoint; it cannot go with --model"),
        (Some(preset), None) => args.preset = preset,
        _ => {}
    }
    if args.threads == 0 {
        bail!("--threads must be at least 1");
    }
    args.placement.threads = Some(args.threads);
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.experts.cache_experts.is_some() && args.experts.cache_bytes.is_some() {
        bail!("--expert-cache and --expert-cache-gb cannot both be given");
    }
    if args.experts.io_threads == 0 {
        bail!("--io-threads must be at least 1");
    }
    Ok(args)
}

/// Timed steps between two read-bandwidth probes.
const PROBE_EVERY: usize = 4;

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
    let args = parse()?;
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
            eprintln!(
                "no --model: generated a synthetic {} checkpoint ({:.2} GB, {} tensors) in {:.1} s at {}",
                args.preset,
                report.bytes as f64 / 1e9,
                report.tensors,
                start.elapsed().as_secs_f64(),
                scratch.0.display()
            );
            scratch.0.clone()
        }
    };
    let kernels = match args.tier {
        Some(tier) => Kernels::new(tier)?,
        None => Kernels::detect(),
    };
    let pool = Arc::new(args.placement.build()?);
    eprintln!("{}", pool.topology().describe());
    eprintln!(
        "kernel tier: {}, threads: {} ({} per domain)",
        kernels.tier(),
        pool.threads(),
        (0..pool.domains())
            .map(|d| pool.domain_threads(d).to_string())
            .collect::<Vec<_>>()
            .join("/")
    );
    let config_text =
        std::fs::read_to_string(model_dir.join("config.json")).context("reading config.json")?;
    let config = K3Config::from_json(&config_text)?;
    let mut ckpt = Checkpoint::open(&model_dir)?;
    validate(&ckpt, &config)?;
    // Everything this run allocates against the memory it may use, before allocating it.
    let run = k3_model::budget::RunShape {
        resident_trunk: args.resident_trunk,
        max_batch: 1,
        ctx: args.tokens.as_ref().map_or(args.steps, Vec::len),
    };
    let plan = k3_model::budget::MemoryPlan::new(&ckpt, &config, &args.experts, run)?
        .check(expert_store::io::memory_budget())?;
    eprintln!("memory plan: {}", plan.describe());
    if args.resident_trunk {
        // Stored names, whatever the format (an MXFP4 linear is two tensors).
        let trunk = trunk_tensor_names(&ckpt, &config);
        let start = Instant::now();
        // Each domain's rows of every matrix on its node (real NUMA only), as it reads them.
        let nodes: Vec<Option<usize>> = pool.topology().domains.iter().map(|d| d.node).collect();
        let bytes = ckpt.make_resident_placed(
            |stored| trunk.contains(stored),
            |_, shape, bytes| {
                if let [rows, _] = shape {
                    numa_sched::memory::bind_row_split(bytes, *rows, &nodes);
                }
            },
        )?;
        eprintln!(
            "resident trunk: {:.2} GB copied in {:.1} s",
            bytes as f64 / 1e9,
            start.elapsed().as_secs_f64()
        );
    }
    let store = args
        .experts
        .open(
            &ckpt,
            &config,
            expert_store::io::memory_available(),
            &pool.topology().domains[0].cpus,
        )?
        .map(Arc::new);
    if let Some(store) = &store {
        eprintln!(
            "expert store: {:?}, {} I/O threads, {}",
            store,
            args.experts.io_threads,
            if store.is_direct() {
                "O_DIRECT reads"
            } else {
                "buffered reads"
            }
        );
        // Experts get home domains (balanced by the usage file's counts) before any load.
        store.place(
            pool.topology().domains.iter().map(|d| d.node).collect(),
            args.expert_placement == ExpertPlacement::Split,
        );
        if args.experts.preload {
            preload(store)?;
        }
    }
    let model = match &store {
        Some(store) => Model::with_expert_store(&ckpt, &config, kernels, Arc::clone(store))?,
        None => Model::new(&ckpt, &config, kernels)?,
    }
    .with_pool(Arc::clone(&pool))
    .with_expert_placement(args.expert_placement);
    let profile = Arc::new(Profile::new());
    let model = if args.profile {
        model.with_profile(Arc::clone(&profile))
    } else {
        model
    };
    let plan = BytePlan::new(&config);
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
        return time_prefill(
            &model,
            &tokens,
            n,
            args.prefill_chunk,
            args.profile.then_some(&*profile),
        );
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
    let probe_pool = benches::Pool::new(pool.threads())?;
    let buffer = benches::bandwidth_buffer(512 << 20);
    let probe = || benches::read_rate(&probe_pool, &buffer);
    probe(); // warm: the first pass also faults the buffer's pages in
    if let Some(store) = &store {
        store.reset_stats(); // the preload's reads are not the decode's
    }
    let mut session = model.session();
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
            let read = probe();
            reads.push(read);
            ratios.extend(
                pending
                    .drain(..)
                    .map(|t| plan.bytes_per_token as f64 / t / read),
            );
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
    let median_read = median(&mut reads);
    let median_ratio = median(&mut ratios);
    let combined_fp = combined.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    println!(
        "read bandwidth, measured after every {PROBE_EVERY} steps ({} threads): median {:.2} GB/s, range {:.2}-{:.2}",
        pool.threads(),
        median_read / 1e9,
        reads[0] / 1e9,
        reads[reads.len() - 1] / 1e9,
    );
    println!(
        "{} steps: median {:.3} ms/token, mean after the first {:.3} ms/token; {} weight bytes per token; {:.2} GB/s; {:.0}% of the read bandwidth (median of per-step ratios to the read measured next); combined fingerprint {combined_fp:016x}",
        tokens.len(),
        median_time * 1e3,
        mean_time * 1e3,
        plan.bytes_per_token,
        plan.bytes_per_token as f64 / median_time / 1e9,
        100.0 * median_ratio,
    );
    if args.profile {
        let first = tokens.len().min(args.prefill_chunk);
        print_profile(
            &profile,
            profiled,
            tokens.len() - first,
            "decode profile over the steps after the first chunk",
            Some((&plan, median_read)),
        );
    }
    if let Some(store) = &store {
        print!("{}", stats_report(store, &store.stats(), tokens.len()));
        if let Some(path) = args.experts.usage_path(&model_dir) {
            // A read-only checkpoint directory only loses the next start's ordering.
            match store.usage().save(&path) {
                Ok(()) => eprintln!("expert usage saved to {}", path.display()),
                Err(e) => eprintln!("warning: expert usage not saved: {e}"),
            }
        }
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

/// Fills the cache before decoding, with a progress bar (GB/s, ETA) and a final line.
fn preload(store: &ExpertStore) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "preloading experts {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("a valid template"),
    );
    let report = store.preload(|p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "preloaded {} experts, {:.2} GB in {:.1} s: {:.2} GB/s",
        report.experts,
        report.bytes as f64 / 1e9,
        report.elapsed.as_secs_f64(),
        report.gbps()
    );
    Ok(())
}
