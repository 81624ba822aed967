//! `cargo xtask oracle-mxfp4`: freezes an MXFP4 decode oracle made by independent PyPI
//! references (compressed-tensors quantises and packs, ml_dtypes decodes) for the
//! `mxfp4-kernels` integration tests, with a sha256 sidecar so an edited vector fails.
//!
//! The references need torch (a ~5 GB wheel), so they run here, in a venv under `target/`,
//! and never in `cargo test`: the tests read only the committed JSON.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use sha2::{Digest, Sha256};

use crate::{Options, command_line, from_root, workspace_root};

/// Exact pins: a different release could change packing or rounding, and the oracle would
/// silently follow it.
pub(crate) const PINNED: [&str; 2] = ["ml-dtypes==0.6.0", "compressed-tensors==0.20.0"];
/// Fixed so that regenerating reproduces the committed bytes; changing it changes the oracle.
const SEED: u64 = 0x4B33;
const SCRIPT: &str = "xtask/oracle/mxfp4_oracle.py";
pub(crate) const DEFAULT_VENV: &str = "target/oracle-venv";
const DEFAULT_OUT: &str = "crates/mxfp4-kernels/tests/data/mxfp4_oracle.json";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-mxfp4", args);

    let python = venv_with(&venv, &PINNED)?;

    let dir = out
        .parent()
        .with_context(|| format!("output path {} has no parent", out.display()))?;
    let file_name = out
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("output path {} has no utf-8 file name", out.display()))?;
    freeze_json(
        &python,
        SCRIPT,
        SEED,
        &command,
        dir,
        file_name,
        check_oracle,
    )?;
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs an oracle script (`SCRIPT --seed N --command C --out FILE.partial`), checks what it
/// wrote with `check` (which returns the package versions it records), then moves it to
/// `dir/file_name` with a `sha256sum`-format sidecar, so an interrupted run never leaves a
/// half vector that matches no sidecar.
pub(crate) fn freeze_json(
    python: &Path,
    script: &str,
    seed: u64,
    command: &str,
    dir: &Path,
    file_name: &str,
    check: fn(&[u8]) -> Result<String>,
) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let out = dir.join(file_name);
    let partial = dir.join(format!("{file_name}.partial"));
    let mut run = Command::new(python);
    run.arg(from_root(script))
        .args(["--seed", &seed.to_string(), "--command", command, "--out"])
        .arg(&partial);
    run_checked(&mut run)?;
    let bytes = fs::read(&partial).with_context(|| format!("cannot read {}", partial.display()))?;
    let versions = check(&bytes).with_context(|| format!("bad vector in {}", partial.display()))?;
    let digest = sha256_hex(&bytes);
    fs::rename(&partial, &out)
        .with_context(|| format!("cannot move the vector to {}", out.display()))?;
    write_sidecar(dir, file_name, &digest)?;
    println!("command:  {command}");
    println!("wrote:    {} ({} bytes)", relative(&out), bytes.len());
    println!("sha256:   {digest}");
    println!("packages: {versions}");
    Ok(())
}

/// Writes `dir/{file}.sha256` in `sha256sum`'s format, so `sha256sum -c` in `dir` checks it.
fn write_sidecar(dir: &Path, file: &str, digest: &str) -> Result<()> {
    let sidecar = dir.join(format!("{file}.sha256"));
    fs::write(&sidecar, format!("{digest}  {file}\n"))
        .with_context(|| format!("cannot write {}", sidecar.display()))
}

