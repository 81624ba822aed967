//! Tidy checks, run as ordinary tests: the house rules a reviewer would otherwise check by eye.

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits below the root")
        .to_owned()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable source tree") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "benches"] {
        rust_files(&root().join(dir), &mut files);
    }
    assert!(
        files.len() > 10,
        "found only {} Rust files: is the walk broken?",
        files.len()
    );
    files
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let bad: Vec<_> = sources()
        .into_iter()
        .filter(|f| {
            !fs::read_to_string(f)
                .expect("utf-8 source")
                .starts_with("//!")
        })
        .collect();
    assert!(
        bad.is_empty(),
        "files without a leading `//!` line: {bad:?}"
    );
}

/// Every `unsafe {` block carries a `// SAFETY:` comment on one of the lines just above it.
#[test]
fn every_unsafe_block_has_a_safety_comment() {
    // Built at runtime so this file does not match itself.
    let needle = ["unsafe", " {"].concat();
    let mut bad = Vec::new();
    let mut blocks = 0;
    for file in sources() {
        let text = fs::read_to_string(&file).expect("utf-8 source");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if !code.contains(&needle) {
                continue;
            }
            blocks += 1;
            let window = &lines[i.saturating_sub(4)..=i];
            if !window.iter().any(|l| l.contains("SAFETY:")) {
                bad.push(format!("{}:{}", file.display(), i + 1));
            }
        }
    }
    assert!(
        blocks > 20,
        "found only {blocks} unsafe blocks: is the scan broken?"
    );
    assert!(
        bad.is_empty(),
        "unsafe blocks without a nearby `// SAFETY:` comment: {bad:#?}"
    );
}

/// One binary runs everywhere and picks its kernel tier at runtime.
#[test]
fn no_target_cpu_native() {
    let config = fs::read_to_string(root().join(".cargo/config.toml")).expect("cargo config");
    let active: String = config
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    assert!(
        !active.contains("target-cpu"),
        "target-cpu must not be set in .cargo/config.toml"
    );
}

/// Libraries take explicit config: only binaries (k3-serve, xtask) read the environment.
#[test]
fn libraries_read_no_environment() {
    let mut bad = Vec::new();
    for file in sources() {
        let path = file.to_string_lossy();
        if !path.contains("/crates/") || path.contains("/k3-serve/") || path.contains("/tests/") {
            continue;
        }
        let text = fs::read_to_string(&file).expect("utf-8 source");
        if text.contains("std::env::var") || text.contains("env::var(") {
            bad.push(file);
        }
    }
    assert!(
        bad.is_empty(),
        "library code reading environment variables: {bad:?}"
    );
}
