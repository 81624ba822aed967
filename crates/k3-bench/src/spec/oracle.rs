//! The oracle runs: at each acceptance rate p, plain greedy decoding and speculative greedy
//! decoding with the oracle drafter, alternated in pairs (off on, then on off), each run's
//! tokens checked against the plain reference, and the tokens/s of the two compared within
//! each pair.

use anyhow::{Result, ensure};
use k3_model::model::Model;

use crate::draw::Oracle;
use crate::generate::{Decoded, Mode, decode};
use crate::stats::median;

/// What the runs at one acceptance rate gave.
#[derive(Debug, Clone)]
pub(crate) struct RateResult {
    /// The oracle's acceptance rate.
    pub(crate) p: f64,
    /// Each pair's plain and speculative run.
    pub(crate) pairs: Vec<(Decoded, Decoded)>,
}

impl RateResult {
    /// The median over the pairs of speculative tokens/s over plain.
    pub(crate) fn ratio(&self) -> f64 {
        let ratios: Vec<f64> = self
            .pairs
            .iter()
            .map(|(off, on)| on.tokens_per_second() / off.tokens_per_second())
            .collect();
        median(&ratios)
    }
}

/// What the oracle runs share.
pub(crate) struct Setup<'a> {
    /// The prompt, and the plain greedy decode's tokens after it (the truth).
    pub(crate) prompt: &'a [u32],
    pub(crate) truth: &'a [u32],
    /// Seconds of a pass of 1, 2, ... tokens: the cost model's seed.
    pub(crate) curve: &'a [f64],
    pub(crate) max_draft: usize,
    pub(crate) pairs: usize,
    pub(crate) seed: u64,
    pub(crate) vocab: u32,
}

/// Runs `setup.pairs` off/on pairs at each rate of `rates`, printing a line per run; fails if
/// any run's tokens differ from the truth.
pub(crate) fn run(model: &Model<'_>, setup: &Setup<'_>, rates: &[f64]) -> Result<Vec<RateResult>> {
    let count = setup.truth.len();
    let mut results = Vec::with_capacity(rates.len());
    for (r, &p) in rates.iter().enumerate() {
        let mut pairs = Vec::with_capacity(setup.pairs);
        for pair in 0..setup.pairs {
            let seed = setup.seed ^ ((r as u64) << 32 | pair as u64);
            let mut oracle = Oracle::new(setup.truth.to_vec(), p, setup.vocab, seed);
            let mut on = || {
                let mode = Mode::On {
                    drafter: &mut oracle,
                    curve: setup.curve,
                    max_draft: setup.max_draft,
                };
                decode(model, setup.prompt, count, mode)
            };
            // A B, then B A: neither goes first every time.
            let (off, on) = if pair % 2 == 0 {
                let off = decode(model, setup.prompt, count, Mode::Off)?;
                (off, on()?)
            } else {
                let on = on()?;
                (decode(model, setup.prompt, count, Mode::Off)?, on)
            };
            for (name, run) in [("off", &off), ("on", &on)] {
                ensure!(
                    run.tokens == setup.truth,
                    "p = {p}, pair {pair}: the {name} run's tokens differ from the plain decode's \
                     (first at {})",
                    first_difference(&run.tokens, setup.truth)
                );
            }
            println!(
                "p = {p}, pair {pair}: off {:.3} tokens/s ({} passes), on {:.3} tokens/s ({} passes, {:.2} tokens per pass, {} of {} drafts accepted): {:.3}×; tokens identical to the plain decode: yes",
                off.tokens_per_second(),
                off.passes,
                on.tokens_per_second(),
                on.passes,
                on.tokens_per_pass(),
                on.accepted,
                on.drafted,
                on.tokens_per_second() / off.tokens_per_second(),
            );
            pairs.push((off, on));
        }
        results.push(RateResult { p, pairs });
    }
    Ok(results)
}

/// Where two token lists first differ (the shorter's length where one extends the other).
pub(crate) fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// The targets the oracle runs are held to: speculative over plain tokens/s at least this
/// at each acceptance rate.
const TARGETS: [(f64, f64); 3] = [(0.7, 1.8), (0.5, 1.4), (0.0, 0.97)];

/// Prints the summary table and each target met or missed.
pub(crate) fn print(results: &[RateResult]) {
    println!(
        "| p | off tokens/s | on tokens/s | on/off (median of pairs) | tokens per pass | acceptance | drafts per pass | identical |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    for result in results {
        let offs: Vec<f64> = result
            .pairs
            .iter()
            .map(|(off, _)| off.tokens_per_second())
            .collect();
        let ons: Vec<&Decoded> = result.pairs.iter().map(|(_, on)| on).collect();
        let per_pass: Vec<f64> = ons.iter().map(|on| on.tokens_per_pass()).collect();
        let acceptance: Vec<f64> = ons.iter().map(|on| on.acceptance()).collect();
        let drafts: Vec<f64> = ons
            .iter()
            .map(|on| on.drafted as f64 / on.passes as f64)
            .collect();
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | yes |",
            result.p,
            median(&offs),
            median(
                &ons.iter()
                    .map(|on| on.tokens_per_second())
                    .collect::<Vec<_>>()
            ),
            result.ratio(),
            median(&per_pass),
            median(&acceptance),
            median(&drafts),
        );
    }
    for (p, target) in TARGETS {
        let Some(result) = results.iter().find(|r| r.p == p) else {
            println!("target at p = {p} (≥ {target}×): not run");
            continue;
        };
        let ratio = result.ratio();
        if ratio >= target {
            println!("target at p = {p}: {ratio:.3}× ≥ {target}×: met");
        } else {
            println!(
                "target at p = {p}: {ratio:.3}× < {target}×: MISSED by {:.3}× ({:.1}%)",
                target - ratio,
                100.0 * (target - ratio) / target
            );
        }
    }
}
