//! The first example of docs/SERVING.md and of docs/MEMORY.md, and the README's first command,
//! run as the pages give them: the page's first `sh` block is read, `cargo run --release -p
//! k3-serve --` becomes this test's binary, `--model` is a fresh `tiny` checkpoint where the
//! example names none (the default the README's first command makes), and what the page says
//! you see is checked. A block that changes shape fails the test rather than being skipped.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k3_cli::{args_after, first_sh_block, shell_words};
use serde_json::Value;

use crate::e2e::{free_port, request, run_captured, start_exactly};

const SERVING: &str = include_str!("../../../../docs/SERVING.md");
const MEMORY: &str = include_str!("../../../../docs/MEMORY.md");
const README: &str = include_str!("../../../../README.md");

/// How the pages run the binary.
const CARGO_RUN: &str = "cargo run --release -p k3-serve --";

/// A fresh directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "k3-serve-docs-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh `tiny` checkpoint in a directory named `tiny`, as the README's first command makes
/// it in `~/.cache/k3/tiny` (so it is served as `tiny`).
struct Tiny {
    scratch: Scratch,
}

impl Tiny {
    fn new() -> Self {
        let scratch = Scratch::new();
        let options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
        k3_model::synth::generate(&scratch.0.join("tiny"), &options).unwrap();
        Self { scratch }
    }

    fn path(&self) -> PathBuf {
        self.scratch.0.join("tiny")
    }
}

/// The example's arguments to k3-serve, with `--model` added where it names none.
fn k3_serve_args(command: &str, model: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = args_after(command, CARGO_RUN)
        .into_iter()
        .map(OsString::from)
        .collect();
    if !args.iter().any(|a| a == "--model" || a == "-m") {
        args.extend(["--model".into(), model.into()]);
    }
    args
}

/// What a one-shot run generated: stdout (the answer), and stderr from `[reasoning]` to the
/// timing line (the reasoning and the marks), without the log lines before it or after it
/// (the engine thread may log that it saved the expert usage as the process ends).
fn generated(stdout: &str, stderr: &str) -> (String, String) {
    let from = stderr
        .find("[reasoning]")
        .unwrap_or_else(|| panic!("no [reasoning] mark in {stderr}"));
    let mut lines: Vec<&str> = stderr[from..].lines().collect();
    while lines.last().is_some_and(|l| l.starts_with("[INFO ")) {
        lines.pop();
    }
    let timing = lines.pop().unwrap_or_default();
    assert!(timing.contains(" tokens ("), "no timing line: {timing:?}");
    (stdout.to_owned(), lines.join("\n"))
}

