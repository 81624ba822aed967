//! Speculation's counts agree wherever they are shown: a request's log line says how many
//! drafted tokens it accepted in how many verify passes, and `/metrics` counts the same. The
//! log line used to be written as the request ended, inside its last verify pass and before
//! that pass was counted, so it fell one pass (and its drafts) short of `/metrics`.

use serde_json::json;

use crate::e2e::{free_port, request, start_exactly};

/// `k3_spec_drafted_tokens_total`, `k3_spec_accepted_tokens_total` and `k3_spec_passes_total`.
fn spec_metrics(port: u16) -> [u64; 3] {
    let (status, text) = request(port, "GET", "/metrics", None).unwrap();
    assert_eq!(status, 200, "{text}");
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    [
        value("k3_spec_drafted_tokens_total"),
        value("k3_spec_accepted_tokens_total"),
        value("k3_spec_passes_total"),
    ]
}

#[test]
fn a_requests_log_line_counts_what_metrics_count() {
    let log = std::env::temp_dir().join(format!("k3-serve-spec-log-{}.log", std::process::id()));
    let port = free_port();
    let args: Vec<std::ffi::OsString> = [
        "--serve",
        "--port",
        &port.to_string(),
        "--threads",
        "1",
        "--spec",
        "ngram",
        "--prompt-cache-gb",
        "0",
    ]
    .iter()
    .map(Into::into)
    .chain(["--model".into(), crate::tiny().into()])
    .collect();
    let server = start_exactly(&args, &[], port, Some(&log));
    // A prompt that repeats itself; sent twice, the second answer drafts from the first's
    // output (the earlier answers' cache) and from itself.
    let block: Vec<String> = (0..30)
        .map(|i| format!("alpha{i} beta gamma delta{}", i % 7))
        .collect();
    let block = block.join(" ");
    let prompt = format!("Copy: {block}\nCopy: {}", &block[..200]);
    let body = json!({"prompt": prompt, "max_tokens": 600, "temperature": 0}).to_string();
    let mut drafted_any = false;
    for round in 0..2 {
        let before = spec_metrics(server.port);
        let (status, text) = request(server.port, "POST", "/v1/completions", Some(&body)).unwrap();
        assert_eq!(status, 200, "{text}");
        let after = spec_metrics(server.port);
        let delta: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        // The log line is written before the answer goes out.
        let lines = std::fs::read_to_string(&log).unwrap();
        let line = lines
            .lines()
            .filter(|l| l.contains("output tokens"))
            .nth(round)
            .unwrap_or_else(|| panic!("round {round}: no log line in {lines}"));
        let logged = match line.split_once("speculation: ") {
            Some((_, s)) => {
                let numbers: Vec<u64> = s
                    .split(|c: char| !c.is_ascii_digit())
                    .filter(|w| !w.is_empty())
                    .map(|w| w.parse().unwrap())
                    .collect();
                // "A/D drafted tokens accepted in P verify passes"
                vec![numbers[1], numbers[0], numbers[2]]
            }
            None => vec![0, 0, 0],
        };
        assert_eq!(delta, logged, "round {round}: {line}");
        drafted_any |= delta[0] > 0;
    }
    assert!(
        drafted_any,
        "nothing was drafted: the check had nothing to compare"
    );
    drop(server);
    let _ = std::fs::remove_file(&log);
}
