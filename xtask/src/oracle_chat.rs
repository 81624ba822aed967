//! `cargo xtask oracle-chat`: freezes llama.cpp's Kimi-K3 chat template, rendered by PyPI
//! `jinja2`, for the conversations in `crates/k3-model/tests/data/chat/conversations.json`,
//! as the reference for our chat renderer and output parser (k3-model `tests/model/chat.rs`).
//!
//! The template comes from the same llama-cpp-python sdist `oracle-llamacpp` fetches (sha256
//! pinned there, cached under `target/llamacpp`); only the sdist is needed, nothing is built.
//! The venv holds jinja2 alone.

use std::fs;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};

use crate::oracle::{publish_staged, run_checked, sha256_hex, staging_dir, venv_with};
use crate::oracle_llamacpp::{SDIST, SDIST_SHA256, WORK_DIR, fetch_sdist};
use crate::{Options, command_line, from_root};

const PINS: [&str; 1] = ["jinja2==3.1.6"];
const SCRIPT: &str = "xtask/oracle/chat_template.py";
const DEFAULT_VENV: &str = "target/chat-venv";
const DEFAULT_OUT: &str = "crates/k3-model/tests/data/chat";
const CONVERSATIONS: &str = "crates/k3-model/tests/data/chat/conversations.json";
const TEMPLATE: &str = "models/templates/Kimi-K3.jinja";
/// The vector must keep at least this many conversations (issue 14's acceptance).
const MIN_CASES: usize = 30;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-chat", args);
    let work = from_root(WORK_DIR);
    fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let source = fetch_sdist(&work)?;
    let template = source.join(TEMPLATE);
    let template_sha256 = sha256_hex(
        &fs::read(&template).with_context(|| format!("cannot read {}", template.display()))?,
    );
    let python = venv_with(&venv, &PINS)?;

    let staging = staging_dir(&out)?;
    let rendered = staging.join("rendered.json");
    let mut script = Command::new(&python);
    script
        .arg(from_root(SCRIPT))
        .arg("--template")
        .arg(&template)
        .arg("--conversations")
        .arg(from_root(CONVERSATIONS))
        .args([
            "--sdist",
            SDIST,
            "--sdist-sha256",
            SDIST_SHA256,
            "--command",
            &command,
        ])
        .arg("--out")
        .arg(&rendered);
    run_checked(&mut script)?;
    let json: serde_json::Value =
        serde_json::from_slice(&fs::read(&rendered)?).context("rendered.json is not json")?;
    let cases = json["cases"].as_array().context("no cases")?;
    ensure!(
        cases.len() >= MIN_CASES,
        "only {} conversations, need at least {MIN_CASES}",
        cases.len()
    );
    ensure!(
        json["template_sha256"] == template_sha256.as_str(),
        "the script read another template"
    );
    fs::write(
        staging.join("README.md"),
        readme(&command, &template_sha256, &json, cases.len()),
    )?;
    let digests = publish_staged(
        &staging,
        &out,
        &["rendered.json", "README.md"],
        &["rendered.json"],
    )?;
    println!("command:  {command}");
    for (file, digest) in digests {
        println!("wrote:    {}/{file}  sha256 {digest}", out.display());
    }
    println!("cases:    {}", cases.len());
    println!("template: {TEMPLATE} sha256 {template_sha256}");
    println!("packages: {}", json["packages"]);
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn readme(command: &str, template_sha256: &str, json: &serde_json::Value, cases: usize) -> String {
    format!(
        "# Kimi-K3 chat template vector\n\n\
         `rendered.json` holds llama.cpp's Kimi-K3 chat template rendered for each of the {cases} \
         conversations in `conversations.json` (hand-written; edit it, then regenerate). \
         `tests/model/chat.rs` renders the same conversations with `k3_model::chat::render` and \
         compares byte for byte, and runs every assistant turn back through the output parser.\n\n\
         - command: `{command}`\n\
         - sdist: `{SDIST}` (PyPI, sha256 `{SDIST_SHA256}`)\n\
         - template: `vendor/llama.cpp/{TEMPLATE}`, sha256 `{template_sha256}`\n\
         - renderer: jinja2 {jinja2}, {environment}\n\
         - conversations.json sha256: `{conversations}` (recorded in rendered.json; the test \
         checks it)\n\n\
         Objects in `conversations.json` keep their keys in the order written (the template \
         writes them in insertion order, and the engine's `serde_json` is built with \
         `preserve_order`); several conversations give a call's arguments and the tools' \
         schemas keys that are not sorted, as a model writes them.\n",
        jinja2 = json["packages"]["jinja2"].as_str().unwrap_or("?"),
        environment = json["environment"].as_str().unwrap_or("?"),
        conversations = json["conversations_sha256"].as_str().unwrap_or("?"),
    )
}
