//! The timed decode: the tokens consumed `--prefill-chunk` at a time, each step's time and
//! logits fingerprint, the read probe between steps, and the closing summary (median and mean
//! ms/token, GB/s, the fraction of the read bandwidth, the combined fingerprint).

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k3_model::builder::Engine;
use k3_model::experts::stats_report;
use k3_model::inventory::BytePlan;
use k3_model::model::{Model, Session, fingerprint};
use k3_model::profile::Profile;
use numa_sched::{CollectiveStats, Ranks};

use crate::args::Args;
use crate::probe::{PROBE_EVERY, ReadProbe};
use crate::report::print_profile;

/// Decodes `tokens` on `model` (built by `engine`) and prints every step and the summary;
/// returns the collectives of the timed steps (for the ranks' report).
pub(crate) fn decode(
    model: &Model<'_>,
    mut session: Session,
    engine: &Engine,
    args: &Args,
    tokens: &[usize],
    profile: &Profile,
    ranks: &Ranks,
) -> Result<CollectiveStats> {
    let (pool, store) = (engine.pool(), engine.store());
    let mut plan = BytePlan::new(engine.config());
    // A lossy `--trunk-format` reads its requantised matrices at their format's bytes.
    let (stored, held) = engine.requantised_bytes();
    plan.bytes_per_token = plan.bytes_per_token - stored as usize + held as usize;
    let mut out = match &args.logits_out {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| path.display().to_string())?,
        )),
        None => None,
    };
    // `--probe-mb 0` turns the probe off, and so does a memory limit it does not fit.
    let probe = ReadProbe::new(pool.threads(), (args.probe_mb as u64) << 20, engine.plan())?;
    probe.read(); // warm: the first pass also faults the buffer's pages in
    if let Some(store) = store {
        store.reset_stats(); // the preload's reads are not the decode's
    }
    let depth = session.position();
    let collectives = ranks.stats();
    let mut times = Vec::with_capacity(tokens.len());
    let mut reads = Vec::with_capacity(tokens.len());
    let mut ratios = Vec::with_capacity(tokens.len());
    let mut pending = Vec::new();
    let mut combined = Vec::with_capacity(tokens.len() * 8);
    let mut step = 0;
    let mut profiled = Duration::ZERO;
    for chunk in tokens.chunks(args.prefill_chunk) {
        let start = Instant::now();
        let before = store.as_ref().map(|s| s.stats());
        let rows = model.score(&mut session, chunk, chunk.len())?;
        let elapsed = start.elapsed();
        if step == 0 {
            // The first chunk pays the page faults of a mapped trunk: not a steady step.
            model.reset_profile();
        } else {
            profiled += elapsed;
        }
        let per_token = elapsed.as_secs_f64() / chunk.len() as f64;
        // With the store: this chunk's wait on loads and bytes read, per token.
        let loads = match (store, before) {
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
            match probe.read() {
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
        format!("no read probe ({})", probe.why_off())
    };
    let at = if depth > 0 {
        format!(" at depth {depth}")
    } else {
        String::new()
    };
    println!(
        "{} steps{at}: median {:.3} ms/token, mean after the first {:.3} ms/token; {} weight bytes per token; {:.2} GB/s; {fraction}; combined fingerprint {combined_fp:016x}",
        tokens.len(),
        median_time * 1e3,
        mean_time * 1e3,
        plan.bytes_per_token,
        plan.bytes_per_token as f64 / median_time / 1e9,
    );
    if args.profile {
        let first = tokens.len().min(args.prefill_chunk);
        print_profile(
            profile,
            profiled,
            tokens.len() - first,
            "decode profile over the steps after the first chunk",
            probed.then_some((&plan, median_read)),
        );
    }
    if let Some(store) = store {
        print!("{}", stats_report(store, &store.stats(), tokens.len()));
    }
    Ok(collectives)
}
