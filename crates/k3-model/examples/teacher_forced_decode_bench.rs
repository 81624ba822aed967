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
//! Without `--model` it first generates a synthetic checkpoint (`--preset`, default `k3-0.40b`:
//! the public 0.40B model's shapes, 0.75 GB, a few seconds) into a temporary directory that is
//! removed when it exits: the engine's main job on a built-in default.
//!
//! With `--prefill-chunk N` the tokens are consumed N at a time (layer-major, bit-identical to
//! N = 1); each chunk's time is divided among its tokens. `--threads N` runs the row blocks
//! and expert tasks on N pinned workers (one domain; bit-identical logits for any N).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use expert_store::Checkpoint;
use expert_store::checkpoint::TEXT_PREFIX;
use k3_model::checkpoint::validate;
use k3_model::config::K3Config;
use k3_model::inventory::{BytePlan, TensorClass, text_tensors};
use k3_model::model::{Model, fingerprint};
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
            "-h" | "--help" => {
                println!(
                    "usage: teacher_forced_decode_bench [--model DIR | --preset tiny|k3-0.40b|k3-wide] [--tokens IDS] [--steps N] [--threads N] [--prefill-chunk N] [--kernel-tier T] [--logits-out FILE] [--resident-trunk]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (see --help)"),
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
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    Ok(args)
}

/// Timed steps between two read-bandwidth probes.
const PROBE_EVERY: usize = 4;

/// A generated checkpoint's directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> Result<()> {
    let args = parse()?;
    let mut generated = None;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = std::env::temp_dir().join(format!("k3-decode-synth-{}", std::process::id()));
            let scratch = generated.insert(Scratch(dir));
            let start = Instant::now();
            let options = SynthOptions {
                preset: args.preset,
                seed: 0,
                layers: None,
                experts: None,
                router_skew: 0.0,
                softplus_gate: false,
            };
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
    eprintln!("kernel tier: {}, threads: {}", kernels.tier(), args.threads);
    let config_text =
        std::fs::read_to_string(model_dir.join("config.json")).context("reading config.json")?;
    let config = K3Config::from_json(&config_text)?;
    let mut ckpt = Checkpoint::open(&model_dir)?;
    validate(&ckpt, &config)?;
    if args.resident_trunk {
        let trunk: std::collections::HashSet<String> = text_tensors(&config)
            .into_iter()
            .filter(|t| t.class != TensorClass::RoutedExperts)
            .map(|t| t.name)
            .collect();
        let start = Instant::now();
        let bytes = ckpt.make_resident(|stored| {
            trunk.contains(stored.strip_prefix(TEXT_PREFIX).unwrap_or(stored))
        })?;
        eprintln!(
            "resident trunk: {:.2} GB copied in {:.1} s",
            bytes as f64 / 1e9,
            start.elapsed().as_secs_f64()
        );
    }
    let pool = std::sync::Arc::new(numa_sched::Pool::new(args.threads)?);
    let model = Model::new(&ckpt, &config, kernels)?.with_pool(pool);
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
    let probe_pool = benches::Pool::new(args.threads);
    let buffer = benches::bandwidth_buffer(512 << 20);
    let probe = || {
        let start = Instant::now();
        std::hint::black_box(benches::read_all(&probe_pool, &buffer));
        buffer.len() as f64 / start.elapsed().as_secs_f64()
    };
    probe(); // warm: the first pass also faults the buffer's pages in
    let mut session = model.session();
    let mut times = Vec::with_capacity(tokens.len());
    let mut reads = Vec::with_capacity(tokens.len());
    let mut ratios = Vec::with_capacity(tokens.len());
    let mut pending = Vec::new();
    let mut combined = Vec::with_capacity(tokens.len() * 8);
    let mut step = 0;
    for chunk in tokens.chunks(args.prefill_chunk) {
        let start = Instant::now();
        let rows = model.score(&mut session, chunk, chunk.len())?;
        let per_token = start.elapsed().as_secs_f64() / chunk.len() as f64;
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
                "step {step:4} token {token:6}  {:9.3} ms  fingerprint {fp:016x}",
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
    let median_time = median(&mut times);
    let median_read = median(&mut reads);
    let median_ratio = median(&mut ratios);
    let combined_fp = combined.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    println!(
        "read bandwidth, measured after every {PROBE_EVERY} steps ({} threads): median {:.2} GB/s, range {:.2}-{:.2}",
        args.threads,
        median_read / 1e9,
        reads[0] / 1e9,
        reads[reads.len() - 1] / 1e9,
    );
    println!(
        "{} steps: median {:.3} ms/token; {} weight bytes per token; {:.2} GB/s; {:.0}% of the read bandwidth (median of per-step ratios to the read measured next); combined fingerprint {combined_fp:016x}",
        tokens.len(),
        median_time * 1e3,
        plan.bytes_per_token,
        plan.bytes_per_token as f64 / median_time / 1e9,
        100.0 * median_ratio,
    );
    Ok(())
}
