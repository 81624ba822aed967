//! The bench's command line: its flag table (its own flags, then the library flags that
//! k3-serve takes too) and [`Args`], what a run was asked for.

use std::path::PathBuf;

use k3_cli::{Flag, Group, Kind, UsageError};
use k3_model::builder::EngineOptions;
use k3_model::model::ExpertPlacement;
use k3_model::synth::Preset;

/// The binary's name, in `--help`, `--version` and usage errors.
pub(crate) const BINARY: &str = "teacher_forced_decode_bench";

/// The section of `--help` for the bench's own flags.
const BENCH: Group = Group::new("Benchmark");

/// The presets `--preset` generates.
const PRESETS: &[&str] = &["tiny", "k3-0.40b", "k3-wide"];

/// Every flag the bench takes: its own, then the library flags (`--threads` defaulting to 1),
/// then `--expert-placement`.
pub(crate) fn bench_flags() -> Vec<Flag> {
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
            "time a prefill of N tokens after --depth (median of five) instead of decoding",
        ),
        Flag::value(
            "depth",
            "N",
            Whole,
            "0",
            BENCH,
            "tokens prefilled first, untimed, so the timed steps (or --prefill) run at this depth",
        ),
        Flag::value(
            "depth-fill",
            "N",
            Whole,
            "0",
            BENCH,
            "prefill only the first N tokens of --depth (0: all of them), then repeat their MLA \
             cache rows up to the depth: the attention's work at depth as after a real prefill, \
             in seconds, but logits of no real context (timing only)",
        ),
        Flag::value(
            "depth-chunk",
            "N",
            Count,
            "64",
            BENCH,
            "tokens per forward pass of the --depth prefill",
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

/// What a run was asked for.
#[derive(Debug)]
pub(crate) struct Args {
    /// `--model DIR`: the checkpoint; without it one of `preset` is generated.
    pub(crate) model: Option<PathBuf>,
    /// Generated when there is no `--model` (default `k3-0.40b`).
    pub(crate) preset: Preset,
    /// `--tokens`: the ids consumed; `None`: `steps` ids of a seeded sequence.
    pub(crate) tokens: Option<Vec<usize>>,
    /// `--steps N`: tokens consumed without `--tokens`.
    pub(crate) steps: usize,
    /// `--prefill-chunk N`: tokens per forward pass.
    pub(crate) prefill_chunk: usize,
    /// `--logits-out FILE`: every step's logits, f32 little-endian.
    pub(crate) logits_out: Option<PathBuf>,
    /// `--probe-mb N`: the read probe's buffer in MiB (0: no probe).
    pub(crate) probe_mb: usize,
    /// `--prefill N`: time a prefill of N tokens (after the depth) instead of decoding.
    pub(crate) prefill: Option<usize>,
    /// `--depth N`: tokens prefilled first, untimed.
    pub(crate) depth: usize,
    /// `--depth-chunk N`: tokens per forward pass of the depth prefill.
    pub(crate) depth_chunk: usize,
    /// `--depth-fill N`: tokens of the depth prefilled, the rest repeated (0: all prefilled).
    pub(crate) depth_fill: usize,
    /// `--profile`: print where the timed steps' wall time went, by bucket.
    pub(crate) profile: bool,
    /// The library flags and `--expert-placement` (`ctx` is set once the tokens are known).
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
        depth: p.get_or_default(table, "depth")?,
        depth_chunk: p.get_or_default::<usize>(table, "depth-chunk")?.max(1),
        depth_fill: p.get_or_default(table, "depth-fill")?,
        profile: p.switch("profile"),
        engine,
    }))
}

/// `--steps` ids of a fixed seeded sequence (SplitMix64) below `vocab_size`: the tokens
/// consumed without `--tokens`.
pub(crate) fn seeded_tokens(steps: usize, vocab_size: usize) -> Vec<usize> {
    let mut state = 0x4B33u64;
    (0..steps)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab_size as u64) as usize
        })
        .collect()
}

#[cfg(test)]
mod tests;
