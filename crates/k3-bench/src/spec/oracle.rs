//! The oracle runs: at each acceptance rate p, plain greedy decoding and speculative greedy
//! decoding with the oracle drafter in pairs, the two decodes of a pair run pass by pass
//! ([`decode_pair`]), each run's tokens checked against the plain reference, and the tokens/s
//! of the two compared within each pair.

use anyhow::{Result, ensure};
use k3_model::model::Model;

use crate::draw::Oracle;
use crate::generate::{Decoded, Decoder, Mode, decode_pair};
use crate::projection::expected_tokens;
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
            let on = Decoder::new(
                model,
                setup.prompt,
                count,
                Mode::On {
                    drafter: &mut oracle,
                    curve: setup.curve,
                    max_draft: setup.max_draft,
                },
            )?;
            let off = Decoder::new(model, setup.prompt, count, Mode::Off)?;
            // Pass by pass; off or on first on a tie by turns.
            let (off, on) = decode_pair(off, on, pair % 2 == 0)?;
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
                off.passes(),
                on.tokens_per_second(),
                on.passes(),
                on.tokens_per_pass(),
                on.accepted,
                on.drafted,
                on.tokens_per_second() / off.tokens_per_second(),
            );
            println!(
                "  forward passes: off {} ({:.1}% of its run), on {} ({:.1}% of its run)",
                off.passes_by_size(),
                100.0 * off.forward_seconds() / off.seconds,
                on.passes_by_size(),
                100.0 * on.forward_seconds() / on.seconds,
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

/// The most the measured curve allows at acceptance rate `p`: the best, over passes of 1 to
/// `max_draft + 1` tokens, of the expected tokens per pass over the pass's time relative to
/// one token (`curve[n - 1]`: seconds of a pass of n tokens). What a perfect policy with a
/// free drafter, checkpoint and rollback would reach.
pub(crate) fn curve_bound(p: f64, curve: &[f64], max_draft: usize) -> f64 {
    (1..=curve.len().min(max_draft + 1))
        .map(|n| expected_tokens(p, n) / (curve[n - 1] / curve[0]))
        .fold(0.0, f64::max)
}

/// The summary table's header: one row per acceptance rate ([`row`]).
const HEADER: &str = "| p | off tokens/s | on tokens/s | on/off (median of pairs) | each pair's on/off | the curve's bound | tokens per pass | acceptance | drafts per pass | identical |";

/// One rate's row of the summary table: medians over the pairs, and each pair's ratio.
fn row(result: &RateResult, bound: f64) -> String {
    let ons: Vec<&Decoded> = result.pairs.iter().map(|(_, on)| on).collect();
    let of_ons = |f: fn(&Decoded) -> f64| median(&ons.iter().map(|on| f(on)).collect::<Vec<_>>());
    let offs: Vec<f64> = result
        .pairs
        .iter()
        .map(|(off, _)| off.tokens_per_second())
        .collect();
    let ratios: Vec<String> = result
        .pairs
        .iter()
        .map(|(off, on)| format!("{:.3}", on.tokens_per_second() / off.tokens_per_second()))
        .collect();
    format!(
        "| {} | {:.3} | {:.3} | {:.3} | {} | {bound:.3} | {:.2} | {:.2} | {:.2} | yes |",
        result.p,
        median(&offs),
        of_ons(Decoded::tokens_per_second),
        result.ratio(),
        ratios.join(", "),
        of_ons(Decoded::tokens_per_pass),
        of_ons(Decoded::acceptance),
        of_ons(|on| on.drafted as f64 / on.passes() as f64),
    )
}

/// Prints the summary table (with the bound the curve sets, `curve_bound`) and each target
/// met or missed.
pub(crate) fn print(results: &[RateResult], curve: &[f64], max_draft: usize) {
    println!("{HEADER}");
    println!("|---:|---:|---:|---:|---|---:|---:|---:|---:|---|");
    for result in results {
        println!("{}", row(result, curve_bound(result.p, curve, max_draft)));
    }
    for (p, target) in TARGETS {
        let Some(result) = results.iter().find(|r| r.p == p) else {
            println!("target at p = {p} (≥ {target}×): not run");
            continue;
        };
        let ratio = result.ratio();
        let bound = curve_bound(p, curve, max_draft);
        if ratio >= target {
            println!(
                "target at p = {p}: {ratio:.3}× ≥ {target}×: met (the curve's bound {bound:.3}×)"
            );
        } else {
            println!(
                "target at p = {p}: {ratio:.3}× < {target}×: MISSED by {:.3}× ({:.1}%); the curve's bound is {bound:.3}×",
                target - ratio,
                100.0 * (target - ratio) / target
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_curve_bound_is_the_best_expected_tokens_per_relative_time() {
        // A flat curve: the longest pass allowed, E(max_draft + 1).
        let flat = [2.0; 16];
        assert!((curve_bound(0.5, &flat, 8) - expected_tokens(0.5, 9)).abs() < 1e-12);
        // Each token costs as much as the first: nothing beats one token.
        let linear: Vec<f64> = (1..=16).map(f64::from).collect();
        assert_eq!(curve_bound(0.9, &linear, 8), 1.0);
        // 1, 1.2, 1.4, ...: at p = 0.7, n = 3 gives 2.19 / 1.4.
        let steep: Vec<f64> = (0..16).map(|i| 1.0 + 0.2 * f64::from(i)).collect();
        let best = (1..=9)
            .map(|n| expected_tokens(0.7, n) / steep[n - 1])
            .fold(0.0, f64::max);
        assert_eq!(curve_bound(0.7, &steep, 8), best);
        assert_eq!(curve_bound(0.0, &steep, 8), 1.0);
    }

    #[test]
    fn a_row_has_a_cell_for_every_column() {
        let run = |passes, drafted, accepted, seconds| Decoded {
            tokens: vec![1; 9],
            seconds,
            drafted,
            accepted,
            forward: vec![(passes, seconds)],
        };
        let result = RateResult {
            p: 0.5,
            pairs: vec![
                (run(8, 0, 0, 4.0), run(4, 6, 4, 2.0)),
                (run(8, 0, 0, 4.0), run(4, 6, 4, 4.0)),
            ],
        };
        let cells = |line: &str| line.matches('|').count();
        let line = row(&result, 1.25);
        assert_eq!(cells(&line), cells(HEADER), "{line}");
        // Each run's passes by size: 8 passes of one token in 4 s.
        assert_eq!(result.pairs[0].0.passes_by_size(), "1×8 (500.0 ms)");
        assert_eq!(result.pairs[0].0.forward_seconds(), 4.0);
        // The ratios 2 and 1: their median is 1.5, not the upper one.
        assert_eq!(result.ratio(), 1.5);
        assert!(
            line.starts_with(
                "| 0.5 | 2.000 | 3.000 | 1.500 | 2.000, 1.000 | 1.250 | 2.00 | 0.67 | 1.50 | yes |"
            ),
            "{line}"
        );
    }

    #[test]
    fn the_first_difference_is_named() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), 1);
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), 2);
    }
}
