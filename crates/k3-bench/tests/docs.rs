//! The first example of docs/BENCHMARKS.md and of docs/HOSTS.md, run as the pages give them:
//! the page's first `sh` block is read, `cargo run --release -p k3-bench --bin
//! teacher_forced_decode_bench --` becomes this test's binary, and what the page says you see
//! is checked (the step lines, the summary, the fingerprints it quotes; for HOSTS.md, the
//! same fingerprints as one domain). A block that changes shape fails the test.

use std::process::Command;

use k3_cli::{args_after, first_sh_block};

const BENCHMARKS: &str = include_str!("../../../docs/BENCHMARKS.md");
const HOSTS: &str = include_str!("../../../docs/HOSTS.md");

/// How the pages run the bench.
const CARGO_RUN: &str = "cargo run --release -p k3-bench --bin teacher_forced_decode_bench --";

/// What a run printed, stdout and stderr together.
fn run(args: &[String]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_teacher_forced_decode_bench"))
        .args(args)
        .output()
        .expect("the bench starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{args:?} failed:\n{text}");
    text
}

/// The page's first example's arguments.
fn first_example(page: &str) -> Vec<String> {
    let commands = first_sh_block(page);
    assert_eq!(commands.len(), 1, "one command: {commands:?}");
    args_after(&commands[0], CARGO_RUN)
}

/// `(token, fingerprint)` of every step line (`step    0 token    648  ... fingerprint X`).
fn steps(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(words[2], "token", "{l}");
            let at = words
                .iter()
                .position(|w| *w == "fingerprint")
                .unwrap_or_else(|| panic!("no fingerprint in {l}"));
            (words[3].to_owned(), words[at + 1].to_owned())
        })
        .collect()
}

/// The summary's combined fingerprint.
fn combined(text: &str) -> &str {
    text.lines()
        .find_map(|l| {
            l.split_once("combined fingerprint ")
                .map(|(_, fp)| fp.trim())
        })
        .unwrap_or_else(|| panic!("no combined fingerprint in {text}"))
}

/// `page` with its whitespace runs as single spaces, so a quote may wrap.
fn flat(page: &str) -> String {
    page.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether the run took the scalar tier, whose sums run in another order than the SIMD tiers'
/// (the fingerprints the pages quote are the exact SIMD tiers').
fn scalar(text: &str) -> bool {
    let scalar = text.contains("kernel tier scalar");
    if scalar {
        eprintln!("the scalar tier (no AVX2 here): the quoted fingerprints are not compared");
    }
    scalar
}

/// docs/BENCHMARKS.md: a line per `--steps` step, the first as quoted, and the summary with
/// the weight bytes per token the page gives.
#[test]
fn benchmarks_md_first_example_prints_the_steps_and_summary() {
    let args = first_example(BENCHMARKS);
    let at = args
        .iter()
        .position(|a| a == "--steps")
        .expect("the example gives --steps");
    let n: usize = args[at + 1].parse().unwrap();
    let text = run(&args);
    let steps = steps(&text);
    assert_eq!(steps.len(), n, "{text}");
    let page = flat(BENCHMARKS);
    let (token, fp) = &steps[0];
    if !scalar(&text) {
        assert!(
            page.contains(&format!("token {token}")) && page.contains(&format!("fingerprint {fp}")),
            "BENCHMARKS.md should quote step 0 as token {token}, fingerprint {fp}"
        );
    }
    let summary = text
        .lines()
        .find(|l| l.starts_with(&format!("{n} steps: median ")))
        .unwrap_or_else(|| panic!("no summary in {text}"));
    let bytes = summary
        .split("; ")
        .find_map(|part| part.strip_suffix(" weight bytes per token"))
        .unwrap_or_else(|| panic!("no weight bytes in {summary}"));
    assert!(
        page.contains(&format!("{bytes} weight bytes per token")),
        "BENCHMARKS.md should give {bytes} weight bytes per token"
    );
    assert!(summary.contains("of the read bandwidth"), "{summary}");
    assert!(
        page.contains(&format!("`{n} steps: median ")),
        "the page quotes the summary"
    );
}

/// docs/HOSTS.md: two synthetic domains, as the page quotes the topology, give the step and
/// combined fingerprints of one domain on one thread, and those the page quotes.
#[test]
fn hosts_md_first_example_gives_the_fingerprints_of_one_domain() {
    let args = first_example(HOSTS);
    let at = args
        .iter()
        .position(|a| a == "--numa-fake")
        .expect("the example gives --numa-fake");
    let domains = &args[at + 1];
    let text = run(&args);
    let topology = format!("topology: {domains} synthetic domains (--numa-fake);");
    assert!(text.contains(&topology), "{text}");
    let page = flat(HOSTS);
    assert!(
        page.contains(&format!("`{topology}")),
        "HOSTS.md quotes {topology:?}"
    );

    // One domain, one thread: the same bits.
    let mut alone: Vec<String> = args
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != at && i != at + 1)
        .map(|(_, a)| a.clone())
        .collect();
    let threads = alone
        .iter()
        .position(|a| a == "--threads")
        .expect("the example gives --threads");
    alone[threads + 1] = "1".into();
    let one = run(&alone);
    assert!(!one.contains("--numa-fake"), "{one}");
    assert_eq!(steps(&text), steps(&one));
    assert_eq!(combined(&text), combined(&one));

    if !scalar(&text) {
        let (token, fp) = &steps(&text)[0];
        assert!(
            page.contains(&format!("token {token}")) && page.contains(&format!("fingerprint {fp}")),
            "HOSTS.md should quote step 0 as token {token}, fingerprint {fp}"
        );
        let all = combined(&text);
        assert!(
            page.contains(&format!("`{all}`")),
            "HOSTS.md should quote the combined fingerprint {all}"
        );
    }
}

/// docs/BENCHMARKS.md's `--depth N`: the timed steps run after N tokens prefilled untimed, so
/// they are the steps N.. of a run without depth (same tokens, same logits fingerprints), and
/// `--prefill M --depth N` ends with the logits of token N + M - 1 of that run.
#[test]
fn depth_times_the_steps_after_the_prefilled_tokens() {
    let page = flat(BENCHMARKS);
    assert!(page.contains("`--depth N` first prefills N tokens, untimed"));
    let args = |extra: &[&str]| -> Vec<String> {
        ["--preset", "tiny", "--probe-mb", "0"]
            .iter()
            .chain(extra)
            .map(|a| a.to_string())
            .collect()
    };
    let plain = run(&args(&["--steps", "8"]));
    let deep = run(&args(&[
        "--depth",
        "5",
        "--depth-chunk",
        "2",
        "--steps",
        "3",
    ]));
    assert!(
        deep.contains("depth: 5 tokens prefilled in chunks of 2"),
        "{deep}"
    );
    assert!(deep.contains("3 steps at depth 5: median "), "{deep}");
    let all = steps(&plain);
    assert_eq!(all.len(), 8, "{plain}");
    assert_eq!(steps(&deep), all[5..].to_vec(), "{plain}\n{deep}");
    let prefill = run(&args(&[
        "--depth",
        "5",
        "--prefill",
        "3",
        "--prefill-chunk",
        "2",
    ]));
    let line = prefill
        .lines()
        .find(|l| l.starts_with("prefill: 3 tokens at depth 5 in chunks of 2: median "))
        .unwrap_or_else(|| panic!("no prefill line in {prefill}"));
    assert!(
        line.ends_with(&format!("last logits fingerprint {}", all[7].1)),
        "{line} against step 7 of {plain}"
    );
}
