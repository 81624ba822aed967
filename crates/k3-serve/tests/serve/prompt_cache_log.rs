//! The binary's prompt cache flags: the budget is printed at startup (by default a tenth of
//! the memory budget) and `--prompt-cache-gb 0` turns the cache off; with
//! `--prompt-cache-dir`, a snapshot file with a flipped byte is ignored with a warning on
//! stderr (the log) naming the file, and the request is answered as cold.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::e2e::{free_port, post_chat, start_exactly};

/// A greedy chat turn on `port`: the answer's body.
fn turn(port: u16) -> Value {
    let body = json!({"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a prompt cache?"}],
        "max_tokens": 6, "temperature": 0});
    serde_json::from_str(&post_chat(port, &body, "turn")).unwrap()
}

/// The server on `tiny` with `extra` flags, its stderr into `log`.
fn start_logged(extra: &[&str], log: &std::path::Path) -> crate::e2e::Server {
    let port = free_port();
    let mut args: Vec<std::ffi::OsString> = vec!["--model".into(), crate::tiny().into()];
    for arg in ["--serve", "--port", &port.to_string(), "--threads", "1"]
        .iter()
        .chain(extra)
    {
        args.push(arg.into());
    }
    start_exactly(&args, &[], port, Some(log))
}

#[test]
fn the_budget_is_printed_at_startup_and_zero_turns_the_cache_off() {
    let log =
        std::env::temp_dir().join(format!("k3-serve-cache-budget-{}.log", std::process::id()));
    for (extra, on) in [(&[][..], true), (&["--prompt-cache-gb", "0"][..], false)] {
        let server = start_logged(extra, &log);
        let first = turn(server.port);
        let second = turn(server.port);
        drop(server);
        let stderr = std::fs::read_to_string(&log).unwrap();
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(second["choices"], first["choices"], "{extra:?}");
        if on {
            // The default: a tenth of the memory budget (1 GB where it cannot be read), in
            // GB as every size the startup log gives.
            let default = ["a tenth of the", "the memory budget is unknown"];
            assert!(
                stderr
                    .lines()
                    .any(|l| l.contains("GB of snapshots in memory (")
                        && default.iter().any(|d| l.contains(d))),
                "{stderr}"
            );
            assert!(
                !stderr.contains("GiB"),
                "one unit in the startup log: {stderr}"
            );
            // The repeated turn resumes from its system block at least.
            assert!(cached > 0, "{second}");
        } else {
            assert!(
                stderr.contains("prompt cache off (--prompt-cache-gb 0)"),
                "{stderr}"
            );
            assert_eq!(cached, 0, "{second}");
        }
    }
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_corrupt_snapshot_file_is_ignored_with_a_warning_on_stderr() {
    let scratch = std::env::temp_dir().join(format!("k3-serve-cache-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let dir = scratch.join("cache");
    let log = scratch.join("stderr.log");
    std::fs::create_dir_all(&scratch).unwrap();
    let dir_arg = dir.to_str().unwrap();
    let start = || {
        start_logged(
            &["--prompt-cache-gb", "1", "--prompt-cache-dir", dir_arg],
            &log,
        )
    };
    let first = {
        let server = start();
        turn(server.port)
    };
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "k3state"))
        .collect();
    assert!(!files.is_empty(), "nothing was spilled");
    for path in &files {
        let mut bytes = std::fs::read(path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(path, bytes).unwrap();
    }
    let server = start();
    let again = turn(server.port);
    drop(server);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{again}"
    );
    assert_eq!(again["choices"], first["choices"]);
    let stderr = std::fs::read_to_string(&log).unwrap();
    let warned: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("prompt cache: ignoring"))
        .collect();
    assert!(
        warned
            .iter()
            .any(|l| l.contains("checksum")
                && files.iter().any(|p| l.contains(&*p.to_string_lossy()))),
        "no warning naming a corrupt file:\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}
