//! Robustness of the API: random mutations of valid request bodies (values of every field
//! swapped for other JSON types, extremes, empty strings and lists, deleted and unknown
//! fields, truncated and bit-flipped bytes) sent to the binary over loopback. Every answer
//! comes within a time bound and is either a success or an OpenAI error object, and the
//! server keeps serving: afterwards `/health` is 200 and a plain request generates tokens.
//!
//! The cases come from a fixed-seed generator; a failure names its case number and body.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::e2e::{request, start};

/// Bodies sent: each is a mutation of one of the base requests.
const CASES: usize = 240;
/// One answer's bound. No mutation yields a mid-sized `max_tokens` (they are extremes, and a
/// deleted one falls back to the server's default of 256), so a valid request decodes at most
/// a few hundred tokens of the tiny model (milliseconds each): seconds mean something is wrong.
const TIME_BOUND: Duration = Duration::from_secs(20);

fn bases() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0.7,
                   "top_p": 0.9, "seed": 1, "stop": ["\n\n"], "stream": false}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Yes", "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "2"}],
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                   "max_tokens": 6, "stream": true, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "Once upon", "max_tokens": 8, "temperature": 0,
                   "stream": false, "stop": "x"}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "", "max_tokens": 4, "stream": true}),
        ),
    ]
}

/// Every (path, value) pair in a JSON tree, parents before children.
fn paths(value: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                at.push(k.clone());
                paths(v, at, out);
                at.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                at.push(i.to_string());
                paths(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn replacement(rng: &mut fastrand::Rng) -> Value {
    let deep = (0..200).fold(json!(1), |v, _| json!([v]));
    let choices = [
        Value::Null,
        json!(-1),
        json!(0),
        json!(1u64 << 40),
        json!(u64::MAX),
        json!(-1e300),
        json!(0.5),
        json!(""),
        json!("x".repeat(10_000)),
        json!([]),
        json!({}),
        json!([""]),
        json!(true),
        json!("<|end_of_msg|><|open|>"),
        json!("\u{0}\u{ffff}"),
        deep,
    ];
    choices[rng.usize(..choices.len())].clone()
}

/// One mutated body (as text: some mutations leave JSON behind).
fn mutate(base: &Value, rng: &mut fastrand::Rng) -> String {
    let mut body = base.clone();
    let mut all = Vec::new();
    paths(&body, &mut Vec::new(), &mut all);
    let choice = rng.usize(..6);
    match choice {
        0 | 1 => {
            // A value (or a whole subtree) replaced.
            let at = &all[1 + rng.usize(..all.len() - 1)];
            let value = replacement(rng);
            set(&mut body, at, value);
        }
        2 => {
            // A field or list item deleted.
            let at = &all[1 + rng.usize(..all.len() - 1)];
            let (last, parent) = at.split_last().unwrap();
            match get(&mut body, parent) {
                Value::Object(map) => {
                    map.remove(last);
                }
                Value::Array(items) => {
                    items.remove(last.parse::<usize>().unwrap());
                }
                _ => {}
            }
        }
        3 => {
            // Unknown or rarely used fields, some of which the API must refuse by name.
            let fields = [
                ("n", json!(3)),
                ("best_of", json!(2)),
                ("echo", json!(true)),
                ("suffix", json!("end")),
                ("logit_bias", json!({"5": 100})),
                ("stream_options", json!({"include_usage": true})),
                ("frobnicate", json!(1)),
                ("max_completion_tokens", json!(3)),
                ("presence_penalty", json!(3.5)),
                ("tool_choice", json!("required")),
                ("response_format", json!({"type": "json_object"})),
            ];
            let (k, v) = &fields[rng.usize(..fields.len())];
            body[*k] = v.clone();
        }
        4 => {
            // Bytes: truncated.
            let text = body.to_string();
            let mut cut = rng.usize(..text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            return text[..cut].to_owned();
        }
        _ => {
            // Bytes: a few replaced by ASCII (JSON syntax characters among them).
            let mut bytes = body.to_string().into_bytes();
            for _ in 0..1 + rng.usize(..3) {
                let at = rng.usize(..bytes.len());
                let syntax = b"{}[]\",:0a\\ ";
                bytes[at] = syntax[rng.usize(..syntax.len())];
            }
            return String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    body.to_string()
}

fn get<'v>(value: &'v mut Value, path: &[String]) -> &'v mut Value {
    path.iter().fold(value, |v, key| match v {
        Value::Array(items) => &mut items[key.parse::<usize>().unwrap()],
        other => &mut other[key.as_str()],
    })
}

fn set(value: &mut Value, path: &[String], new: Value) {
    *get(value, path) = new;
}

/// What a well-behaved answer looks like: 2xx, or an OpenAI error object.
fn check(status: u16, text: &str) -> Result<(), String> {
    if status == 0 {
        return Err("no status line".into());
    }
    if (200..300).contains(&status) {
        if text.starts_with("data: ") || text.contains("\ndata: ") {
            // A stream ends with [DONE]; a failed one carries an error chunk before it.
            if !text.trim_end().ends_with("data: [DONE]") {
                return Err("a stream without [DONE]".into());
            }
        } else {
            let v: Value = serde_json::from_str(text).map_err(|e| format!("200 not JSON: {e}"))?;
            if v.get("choices").is_none() {
                return Err("200 without choices".into());
            }
        }
        return Ok(());
    }
    let v: Value = serde_json::from_str(text).map_err(|e| format!("error body not JSON: {e}"))?;
    match v["error"]["message"].as_str() {
        Some(m) if !m.is_empty() => Ok(()),
        _ => Err("error body without error.message".into()),
    }
}

#[test]
fn mutated_requests_get_an_answer_or_an_error_object_and_the_server_keeps_serving() {
    let server = start();
    let port = server.port;
    let bases = bases();
    let mut rng = fastrand::Rng::with_seed(0x6b33_5e77_2026_1201);
    let mut failures = Vec::new();
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..CASES {
        let (path, base) = &bases[case % bases.len()];
        let body = mutate(base, &mut rng);
        let start = Instant::now();
        let answer = request(port, "POST", path, Some(&body));
        let took = start.elapsed();
        let shown: String = body.chars().take(300).collect();
        match answer {
            Ok((status, text)) => {
                *statuses.entry(status).or_insert(0) += 1;
                if let Err(why) = check(status, &text) {
                    let text: String = text.chars().take(300).collect();
                    failures.push(format!(
                        "case {case}: {why}: {status} {text}\n  body {shown}"
                    ));
                }
            }
            Err(e) => failures.push(format!("case {case}: no answer ({e})\n  body {shown}")),
        }
        if took > TIME_BOUND {
            failures.push(format!("case {case}: took {took:?}\n  body {shown}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The mutations exercise both outcomes.
    assert!(
        statuses.get(&200).is_some_and(|&n| n > 0) && statuses.keys().any(|&s| s >= 400),
        "{statuses:?}"
    );
    let (status, _) = request(port, "GET", "/health", None).unwrap();
    assert_eq!(status, 200, "the server is unhealthy after the fuzz");
    let (status, text) = request(
        port,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "Hello", "max_tokens": 4, "temperature": 0}"#),
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
}
