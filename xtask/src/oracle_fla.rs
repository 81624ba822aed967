//! `cargo xtask oracle-fla-kda`: freezes a KDA reference vector made by flash-linear-attention's
//! pure-PyTorch references (PyPI `fla-core`: `naive_kda_lowerbound_gate`, `naive_kda_gate`,
//! `naive_recurrent_kda`) for the k3-model tests, with a sha256 sidecar so an edited vector
//! fails.
//!
//! fla's Triton kernels do not run on a CPU, but its naive references do; they need torch, so
//! they run here, in the oracle venv under `target/`, and never in `cargo test`.

use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use crate::oracle::{DEFAULT_VENV, freeze_json, venv_with};
use crate::{Options, command_line, from_root};

/// Exact pins: `fla-core` is the package that holds `fla/ops` (`flash-linear-attention` 0.6.0
/// only adds the layers and models on top of it and pulls in transformers); einops is its one
/// plain dependency. torch is whatever the venv already has, and is recorded in the vector.
const PINS: [&str; 2] = ["fla-core==0.6.0", "einops==0.8.2"];
/// Fixed so that regenerating reproduces the committed bytes; changing it changes the vector.
const SEED: u64 = 0x4B33_FDA0;
const SCRIPT: &str = "xtask/oracle/fla_kda.py";
const DEFAULT_OUT: &str = "crates/k3-model/tests/data/fla_kda";
const FILE: &str = "kda.json";
/// The gate forms the script must cover, in its order.
const GATES: [&str; 2] = ["lower_bound", "softplus"];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let dir = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-fla-kda", args);

    let python = venv_with(&venv, &PINS)?;

    freeze_json(&python, SCRIPT, SEED, &command, &dir, FILE, check_vector)?;
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Sanity checks on what the script wrote, before it replaces the committed vector: every
/// array has the length its shape gives, and both gate forms are there. Returns the recorded
/// package versions for the summary.
fn check_vector(bytes: &[u8]) -> Result<String> {
    let json: serde_json::Value = serde_json::from_slice(bytes).context("vector is not json")?;
    let dim = |name: &str| -> Result<usize> {
        let n = json["shape"][name]
            .as_u64()
            .with_context(|| format!("no shape.{name}"))?;
        ensure!(n > 0, "shape.{name} is 0");
        Ok(n as usize)
    };
    let (t, h, k, v) = (dim("T")?, dim("H")?, dim("K")?, dim("V")?);
    let check = |what: &str, value: &serde_json::Value, floats: usize| -> Result<()> {
        let hex = value.as_str().with_context(|| format!("no {what}"))?;
        if hex.len() != floats * 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("{what}: {} hex digits, expected {floats} f32", hex.len());
        }
        Ok(())
    };
    let inputs = &json["inputs"];
    for (name, floats) in [
        ("q_raw", t * h * k),
        ("k_raw", t * h * k),
        ("q_l2", t * h * k),
        ("k_l2", t * h * k),
        ("v", t * h * v),
        ("f", t * h * k),
        ("dt_bias", h * k),
        ("a_log", h),
        ("beta_logit", t * h),
        ("beta", t * h),
    ] {
        check(&format!("inputs.{name}"), &inputs[name], floats)?;
    }
    check("scale", &json["scale"], 1)?;
    let cases = json["cases"].as_array().context("no cases list")?;
    let gates: Vec<&str> = cases.iter().filter_map(|c| c["gate"].as_str()).collect();
    ensure!(
        gates == GATES,
        "cases cover gates {gates:?}, expected {GATES:?}"
    );
    for case in cases {
        let gate = case["gate"].as_str().unwrap_or("?");
        check(&format!("{gate}.g"), &case["g"], t * h * k)?;
        check(&format!("{gate}.o"), &case["o"], t * h * v)?;
        check(
            &format!("{gate}.final_state"),
            &case["final_state"],
            h * k * v,
        )?;
    }
    let versions = json["packages"]
        .as_object()
        .context("vector records no package versions")?;
    ensure!(
        versions.get("fla-core").and_then(|v| v.as_str()) == Some("0.6.0"),
        "vector was not made by fla-core 0.6.0: {versions:?}"
    );
    Ok(versions
        .iter()
        .map(|(name, version)| format!("{name}=={}", version.as_str().unwrap_or("?")))
        .collect::<Vec<_>>()
        .join(" "))
}