/// A fresh, empty `{out}.partial` directory beside `out`, where a multi-file oracle writes
/// everything first, so an interrupted or rejected run never leaves files that disagree with
/// their sidecars. Publish it with [`publish_staged`].
pub(crate) fn staging_dir(out: &Path) -> Result<PathBuf> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("output path {} has no utf-8 name", out.display()))?;
    let staging = out.with_file_name(format!("{name}.partial"));
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .with_context(|| format!("cannot remove stale {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    Ok(staging)
}

/// Writes a sidecar for each of `hashed` in `staging`, then moves `files` and those sidecars
/// into `out` and removes `staging`. Returns each hashed file's sha256.
pub(crate) fn publish_staged<'a>(
    staging: &Path,
    out: &Path,
    files: &[&str],
    hashed: &[&'a str],
) -> Result<Vec<(&'a str, String)>> {
    let mut digests = Vec::new();
    for &file in hashed {
        let bytes = fs::read(staging.join(file)).with_context(|| format!("cannot read {file}"))?;
        let digest = sha256_hex(&bytes);
        write_sidecar(staging, file, &digest)?;
        digests.push((file, digest));
    }
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let moved = files
        .iter()
        .map(|f| (*f).to_owned())
        .chain(hashed.iter().map(|f| format!("{f}.sha256")));
    for file in moved {
        fs::rename(staging.join(&file), out.join(&file))
            .with_context(|| format!("cannot move {file} to {}", out.display()))?;
    }
    fs::remove_dir(staging).with_context(|| format!("cannot remove {}", staging.display()))?;
    Ok(digests)
}

/// The venv's interpreter with `pins` installed (exact pins already satisfied make this a
/// quick no-op when the venv is reused).
pub(crate) fn venv_with(venv: &Path, pins: &[&str]) -> Result<PathBuf> {
    let python = ensure_venv(venv)?;
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .args(pins);
    run_checked(&mut pip)?;
    Ok(python)
}

/// The venv's interpreter, creating the venv with the system `python3` if it is missing.
pub(crate) fn ensure_venv(venv: &Path) -> Result<PathBuf> {
    let python = venv.join("bin").join("python");
    if !python.exists() {
        println!("creating venv {}", relative(venv));
        run_checked(Command::new("python3").args(["-m", "venv"]).arg(venv))?;
    }
    Ok(python)
}

/// Lower-case hex of the sha256 of `bytes`, as `sha256sum` prints it.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Sanity checks on what the script wrote, before it replaces the committed oracle; returns
/// the recorded package versions for the summary.
fn check_oracle(bytes: &[u8]) -> Result<String> {
    let json: serde_json::Value = serde_json::from_slice(bytes).context("oracle is not json")?;
    let tensors = json["tensors"]
        .as_array()
        .context("oracle has no tensors list")?;
    ensure!(!tensors.is_empty(), "oracle has an empty tensors list");
    for tensor in tensors {
        let name = tensor["name"].as_str().context("tensor without a name")?;
        let rows = tensor["rows"]
            .as_u64()
            .with_context(|| format!("{name}: no rows"))?;
        let cols = tensor["cols"]
            .as_u64()
            .with_context(|| format!("{name}: no cols"))?;
        for (field, expected) in [
            ("weight_packed", rows * cols / 2),
            ("weight_scale", rows * cols / 32),
            ("dequant_f32_bits", rows * cols * 4),
        ] {
            let hex = tensor[field]
                .as_str()
                .with_context(|| format!("{name}: no {field}"))?;
            let found = hex.len() as u64 / 2;
            if found != expected {
                bail!("{name}: {field} holds {found} bytes, expected {expected} for {rows}x{cols}");
            }
        }
    }
    let versions = json["packages"]
        .as_object()
        .context("oracle records no package versions")?;
    Ok(versions
        .iter()
        .map(|(name, version)| format!("{name}=={}", version.as_str().unwrap_or("?")))
        .collect::<Vec<_>>()
        .join(" "))
}

/// Runs `command` with inherited stdio (pip's progress is worth seeing) and fails on a
/// non-zero exit.
pub(crate) fn run_checked(command: &mut Command) -> Result<()> {
    command.current_dir(workspace_root());
    let shown = format!("{command:?}");
    let status = command
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    ensure!(status.success(), "{shown} exited with {status}");
    Ok(())
}

/// `path` relative to the workspace root when it lies inside it, for shorter messages.
pub(crate) fn relative(path: &Path) -> String {
    path.strip_prefix(workspace_root())
        .unwrap_or(path)
        .display()
        .to_string()
}
