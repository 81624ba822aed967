//! `cargo xtask trunk-accuracy --model DIR [--tokens 64] [--threads 2] [--formats q8_0,mxfp4]
//! [--peer [--bf16-gguf FILE] [--q8_0-gguf FILE]] [--out DIR]`: how far the lossy trunk
//! formats move the logits.
//!
//! The reference is the exact f32 forward of the BF16 checkpoint: this engine's exact path
//! (`--trunk-format bf16`, BF16 weights decoded exactly, f32 activations), which agrees with
//! llama.cpp's Kimi-K3 on an F32 dense twin to ~1e-5 (docs/ORACLE_LLAMACPP.md). There is no
//! PyTorch K3 to compare with. Our decode bench runs the same teacher-forced token ids once per
//! format with `--logits-out`; with `--peer`, llama.cpp's logits harness
//! (`xtask/oracle/llamacpp_logits.cpp`: flash attention off, F32 KV cache) runs the checkpoint's
//! BF16-trunk and Q8_0-trunk GGUFs on the same ids. llama.cpp quantises activations to Q8_0 for
//! its MXFP4 experts (and rounds them to BF16 for BF16 matrices), so its BF16 file's row is its
//! error without a lossy trunk; a last row compares its two files with each other.
//!
//! A first row shows how sensitive the checkpoint is to a tiny perturbation of the same size
//! as ggml's: our exact trunk with activations rounded to BF16 (`--kernel-tier avx512-bf16`,
//! where the CPU has AVX512-BF16). A synthetic checkpoint's random router flips experts on
//! such noise, so a format's error reads against that row, not against zero.
//!
//! Per run, over all positions: max |Δ| / max |logit| (per position, against the reference
//! row's largest |logit|; the max and the median over positions), the mean KL(p_ref || p_run)
//! of the softmax in nats (f64), and top-1 agreement. Each metric is a small pure function.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use k3_model::K3Config;

use crate::bench_peers::convert;
use crate::gguf_k3_meta::Outtype;
use crate::oracle_llamacpp::{WORK_DIR, build_llamacpp, fetch_sdist};
use crate::{Options, command_line, from_root};

/// What the reference is, in the table's header and the docs.
const REFERENCE: &str = "the exact f32 forward of the BF16 checkpoint (this engine's exact \
    path, checked against llama.cpp's F32 twin)";
