//! The speculative-decoding bench's command line: its flag table (its own flags, then the
//! library flags k3-serve takes too, `--threads` defaulting to 2) and [`Args`], what a run was
//! asked for.

use std::path::PathBuf;

use k3_cli::{Flag, Group, Kind, UsageError};
use k3_model::builder::EngineOptions;
use k3_model::speculate::MAX_TOKENS;

/// The binary's name, in `--help`, `--version` and usage errors.
pub(crate) const BINARY: &str = "spec_bench";

/// The section of `--help` for the bench's own flags.
const BENCH: Group = Group::new("Benchmark");

/// The acceptance rates the oracle drafter is run at, unless `--rates` says otherwise.
const RATES: &str = "0,0.3,0.5,0.7,0.9";

/// Every flag the bench takes: its own, then the library flags (`--threads` defaulting to 2).
pub(crate) fn spec_flags() -> Vec<Flag> {
    use Kind::*;
    let mut table = vec![
        k3_cli::model_flag(BENCH).with_default("none: required"),
        Flag::value(
            "tokens",
            "N",
            Count,
            "64",
            BENCH,
            "tokens generated after each prompt by every decode, plain or speculative",
        ),
        Flag::value(
            "reps",
            "N",
            Count,
            "5",
            BENCH,
            "timed rounds of the cost curve, every pass size once per round",
        ),
        Flag::value(
            "max-pass",
            "N",
            Count,
            "16",
            BENCH,
            "largest verify pass of the cost curve, in tokens",
        ),
        Flag::value(
            "pairs",
            "N",
            Count,
            "2",
            BENCH,
            "off/on decode pairs per acceptance rate and for the n-gram drafter",
        ),
        Flag::value(
            "rates",
            "P,..",
            Text,
            RATES,
            BENCH,
            "acceptance rates of the oracle drafter, comma-separated, each in [0, 1]",
        ),
        Flag::value(
            "max-draft",
            "N",
            Count,
            "8",
            BENCH,
            "drafts per pass at most (the engine's DEFAULT_MAX_DRAFT)",
        ),
        Flag::value(
            "seed",
            "N",
            Whole,
            "0",
            BENCH,
            "seed of the oracle drafter's draws",
        ),
        Flag::value(
            "bandwidth-gbps",
            "G",
            Number {
                min: 1e-3,
                max: f64::INFINITY,
            },
            "400",
            BENCH,
            "read bandwidth of the release projection, GB/s",
        ),
    ];
    table.extend(k3_cli::library_flags_with_threads("2"));
    table
}

/// What a run was asked for.
#[derive(Debug)]
pub(crate) struct Args {
    /// `--model DIR`: the checkpoint, with its tokenizer.
    pub(crate) model: PathBuf,
    /// `--tokens N`: tokens generated after each prompt.
    pub(crate) tokens: usize,
    /// `--reps N`: timed rounds of the cost curve.
    pub(crate) reps: usize,
    /// `--max-pass N`: the cost curve's largest pass.
    pub(crate) max_pass: usize,
    /// `--pairs N`: off/on pairs per acceptance rate.
    pub(crate) pairs: usize,
    /// `--rates`: the oracle drafter's acceptance rates.
    pub(crate) rates: Vec<f64>,
    /// `--max-draft N`: drafts per pass at most.
    pub(crate) max_draft: usize,
    /// `--seed N`: the oracle drafter's seed.
    pub(crate) seed: u64,
    /// `--bandwidth-gbps G`: the projection's read bandwidth, in bytes per second.
    pub(crate) bandwidth: f64,
    /// The library flags (`ctx` is set once the prompts are known).
    pub(crate) engine: EngineOptions,
}

/// The command line as [`Args`]; `None` when `--help` or `--version` was printed.
pub(crate) fn parse(
    table: &[Flag],
    args: impl IntoIterator<Item = String>,
) -> Result<Option<Args>, UsageError> {
    let Some(p) = k3_cli::parse_or_answer(table, BINARY, env!("CARGO_PKG_VERSION"), args)? else {
        return Ok(None);
    };
    let mut engine = EngineOptions::default();
    k3_cli::apply_library_flags(&p, &mut engine)?;
    engine
        .pool
        .threads
        .get_or_insert(p.get_or_default(table, "threads")?);
    let rates_text = p.get_str("rates").unwrap_or(RATES);
    let bad_rates = || UsageError::BadValue {
        flag: "--rates".into(),
        value: rates_text.to_owned(),
        want: "comma-separated acceptance rates in [0, 1]".into(),
    };
    let rates = rates_text
        .split(',')
        .map(|r| match r.trim().parse::<f64>() {
            Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
            _ => Err(bad_rates()),
        })
        .collect::<Result<Vec<f64>, _>>()?;
    let tokens: usize = p.get_or_default(table, "tokens")?;
    if tokens < 2 {
        return Err(UsageError::Other(format!(
            "--tokens {tokens}: a decode needs at least 2 tokens (the first comes from the prompt)"
        )));
    }
    let max_pass: usize = p.get_or_default(table, "max-pass")?;
    if max_pass > MAX_TOKENS {
        return Err(UsageError::Other(format!(
            "--max-pass {max_pass}: the cost model learns passes of at most {MAX_TOKENS} tokens"
        )));
    }
    Ok(Some(Args {
        model: PathBuf::from(p.get_str("model").expect("--model is required")),
        tokens,
        reps: p.get_or_default(table, "reps")?,
        max_pass,
        pairs: p.get_or_default(table, "pairs")?,
        rates,
        max_draft: p.get_or_default(table, "max-draft")?,
        seed: p.get_or_default(table, "seed")?,
        bandwidth: p.get_or_default::<f64>(table, "bandwidth-gbps")? * 1e9,
        engine,
    }))
}

#[cfg(test)]
mod tests;
