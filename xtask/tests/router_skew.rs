//! `cargo xtask set-router-skew` rewrites a checkpoint into exactly what `gen-k3-synth
//! --router-skew` writes, and back.

use std::path::{Path, PathBuf};
use std::process::Command;

fn xtask(args: &[&str]) {
    let status = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .status()
        .expect("xtask runs");
    assert!(status.success(), "xtask {args:?}");
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn set_router_skew_matches_generation_with_that_skew() {
    let base = std::env::temp_dir().join(format!("k3-skew-{}", std::process::id()));
    let dir = |tag: &str| -> PathBuf { base.join(tag) };
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    xtask(&["gen-k3-synth", "--preset", "tiny", "--out", &s(dir("flat"))]);
    xtask(&[
        "gen-k3-synth",
        "--preset",
        "tiny",
        "--out",
        &s(dir("skewed")),
        "--router-skew",
        "1.5",
    ]);
    let flat = files(&dir("flat"));
    xtask(&[
        "set-router-skew",
        "--model",
        &s(dir("flat")),
        "--skew",
        "1.5",
    ]);
    assert!(
        files(&dir("flat")) == files(&dir("skewed")),
        "skew 1.5 in place differs from generating it"
    );
    xtask(&["set-router-skew", "--model", &s(dir("flat")), "--skew", "0"]);
    assert!(
        files(&dir("flat")) == flat,
        "skew 0 does not restore the flat checkpoint"
    );
    std::fs::remove_dir_all(&base).unwrap();
}
