//! `cargo xtask oracle-hf-download`: freezes what huggingface_hub's own `hf download` makes of
//! the download command the docs give for the release: the command is read from the docs (the
//! one code line that starts `hf download moonshotai/Kimi-K3`, with its continuation lines),
//! parsed by the pinned huggingface_hub's CLI with its download functions replaced by a
//! recorder (nothing is fetched), and its patterns applied by huggingface_hub's own filter to
//! the release's file listing (96 shards, the last two holding only the vision tower, and the
//! repository's other files, K3_SPEC §3). `xtask/tests/docs.rs` checks that the docs still
//! give that command and that it selects every text shard, the files `--model` needs and no
//! vision shard.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use crate::oracle::{publish_staged, run_checked, staging_dir, venv_with};
use crate::{Options, command_line, from_root};

const PINS: [&str; 1] = ["huggingface_hub==2.4.0"];
const SCRIPT: &str = "xtask/oracle/hf_download.py";
const DEFAULT_VENV: &str = "target/hf-venv";
const DEFAULT_OUT: &str = "xtask/tests/data/hf_download";
/// Where the docs live: the command is looked for in these.
const DOCS: [&str; 2] = ["README.md", "docs"];
/// How the command begins.
const COMMAND_START: &str = "hf download moonshotai/Kimi-K3";
/// The release's files besides its 96 shards (K3_SPEC §3: the index, config, tokenizer, the
/// reference Python, the generation config; and what every model repository has).
const OTHER_FILES: [&str; 13] = [
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "tokenization_kimi.py",
    "encoding_k3.py",
    "configuration_kimi_k3.py",
    "modeling_kimi_linear.py",
    "modeling_kimi_k3.py",
    "README.md",
    "LICENSE",
    ".gitattributes",
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-hf-download", args);
    let (found_in, download) = docs_command()?;
    let python = venv_with(&venv, &PINS)?;

    let staging = staging_dir(&out)?;
    let mut files: Vec<String> = (1..=96)
        .map(|i| format!("model-{i:05}-of-000096.safetensors"))
        .collect();
    files.extend(OTHER_FILES.iter().map(|f| (*f).to_owned()));
    let listing = staging.join("files.json");
    fs::write(&listing, serde_json::to_vec(&files)?)?;
    let parsed = staging.join("parsed.json");
    let mut script = Command::new(&python);
    script
        .arg(from_root(SCRIPT))
        .args(["--command", &download])
        .arg("--files")
        .arg(&listing)
        .arg("--out")
        .arg(&parsed);
    run_checked(&mut script)?;
    fs::remove_file(&listing)?;
    let json: serde_json::Value = serde_json::from_slice(&fs::read(&parsed)?)?;
    let selected = json["selected"].as_array().context("no selection")?;
    ensure!(
        json["command"] == download.as_str(),
        "the script parsed another command"
    );
    fs::write(
        staging.join("README.md"),
        format!(
            "# The release's download command, as huggingface_hub parses it\n\n\
             `parsed.json`: the command found in `{found_in}`, parsed by huggingface_hub {} \
             (its CLI, the download replaced by a recorder) and its patterns applied by its own \
             filter to the release's listing: {} of {} files selected. \
             `xtask/tests/docs.rs` checks the docs still give this command and what it selects.\n\n\
             - command: `{command}`\n- script: `{SCRIPT}`\n",
            json["huggingface_hub"].as_str().unwrap_or("?"),
            selected.len(),
            files.len()
        ),
    )?;
    let digests = publish_staged(
        &staging,
        &out,
        &["parsed.json", "README.md"],
        &["parsed.json"],
    )?;
    println!("command:  {command}");
    println!("download: {download}");
    println!("selected: {} of {} files", selected.len(), files.len());
    for (file, digest) in digests {
        println!("wrote:    {}/{file}  sha256 {digest}", out.display());
    }
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The docs' download command (its continuation lines joined) and the file it is in.
fn docs_command() -> Result<(String, String)> {
    let mut found = Vec::new();
    for doc in DOCS {
        let path = from_root(doc);
        let files = if path.is_dir() {
            let mut md: Vec<_> = fs::read_dir(&path)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "md"))
                .collect();
            md.sort();
            md
        } else {
            vec![path]
        };
        for file in files {
            let text = fs::read_to_string(&file)?;
            for command in download_commands(&text) {
                found.push((relative(&file), command));
            }
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => bail!("no `{COMMAND_START}` command in README.md or docs/"),
        n => bail!("{n} `{COMMAND_START}` commands in the docs; keep one"),
    }
}

fn relative(path: &Path) -> String {
    crate::oracle::relative(path)
}

/// Each line of `text` that begins the download command, with its `\` continuation lines,
/// joined by single spaces.
fn download_commands(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_start().starts_with(COMMAND_START) {
            let mut parts = Vec::new();
            loop {
                let line = lines[i].trim();
                match line.strip_suffix('\\') {
                    Some(head) => parts.push(head.trim().to_owned()),
                    None => {
                        parts.push(line.to_owned());
                        break;
                    }
                }
                i += 1;
                if i == lines.len() {
                    break;
                }
            }
            out.push(parts.join(" "));
        }
        i += 1;
    }
    out
}
