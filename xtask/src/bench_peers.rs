//! `cargo xtask bench-peers --model DIR [--threads 1,2] [--pairs N] [--tokens N] [--prompt N]`:
//! decode and prefill side by side with llama.cpp's Kimi-K3 on the same checkpoint. The
//! checkpoint is converted to GGUF with the trunk in BF16 and the experts repacked to ggml
//! MXFP4 (the same bytes we read); then `llama-bench` and our `teacher_forced_decode_bench`
//! alternate, A B A B, at each thread count, and the ratios of each pair are printed with
//! their min / median / max, next to our fraction of the read bandwidth measured in the same
//! run.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::oracle::{DEFAULT_VENV, PINNED, run_checked, venv_with};
use crate::oracle_llamacpp::{CONVERT_SCRIPT, EXTRA_PINS, WORK_DIR, configure, fetch_sdist};
use crate::{Options, from_root};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(
        args,
        &["model", "threads", "pairs", "tokens", "prompt", "venv"],
    )?;
    let model = from_root(o.get("model").context("--model DIR is required")?);
    let threads: Vec<usize> = o
        .get("threads")
        .unwrap_or("1,2")
        .split(',')
        .map(|t| t.trim().parse().context("--threads is a list of counts"))
        .collect::<Result<_>>()?;
    let number = |name: &str, default: usize| -> Result<usize> {
        o.get(name)
            .map(|v| v.parse().with_context(|| format!("--{name} is a count")))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let (pairs, tokens, prompt) = (
        number("pairs", 3)?,
        number("tokens", 32)?,
        number("prompt", 64)?,
    );
    let work = from_root(WORK_DIR);
    std::fs::create_dir_all(&work)?;
    let source = fetch_sdist(&work)?;
    let llama_bench = build_llama_bench(&work, &source)?;
    let gguf = convert(
        &work,
        &source,
        &model,
        &from_root(o.get("venv").unwrap_or(DEFAULT_VENV)),
    )?;
    run_checked(Command::new("cargo").args([
        "build",
        "--release",
        "-p",
        "k3-model",
        "--example",
        "teacher_forced_decode_bench",
    ]))?;
    let ours = from_root("target/release/examples/teacher_forced_decode_bench");
    println!(
        "model {} ({}), {} pairs, {tokens} generated tokens, {prompt}-token prompts",
        model.display(),
        gguf.display(),
        pairs
    );
    for &t in &threads {
        let mut decode = Vec::new();
        let mut prefill = Vec::new();
        for pair in 0..pairs {
            let peer_tg = llama(&llama_bench, &gguf, t, 0, tokens)?;
            let (our_tg, fraction) = our_decode(&ours, &model, t, tokens)?;
            let peer_pp = llama(&llama_bench, &gguf, t, prompt, 0)?;
            let our_pp = our_prefill(&ours, &model, t, prompt)?;
            println!(
                "threads {t} pair {pair}: decode ours {our_tg:.2} tok/s ({:.0}% of read) vs llama.cpp {peer_tg:.2} = {:.2}x; prefill ours {our_pp:.1} tok/s vs {peer_pp:.1} = {:.2}x",
                100.0 * fraction,
                our_tg / peer_tg,
                our_pp / peer_pp
            );
            decode.push(our_tg / peer_tg);
            prefill.push(our_pp / peer_pp);
        }
        for (what, mut ratios) in [("decode", decode), ("prefill", prefill)] {
            ratios.sort_by(f64::total_cmp);
            println!(
                "threads {t} {what}: ours / llama.cpp min {:.2} median {:.2} max {:.2}",
                ratios[0],
                ratios[ratios.len() / 2],
                ratios[ratios.len() - 1]
            );
        }
    }
    Ok(())
}

