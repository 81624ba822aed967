//! `cargo xtask oracle-tiktoken`: freezes a tokenizer reference vector made by the PyPI
//! `tiktoken` package on the synthetic checkpoints' vocabulary with the Kimi split pattern,
//! for the k3-model tokenizer test. The vocabulary files are written next to the vector (the
//! test loads them), each with a sha256 sidecar.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use k3_model::synth::tokenizer::{SPECIAL_SLOTS, learn_bpe, tiktoken_model, tokenizer_config};

use crate::oracle::{DEFAULT_VENV, publish_staged, run_checked, staging_dir, venv_with};
use crate::{Options, command_line, from_root};

const PINS: [&str; 1] = ["tiktoken==0.14.0"];
const SEED: u64 = 0x4B33_70C3;
const SCRIPT: &str = "xtask/oracle/tiktoken_vector.py";
const DEFAULT_OUT: &str = "crates/k3-model/tests/data/tiktoken";
/// K3's vocabulary size: the special tokens sit at their release ids (163584..).
const VOCAB_SIZE: usize = 163_840;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-tiktoken", args);
    let python = venv_with(&venv, &PINS)?;

    let staging = staging_dir(&out)?;
    let vocab = learn_bpe(VOCAB_SIZE - SPECIAL_SLOTS);
    std::fs::write(staging.join("tiktoken.model"), tiktoken_model(&vocab))?;
    std::fs::write(
        staging.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config(VOCAB_SIZE))?,
    )?;
    let vector = staging.join("vector.json");
    let mut script = Command::new(&python);
    script
        .arg(from_root(SCRIPT))
        .args([
            "--seed",
            &SEED.to_string(),
            "--command",
            &command,
            "--vocab",
        ])
        .arg(&staging)
        .arg("--out")
        .arg(&vector);
    run_checked(&mut script)?;
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&vector)?).context("vector is not json")?;
    let cases = json["cases"].as_array().context("no cases")?;
    ensure!(cases.len() >= 200, "only {} cases", cases.len());
    ensure!(
        json["packages"]["tiktoken"] == "0.14.0",
        "vector was not made by tiktoken 0.14.0: {}",
        json["packages"]
    );
    let files = ["tiktoken.model", "tokenizer_config.json", "vector.json"];
    let digests = publish_staged(&staging, &out, &files, &files)?;
    println!("command:  {command}");
    for (file, digest) in digests {
        println!("wrote:    {}/{file}  sha256 {digest}", out.display());
    }
    println!("cases:    {}", cases.len());
    println!("packages: {}", json["packages"]);
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
