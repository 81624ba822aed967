//! The binary with `--prompt-cache-dir`: a snapshot file with a flipped byte is ignored with a
//! warning on stderr (the log) naming the file, and the request is answered as cold.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::e2e::{free_port, request, start_exactly};

/// A greedy chat turn on `port`: the answer's body.
fn turn(port: u16) -> Value {
    let body = json!({"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a prompt cache?"}],
        "max_tokens": 6, "temperature": 0});
    let (status, text) = request(
        port,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_corrupt_snapshot_file_is_ignored_with_a_warning_on_stderr() {
    let scratch = std::env::temp_dir().join(format!("k3-serve-cache-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let dir = scratch.join("cache");
    let log = scratch.join("stderr.log");
    std::fs::create_dir_all(&scratch).unwrap();
    let start = || {
        let port = free_port();
        let mut args: Vec<std::ffi::OsString> = vec!["--model".into(), crate::tiny().into()];
        for arg in ["--serve", "--port", &port.to_string(), "--threads", "1"] {
            args.push(arg.into());
        }
        args.extend(["--prompt-cache-gb".into(), "1".into()]);
        args.extend(["--prompt-cache-dir".into(), dir.clone().into()]);
        start_exactly(&args, &[], port, Some(&log))
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