/// The harness compares its batch and one-token runs and fails past a limit; here that spread
/// is reported, not enforced (ggml's quantised activations round the two differently).
const NO_STEP_LIMIT: &str = "1e30";
/// Our kernel tier that rounds activations to BF16, as ggml does for BF16 matrices.
const BF16_TIER: &str = "avx512-bf16";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let o = Options::parse(
        args,
        &[
            "model",
            "tokens",
            "threads",
            "formats",
            "peer!",
            "bf16-gguf",
            "q8_0-gguf",
            "out",
        ],
    )?;
    let model = from_root(o.get("model").context("--model DIR is required")?);
    let n_tokens: usize = o
        .get("tokens")
        .unwrap_or("64")
        .parse()
        .context("--tokens is a count")?;
    ensure!(n_tokens > 0, "--tokens must be at least 1");
    let threads: usize = o
        .get("threads")
        .unwrap_or("2")
        .parse()
        .context("--threads is a count")?;
    let formats: Vec<&str> = o
        .get("formats")
        .unwrap_or("q8_0,mxfp4")
        .split(',')
        .collect();
    if let Some(bad) = formats.iter().find(|f| f.is_empty() || **f == "bf16") {
        bail!("--formats {bad:?}: list the lossy formats (bf16 is the reference, run always)");
    }
    let peer = o.flag("peer");
    if !peer && (o.get("bf16-gguf").is_some() || o.get("q8_0-gguf").is_some()) {
        bail!("--bf16-gguf and --q8_0-gguf are llama.cpp's files: they need --peer");
    }
    let config = K3Config::from_json(
        &fs::read_to_string(model.join("config.json")).context("reading config.json")?,
    )?;
    let vocab = config.vocab_size;
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .context("the model directory has no name")?;
    let out = match o.get("out") {
        Some(dir) => from_root(dir),
        None => from_root("target/trunk-accuracy").join(name),
    };
    fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let tokens = seeded_tokens(n_tokens, vocab);
    let ids = tokens
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");

    let bench = build_ours()?;
    let ours = |format: &str, tier: Option<&str>| -> Result<Vec<f32>> {
        let file = match tier {
            Some(tier) => out.join(format!("ours-{format}-{tier}.f32")),
            None => out.join(format!("ours-{format}.f32")),
        };
        let t = Instant::now();
        our_logits(&bench, &model, format, tier, &ids, threads, &file)?;
        let logits = read_logits(&file, n_tokens, vocab)?;
        let tier = tier.map_or(String::new(), |t| format!(" ({t})"));
        println!("ours {format}{tier}: {:.0} s", t.elapsed().as_secs_f64());
        Ok(logits)
    };
    let reference = ours("bf16", None)?;
    let mut rows = Vec::new();
    if has_avx512_bf16() {
        let logits = ours("bf16", Some(BF16_TIER))?;
        let label = format!("ours bf16, activations rounded to BF16 ({BF16_TIER})");
        rows.push(Row::new(label, "ref", &reference, &logits, vocab, None));
    } else {
        println!("no AVX512-BF16 on this CPU: no row with BF16-rounded activations");
    }
    for format in &formats {
        let logits = ours(format, None)?;
        rows.push(Row::new(
            format!("ours {format}"),
            "ref",
            &reference,
            &logits,
            vocab,
            None,
        ));
    }
    if peer {
        let work = from_root(WORK_DIR);
        fs::create_dir_all(&work)?;
        let harness = build_llamacpp(&work, &fetch_sdist(&work)?)?;
        let mut peers = Vec::new();
        for (outtype, suffix, flag) in [
            (Outtype::Bf16, "bf16", "bf16-gguf"),
            (Outtype::Q8_0, "q8_0", "q8_0-gguf"),
        ] {
            let gguf = match o.get(flag) {
                Some(file) => from_root(file),
                None => convert(&work, &model, outtype)?,
            };
            let file = out.join(format!("llamacpp-{suffix}.f32"));
            let t = Instant::now();
            let spread = llama_logits(&harness, &gguf, &ids, threads, &file, vocab)?;
            let logits = read_logits(&file, n_tokens, vocab)?;
            println!(
                "llama.cpp {suffix} ({}): {:.0} s",
                gguf.display(),
                t.elapsed().as_secs_f64()
            );
            let label = format!("llama.cpp {suffix} GGUF");
            rows.push(Row::new(
                label,
                "ref",
                &reference,
                &logits,
                vocab,
                Some(spread),
            ));
            peers.push(logits);
        }
        rows.push(Row::new(
            "llama.cpp q8_0 GGUF".into(),
            "llama.cpp bf16",
            &peers[0],
            &peers[1],
            vocab,
            None,
        ));
    }

    let table = render(&command_line("trunk-accuracy", args), name, n_tokens, &rows);
    print!("{table}");
    fs::write(out.join("table.md"), &table)?;
    println!(
        "logits and table.md in {} ({:.0} s)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One run's metrics against its reference.
struct Row {
    label: String,
    against: &'static str,
    rel_max: f64,
    rel_median: f64,
    kl_mean: f64,
    top1: usize,
    positions: usize,
    /// llama.cpp's own batch vs one-token spread (relative), for its rows.
    step_vs_batch: Option<f64>,
}

impl Row {
    fn new(
        label: String,
        against: &'static str,
        reference: &[f32],
        run: &[f32],
        vocab: usize,
        step_vs_batch: Option<f64>,
    ) -> Self {
        let pairs: Vec<(&[f32], &[f32])> = reference
            .chunks_exact(vocab)
            .zip(run.chunks_exact(vocab))
            .collect();
        let mut ratios: Vec<f64> = pairs.iter().map(|(r, x)| rel_max_abs_diff(r, x)).collect();
        let kl: f64 = pairs.iter().map(|(r, x)| kl_divergence(r, x)).sum();
        let top1 = pairs.iter().filter(|(r, x)| argmax(r) == argmax(x)).count();
        Self {
            label,
            against,
            rel_max: ratios.iter().copied().fold(0.0, f64::max),
            rel_median: median(&mut ratios),
            kl_mean: kl / pairs.len() as f64,
            top1,
            positions: pairs.len(),
            step_vs_batch,
        }
    }
}

/// The markdown table of `rows`, with what was run and what the reference is.
fn render(command: &str, model: &str, n_tokens: usize, rows: &[Row]) -> String {
    let mut s = format!(
        "\n`{command}`\n\n{model}, {n_tokens} teacher-forced tokens. Reference (ref): {REFERENCE}.\n\n"
    );
    s.push_str(
        "| run | against | max \\|Δ\\|/max \\|logit\\| (max) | (median) | mean KL (nats) | top-1 agree | note |\n",
    );
    s.push_str("|---|---|---|---|---|---|---|\n");
    for r in rows {
        let note = r.step_vs_batch.map_or(String::new(), |spread| {
            format!("batch logits; its batch vs one-token spread {spread:.2e}")
        });
        s.push_str(&format!(
            "| {} | {} | {:.3e} | {:.3e} | {:.3e} | {}/{} ({:.1}%) | {note} |\n",
            r.label,
            r.against,
            r.rel_max,
            r.rel_median,
            r.kl_mean,
            r.top1,
            r.positions,
            100.0 * r.top1 as f64 / r.positions as f64,
        ));
    }
    s
}

/// max_v |reference_v - run_v| / max_v |reference_v| for one position (the absolute
/// difference if the reference row is all zeros).
fn rel_max_abs_diff(reference: &[f32], run: &[f32]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (&r, &x) in reference.iter().zip(run) {
        diff = diff.max((f64::from(r) - f64::from(x)).abs());
        scale = scale.max(f64::from(r).abs());
    }
    if scale > 0.0 { diff / scale } else { diff }
}

/// KL(softmax(reference) || softmax(run)) in nats, in f64: sum_v p_v (log p_v - log q_v),
/// with both log-softmaxes taken stably (max subtracted).
fn kl_divergence(reference: &[f32], run: &[f32]) -> f64 {
    let log_p = log_softmax(reference);
    let log_q = log_softmax(run);
    log_p
        .iter()
        .zip(&log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum()
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .map(|&v| f64::from(v))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    let log_sum = max + sum.ln();
    logits.iter().map(|&v| f64::from(v) - log_sum).collect()
}

/// The index of the largest value; of equal largest values, the first.
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// The median (the upper one of an even count), sorting `values`.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `steps` ids of the decode bench's default seeded sequence (SplitMix64 from 0x4B33, its
/// `args::seeded_tokens`), so a plain `--steps N` run consumes the same ids; both engines are
/// given them explicitly.
fn seeded_tokens(steps: usize, vocab_size: usize) -> Vec<usize> {
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

/// Whether this CPU runs [`BF16_TIER`].
fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Our decode bench, built in release.
fn build_ours() -> Result<PathBuf> {
    crate::bench_peers::build_bench_bin("teacher_forced_decode_bench")
}

/// Runs our bench on `ids` with `--trunk-format format` (and `--kernel-tier tier`), every
/// step's logits into `file`; checks that it consumed exactly those ids.
fn our_logits(
    bench: &Path,
    model: &Path,
    format: &str,
    tier: Option<&str>,
    ids: &str,
    threads: usize,
    file: &Path,
) -> Result<()> {
    let output = Command::new(bench)
        .arg("--model")
        .arg(model)
        .args(["--tokens", ids, "--threads", &threads.to_string()])
        .args(tier.map(|t| ["--kernel-tier", t]).into_iter().flatten())
        .args(["--trunk-format", format, "--probe-mb", "0", "--logits-out"])
        .arg(file)
        .output()
        .context("cannot start teacher_forced_decode_bench")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "teacher_forced_decode_bench --trunk-format {format} exited with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let consumed: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split_whitespace().nth(3))
        .collect();
    ensure!(
        consumed.join(",") == ids,
        "the bench consumed {} tokens, not the {} ids given",
        consumed.len(),
        ids.split(',').count()
    );
    Ok(())
}

/// llama.cpp's logits of `gguf` for `ids`, written by the harness (the batch run: one row per
/// position) into `file`; returns its batch vs one-token spread. Its vocabulary must be ours.
fn llama_logits(
    harness: &Path,
    gguf: &Path,
    ids: &str,
    threads: usize,
    file: &Path,
    vocab: usize,
) -> Result<f64> {
    let output = Command::new(harness)
        .arg(gguf)
        .arg(file)
        .args([ids, &threads.to_string(), NO_STEP_LIMIT])
        .output()
        .with_context(|| format!("cannot start {}", harness.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "{} on {} exited with {}: {stdout}{}",
        harness.display(),
        gguf.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let fact = |key: &str| -> Result<&str> {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(": "))
            .map(str::trim)
            .with_context(|| format!("the harness printed no {key}: {stdout}"))
    };
    let n_vocab: usize = fact("n_vocab")?.parse()?;
    ensure!(
        n_vocab == vocab,
        "llama.cpp has {n_vocab} logits a row on {}, the config's vocab_size is {vocab}",
        gguf.display()
    );
    Ok(fact("max_rel_step_vs_batch")?.parse()?)
}

/// `rows` rows of `vocab` little-endian f32 from `file`, all finite.
fn read_logits(file: &Path, rows: usize, vocab: usize) -> Result<Vec<f32>> {
    let bytes = fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    ensure!(
        bytes.len() == rows * vocab * 4,
        "{} holds {} bytes, expected {rows} rows of {vocab} f32",
        file.display(),
        bytes.len()
    );
    let logits: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    ensure!(
        logits.iter().all(|v| v.is_finite()),
        "{} holds non-finite logits",
        file.display()
    );
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_of_identical_distributions_is_zero() {
        let row = [0.5f32, -1.0, 3.0, 2.0];
        assert_eq!(kl_divergence(&row, &row), 0.0);
        // A constant shift is the same softmax.
        let shifted = row.map(|v| v + 7.0);
        assert!(kl_divergence(&row, &shifted).abs() < 1e-12);
    }

    #[test]
    fn kl_of_two_elements_is_the_closed_form() {
        // p = softmax([0, 0]) = (1/2, 1/2); q = softmax([ln 3, 0]) = (3/4, 1/4).
        // KL(p || q) = 1/2 ln(2/3) + 1/2 ln(2) = 1/2 ln(4/3).
        let q_logits = [3.0f32.ln(), 0.0];
        let kl = kl_divergence(&[0.0, 0.0], &q_logits);
        assert!((kl - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7, "{kl}");
        // And the other direction: 3/4 ln(3/2) + 1/4 ln(1/2).
        let back = kl_divergence(&q_logits, &[0.0, 0.0]);
        let want = 0.75 * 1.5f64.ln() + 0.25 * 0.5f64.ln();
        assert!((back - want).abs() < 1e-7, "{back}");
    }

    #[test]
    fn kl_ignores_tokens_the_reference_gives_no_mass() {
        let kl = kl_divergence(&[0.0, f32::NEG_INFINITY], &[0.0, 0.0]);
        assert!((kl - 2.0f64.ln()).abs() < 1e-12, "{kl}");
    }

    #[test]
    fn top1_takes_the_first_of_tied_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[5.0, 5.0]), 0);
        assert_eq!(argmax(&[-2.0, -1.0]), 1);
        // A tie in one run and a strict maximum at the first of them in the other agree.
        assert_eq!(argmax(&[0.0, 3.0, 3.0]), argmax(&[0.0, 3.0, 2.9]));
    }

    #[test]
    fn relative_difference_is_against_the_references_largest_logit() {
        assert_eq!(rel_max_abs_diff(&[4.0, -8.0, 1.0], &[4.0, -8.0, 1.0]), 0.0);
        // Largest |Δ| 2 (at index 2), largest |reference| 8.
        assert_eq!(rel_max_abs_diff(&[4.0, -8.0, 1.0], &[5.0, -8.5, 3.0]), 0.25);
        assert_eq!(rel_max_abs_diff(&[0.0, 0.0], &[0.0, -0.5]), 0.5);
    }

    #[test]
    fn a_row_sums_positions_into_the_table_metrics() {
        let reference = [0.0f32, 1.0, 2.0, 0.0];
        let run = [0.0f32, 1.5, 2.0, 4.0];
        let row = Row::new("x".into(), "ref", &reference, &run, 2, None);
        assert_eq!(row.positions, 2);
        assert_eq!(row.top1, 1);
        assert_eq!(row.rel_max, 2.0);
        assert_eq!(row.rel_median, 2.0); // the upper of 0.5 and 2
        let kl0 = kl_divergence(&[0.0, 1.0], &[0.0, 1.5]);
        let kl1 = kl_divergence(&[2.0, 0.0], &[2.0, 4.0]);
        assert!((row.kl_mean - (kl0 + kl1) / 2.0).abs() < 1e-15);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_upper_middle() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }

    #[test]
    fn the_token_ids_are_the_benchs_default_sequence() {
        let tokens = seeded_tokens(64, 163_840);
        assert_eq!(tokens.len(), 64);
        assert!(tokens.iter().all(|&t| t < 163_840));
        assert_eq!(seeded_tokens(3, 1024), seeded_tokens(5, 1024)[..3]);
        // What `teacher_forced_decode_bench --steps 4` consumed on a 163,840-token checkpoint.
        assert_eq!(tokens[..4], [159_368, 63_355, 102_488, 130_029]);
    }
}