/// `llama-bench` (once) in its own build directory, with the tools on.
fn build_llama_bench(work: &Path, source: &Path) -> Result<PathBuf> {
    let build = work.join("build-peer");
    configure(source, &build, true)?;
    run_checked(Command::new("cmake").arg("--build").arg(&build).args([
        "-j2",
        "--target",
        "llama-bench",
    ]))?;
    Ok(build.join("bin").join("llama-bench"))
}

/// The GGUF of `model` (trunk BF16, experts ggml MXFP4), converted once per directory.
fn convert(work: &Path, source: &Path, model: &Path, venv: &Path) -> Result<PathBuf> {
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .context("the model directory has no name")?;
    let gguf = work.join(format!("peer-{name}-bf16.gguf"));
    if !gguf.exists() {
        let python = venv_with(venv, &[&PINNED[..], &EXTRA_PINS[..]].concat())?;
        run_checked(
            Command::new(python)
                .arg(from_root(CONVERT_SCRIPT))
                .arg("--llama-cpp")
                .arg(source)
                .arg("--")
                .arg(model)
                .arg("--outfile")
                .arg(&gguf)
                .args(["--outtype", "bf16"]),
        )?;
    }
    Ok(gguf)
}

/// llama.cpp's tokens/s for a prompt of `prompt` tokens (`pp`) or `generate` tokens (`tg`).
fn llama(bench: &Path, gguf: &Path, threads: usize, prompt: usize, generate: usize) -> Result<f64> {
    let out = Command::new(bench)
        .arg("-m")
        .arg(gguf)
        .args([
            "-p",
            &prompt.to_string(),
            "-n",
            &generate.to_string(),
            "-t",
            &threads.to_string(),
        ])
        .args(["-r", "1", "-o", "json"])
        .output()
        .context("running llama-bench")?;
    if !out.status.success() {
        bail!(
            "llama-bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("llama-bench did not print JSON")?;
    json[0]["avg_ts"]
        .as_f64()
        .context("llama-bench printed no avg_ts")
}

/// Runs our decode bench with `args` and returns the line of its output starting with
/// `marker` (or containing it).
fn our_line(bench: &Path, model: &Path, args: &[String], marker: &str) -> Result<String> {
    let out = Command::new(bench)
        .arg("--model")
        .arg(model)
        .args(args)
        .output()
        .context("running teacher_forced_decode_bench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains(marker))
        .map(str::to_owned)
        .with_context(|| format!("no {marker:?} line in: {text}"))
}

/// The number in `line` between `after` and the next `before`.
fn between(line: &str, after: &str, before: &str) -> Option<f64> {
    let rest = &line[line.find(after)? + after.len()..];
    rest[..rest.find(before)?].trim().parse().ok()
}

/// Our prefill tokens/s for a `prompt`-token prompt in chunks of up to 8 (`--prefill`).
fn our_prefill(bench: &Path, model: &Path, threads: usize, prompt: usize) -> Result<f64> {
    let args = [
        "--threads".to_string(),
        threads.to_string(),
        "--steps".into(),
        prompt.to_string(),
        "--prefill".into(),
        prompt.to_string(),
        "--prefill-chunk".into(),
        prompt.min(8).to_string(),
    ];
    let line = our_line(bench, model, &args, "prefill:")?;
    between(&line, "ms = ", " tokens/s").context("no prefill rate")
}

/// Our decode tokens/s (the median per-token time) and fraction of the read bandwidth for
/// `steps` teacher-forced tokens.
fn our_decode(bench: &Path, model: &Path, threads: usize, steps: usize) -> Result<(f64, f64)> {
    let args = [
        "--threads".to_string(),
        threads.to_string(),
        "--steps".into(),
        steps.to_string(),
    ];
    let line = our_line(bench, model, &args, "steps: median")?;
    let ms = between(&line, "median ", " ms/token").context("no median")?;
    let percent = between(&line, "GB/s; ", "% of the read").context("no read fraction")?;
    Ok((1e3 / ms, percent / 100.0))
}
