//! `cargo xtask bench-spec --model DIR [--threads 2] [--tokens 64] [--reps 5] [--pairs 2]
//! [--max-pass 16] [--max-draft 8] [--rates 0,0.3,0.5,0.7,0.9] [--seed 0] [--bandwidth-gbps 400]
//! [--kernel-tier T] [--resident-trunk]`: builds k3-bench's `spec_bench` in release and runs it
//! on the checkpoint — exact speculative decoding's cost curve (verify passes of 1..16
//! tokens), the oracle drafter at each acceptance rate off against on, the n-gram drafter on a
//! code-editing prompt, and the release projection (docs/BENCHMARKS.md). Its output goes to
//! stdout as the bench prints it.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{Options, from_root};

/// The options `bench-spec` takes and hands to the bench as they are (a switch ends in `!`);
/// `--model` and `--threads` are added by [`bench_args`].
const PASSED: &[&str] = &[
    "tokens",
    "reps",
    "pairs",
    "max-pass",
    "max-draft",
    "rates",
    "seed",
    "bandwidth-gbps",
    "kernel-tier",
    "resident-trunk!",
];

/// Two threads unless told: the machine's default for reproducible runs.
const DEFAULT_THREADS: &str = "2";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let bench_args = bench_args(args)?;
    let bench = crate::bench_peers::build_bench_bin("spec_bench")?;
    let status = Command::new(&bench)
        .args(&bench_args)
        .status()
        .with_context(|| format!("starting {}", bench.display()))?;
    anyhow::ensure!(
        status.success(),
        "{} {bench_args:?}: {status}",
        bench.display()
    );
    Ok(())
}

/// The bench's command line for `bench-spec`'s: `--model` (required, a relative path taken
/// from the workspace root), `--threads` (default 2), and every passed option as given.
fn bench_args(args: &[String]) -> Result<Vec<String>> {
    let mut allowed = vec!["model", "threads"];
    allowed.extend_from_slice(PASSED);
    let o = Options::parse(args, &allowed)?;
    let model: PathBuf = from_root(o.get("model").context("--model DIR is required")?);
    let mut out = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--threads".into(),
        o.get("threads").unwrap_or(DEFAULT_THREADS).to_owned(),
    ];
    for name in PASSED {
        let switch = name.ends_with('!');
        let name = name.trim_end_matches('!');
        match o.get(name) {
            Some(_) if switch => out.push(format!("--{name}")),
            Some(value) => out.extend([format!("--{name}"), value.to_owned()]),
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn the_bench_gets_the_model_from_the_root_two_threads_and_what_was_passed() {
        let root = crate::workspace_root();
        assert_eq!(
            bench_args(&args(&["--model", "ck"])).unwrap(),
            args(&[
                "--model",
                &root.join("ck").display().to_string(),
                "--threads",
                "2"
            ])
        );
        assert_eq!(
            bench_args(&args(&[
                "--model",
                "/abs/ck",
                "--threads=1",
                "--tokens",
                "32",
                "--resident-trunk",
                "--rates",
                "0.5,0.7",
            ]))
            .unwrap(),
            args(&[
                "--model",
                "/abs/ck",
                "--threads",
                "1",
                "--tokens",
                "32",
                "--rates",
                "0.5,0.7",
                "--resident-trunk"
            ])
        );
        let error = |words: &[&str]| format!("{:#}", bench_args(&args(words)).unwrap_err());
        assert!(error(&["--tokens", "3"]).contains("--model DIR is required"));
        assert!(error(&["--model", "m", "--steps", "3"]).contains("unknown option --steps"));
        assert!(error(&["--model", "m", "--resident-trunk=yes"]).contains("is a switch"));
    }
}