/// `text` with every number (digits and points) as `#`, to compare a line's shape.
fn shape(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() || c == '.' {
            if !out.ends_with('#') {
                out.push('#');
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// docs/SERVING.md: the server started as the page starts it, and the page's curl request
/// answered as it says: SSE chunks of reasoning, a last chunk that ran out of tokens, and
/// `[DONE]`; the log names the model and the address as the page quotes them.
#[test]
fn serving_md_first_example_serves_the_request_it_shows() {
    let commands = first_sh_block(SERVING);
    assert_eq!(
        commands.len(),
        2,
        "SERVING.md opens with the server and one curl: {commands:?}"
    );
    let server = commands[0].strip_suffix(" &").unwrap_or_else(|| {
        panic!(
            "{:?} should start the server in the background",
            commands[0]
        )
    });
    let tiny = Tiny::new();
    let mut args = k3_serve_args(server, &tiny.path());
    // The page's port, here one that is free.
    let at = args
        .iter()
        .position(|a| a == "--port")
        .expect("the example gives --port");
    assert_eq!(args[at + 1], "8000");
    let port = free_port();
    args[at + 1] = port.to_string().into();

    let curl = shell_words(&commands[1]);
    assert_eq!(
        curl[..5],
        [
            "curl",
            "-s",
            "localhost:8000/v1/chat/completions",
            "-H",
            "content-type: application/json"
        ],
        "the curl line changed shape: {curl:?}"
    );
    assert_eq!(curl[5], "-d");
    assert_eq!(curl.len(), 7, "{curl:?}");
    let body: Value = serde_json::from_str(&curl[6]).expect("the example's body is JSON");
    assert_eq!(body["stream"], true);
    let max_tokens = body["max_tokens"].as_u64().expect("max_tokens");

    let log = tiny.path().with_file_name("server.log");
    let server = start_exactly(&args, &[], port, Some(&log));
    let (status, text) =
        request(server.port, "POST", "/v1/chat/completions", Some(&curl[6])).unwrap();
    assert_eq!(status, 200, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut reasoning = 0;
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        assert_eq!(chunk["model"], "tiny", "{chunk}");
        reasoning += usize::from(chunk["choices"][0]["delta"]["reasoning_content"].is_string());
    }
    assert!(
        (1..=max_tokens as usize).contains(&reasoning),
        "{reasoning} reasoning_content deltas for max_tokens {max_tokens}: {text}"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");

    // The log line the page quotes, at the page's port there and this test's here.
    let quoted = "serving \"tiny\" on http://127.0.0.1:8000";
    assert!(
        SERVING.contains(&format!("`{quoted}`")),
        "the page quotes {quoted:?}"
    );
    drop(server);
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains(&quoted.replace("8000", &port.to_string())),
        "{logged}"
    );
}

/// docs/MEMORY.md: the one-shot run under the page's `--memory-gb` prints a memory plan of the
/// shape the page quotes, streams part of the trunk, and generates what the run without a
/// limit generates.
#[test]
fn memory_md_first_example_streams_and_gives_the_same_tokens() {
    let commands = first_sh_block(MEMORY);
    assert_eq!(commands.len(), 1, "{commands:?}");
    let tiny = Tiny::new();
    let args = k3_serve_args(&commands[0], &tiny.path());
    let at = args
        .iter()
        .position(|a| a == "--memory-gb")
        .expect("the example gives --memory-gb");
    let budget: f64 = args[at + 1].to_str().unwrap().parse().unwrap();
    let os: Vec<&std::ffi::OsStr> = args.iter().map(OsString::as_os_str).collect();
    let limit = Duration::from_secs(300);
    let (status, stdout, stderr) = run_captured(&os, &[], limit);
    assert!(status.success(), "{stderr}");

    let plan = stderr
        .lines()
        .find_map(|l| l.split_once("memory plan: ").map(|(_, plan)| plan))
        .unwrap_or_else(|| panic!("no memory plan in {stderr}"));
    assert!(
        plan.starts_with(&format!("budget {budget:.4} GB (the memory limit given): ")),
        "{plan}"
    );
    let streamed: f64 = plan
        .split_once("trunk streamed ")
        .and_then(|(_, rest)| rest.split(' ').next())
        .and_then(|gb| gb.parse().ok())
        .unwrap_or_else(|| panic!("no trunk streamed in {plan}"));
    assert!(
        streamed > 0.0,
        "the example should stream the trunk: {plan}"
    );
    // The page quotes a plan of the same shape (its figures are a first run's, for example).
    let quoted = MEMORY
        .lines()
        .find_map(|l| l.split_once("memory plan: ").map(|(_, plan)| plan))
        .expect("MEMORY.md quotes a memory plan line");
    assert_eq!(
        shape(quoted),
        shape(plan),
        "MEMORY.md's quoted plan changed shape"
    );

    // The same tokens without the limit.
    let unlimited: Vec<&std::ffi::OsStr> = os
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != at && i != at + 1)
        .map(|(_, a)| *a)
        .collect();
    let (status, stdout_free, stderr_free) = run_captured(&unlimited, &[], limit);
    assert!(status.success(), "{stderr_free}");
    assert_eq!(
        generated(&stdout, &stderr),
        generated(&stdout_free, &stderr_free)
    );
}

/// README.md: its first command, with a home of its own, generates `tiny` into
/// `~/.cache/k3/tiny` and prints what the README shows: each line of its ```text block up to
/// where it is cut (` ...`), numbers aside, and the reasoning's tokens as quoted (on the SIMD
/// tiers, whose sums the quote comes from).
#[test]
fn the_readme_first_command_prints_what_the_readme_shows() {
    let commands = first_sh_block(README);
    let args: Vec<OsString> = args_after(&commands[0], CARGO_RUN)
        .into_iter()
        .map(OsString::from)
        .collect();
    let scratch = Scratch::new();
    let home = scratch.0.join("home");
    let cache = home.join(".cache");
    let os: Vec<&std::ffi::OsStr> = args.iter().map(OsString::as_os_str).collect();
    let (status, stdout, stderr) = run_captured(
        &os,
        &[
            ("HOME", home.to_str().unwrap()),
            ("XDG_CACHE_HOME", cache.to_str().unwrap()),
        ],
        Duration::from_secs(120),
    );
    assert!(status.success(), "{stderr}");
    let output = format!("{stdout}{stderr}");
    let shown = README
        .split_once("```text\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("the README shows the output in a ```text block");
    let scalar = output.contains("kernel tier scalar");
    for line in shown.lines() {
        let line = line.replace("/home/you", home.to_str().unwrap());
        let expected = line.split(" ...").next().unwrap();
        let found = if expected.starts_with('[') || expected.contains(" tokens (") || scalar {
            output.lines().any(|l| shape(l).contains(&shape(expected)))
        } else {
            output.lines().any(|l| l.starts_with(expected))
        };
        assert!(
            found,
            "the README shows {expected:?}; the run printed:\n{output}"
        );
    }
    assert!(shown.lines().count() >= 6, "{shown}");
}
