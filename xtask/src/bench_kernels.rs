//! `cargo xtask bench-kernels`: a quick roofline table of the kernels on K3 shapes — weight GB/s
//! and the fraction of the read bandwidth measured in the same run, trial by trial — and the
//! error of each tier against the scalar oracle.
//!
//! Every figure is a median over trials in which the kernel and the STREAM-like read probe
//! (same threads) alternate, so a noisy neighbour moves both. The criterion benches
//! (`cargo bench --bench kernels`) time the same cases (`benches::cases`) with statistics.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use benches::Pool;
use benches::cases::{Case, Workloads, cases, read_case, tier_error};
use mxfp4_kernels::{Kernels, Tier};

use crate::Options;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let options = Options::parse(args, &["tiers", "threads", "trials", "filter"])?;
    let trials: usize = options.get("trials").unwrap_or("5").parse()?;
    let threads: Vec<usize> = options
        .get("threads")
        .unwrap_or("1,2")
        .split(',')
        .map(|v| Ok(v.trim().parse::<usize>()?))
        .collect::<Result<_>>()?;
    let filter = options.get("filter").unwrap_or("");
    let tiers: Vec<Kernels> = match options.get("tiers") {
        None => Kernels::available(),
        Some(list) => list
            .split(',')
            .map(|t| Ok(Kernels::new(t.parse::<Tier>()?)?))
            .collect::<Result<_>>()?,
    };
    if trials == 0 || threads.contains(&0) {
        bail!("--trials and --threads must be at least 1");
    }
    eprintln!(
        "kernel tiers on this CPU: {:?}",
        Kernels::available()
            .iter()
            .map(|k| k.tier().name())
            .collect::<Vec<_>>()
    );
    eprintln!(
        "generating weights: 40 experts (702 MB), KDA projection (176 MB), lm_head slice (235 MB), their Q8_0 (400 MB), 1 GiB probe ..."
    );
    let w = Workloads::generate();

    println!(
        "Error against the scalar oracle, |y - y_scalar| / Σ|w·x| over 256 rows (max / mean):\n"
    );
    println!("| tier | MXFP4 gate 3072x3584 | BF16 KDA 12288x7168 |");
    println!("|---|---|---|");
    for &k in &tiers {
        let [mx, bf] = tier_error(&w, k, 256);
        println!(
            "| {} | {:.1e} / {:.1e} | {:.1e} / {:.1e} |",
            k.tier(),
            mx.0,
            mx.1,
            bf.0,
            bf.1
        );
    }

    println!(
        "\n| op | shape | cache | threads | tier | weight GB/s | Gweights/s | read GB/s (same trials) | % of read (median of paired trials) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &n_threads in &threads {
        let pool = Pool::new(n_threads)?;
        let mut probe = read_case(&w, &pool);
        for &k in &tiers {
            for mut case in cases(&w, &pool, k) {
                if !case.id().contains(filter) {
                    continue;
                }
                let (kernel, read, ratio) = alternate(trials, &mut case, &mut probe);
                // Weights per second: formats of different bits per weight compare on it.
                let weights = kernel * case.weights as f64 / case.bytes as f64;
                println!(
                    "| {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.1} | {:.0}% |",
                    case.op,
                    case.shape,
                    case.cache.label(),
                    case.threads,
                    case.variant,
                    kernel / 1e9,
                    weights / 1e9,
                    read / 1e9,
                    100.0 * ratio
                );
            }
        }
    }
    Ok(())
}

/// `trials` alternating measurements of the kernel and the read probe. Returns the medians of
/// each and the median of the per-pair ratios (robust when the host's bandwidth shifts
/// between phases, as it does on this shared machine).
fn alternate(trials: usize, case: &mut Case<'_>, probe: &mut Case<'_>) -> (f64, f64, f64) {
    (case.run)(); // warm-up: page faults, clocks
    let mut kernel = Vec::with_capacity(trials);
    let mut read = Vec::with_capacity(trials);
    let mut ratio = Vec::with_capacity(trials);
    for _ in 0..trials {
        let k = rate(case);
        let r = rate(probe);
        kernel.push(k);
        read.push(r);
        ratio.push(k / r);
    }
    (median(&mut kernel), median(&mut read), median(&mut ratio))
}

/// Bytes per second over at least 250 ms of calls.
fn rate(case: &mut Case<'_>) -> f64 {
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < Duration::from_millis(250) {
        (case.run)();
        calls += 1;
    }
    (case.bytes as f64 * calls as f64) / start.elapsed().as_secs_f64()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
