//! The binary on a loopback port, driven by a plain HTTP/1.1 client over `TcpStream`: eight
//! concurrent streaming chats, each the same as when run alone (batch invariance), and a
//! client that disconnects mid-stream frees its slot.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_k3-serve"))
        .args(["--model"])
        .arg(crate::tiny())
        .args([
            "--serve",
            "--port",
            &port.to_string(),
            "--max-batch",
            "8",
            "--threads",
            "2",
            "--ctx",
            "8192",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server { child, port };
    let start = Instant::now();
    loop {
        if let Ok((200, _)) = request(port, "GET", "/health", None) {
            return server;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One request; returns the status and the whole body (chunked bodies de-chunked).
fn request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if line
            .to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
        {
            chunked = true;
        }
    }
    let mut text = String::new();
    if chunked {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            text.push_str(&String::from_utf8_lossy(&chunk[..n]));
        }
    } else {
        reader.read_to_string(&mut text)?;
    }
    Ok((status, text))
}

/// A streamed chat: checks the SSE framing and returns the concatenated text.
fn stream_chat(port: u16, seed: u64) -> String {
    let body = json!({"messages": [{"role": "user", "content": format!("Story number {seed}")}],
                      "stream": true, "max_tokens": 24, "temperature": 0.9, "seed": seed});
    let (status, text) = request(
        port,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(
        data.last(),
        Some(&"[DONE]"),
        "stream {seed} did not end with [DONE]:\n{text}"
    );
    let mut out = String::new();
    for chunk in &data[..data.len() - 1] {
        let v: Value =
            serde_json::from_str(chunk).unwrap_or_else(|e| panic!("bad chunk {chunk:?}: {e}"));
        assert_eq!(v["object"], "chat.completion.chunk");
        let delta = &v["choices"][0]["delta"];
        for field in ["reasoning_content", "content"] {
            if let Some(t) = delta[field].as_str() {
                out.push_str(t);
            }
        }
    }
    assert!(
        data[data.len() - 2].contains("finish_reason\":\"length")
            || data[data.len() - 2].contains("finish_reason\":\"stop"),
        "{}",
        data[data.len() - 2]
    );
    out
}

fn metric(port: u16, name: &str) -> f64 {
    let (_, text) = request(port, "GET", "/metrics", None).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[test]
fn eight_concurrent_streams_match_their_solo_runs_and_a_disconnect_frees_its_slot() {
    let server = start();
    let port = server.port;
    let alone: Vec<String> = (1..=8).map(|seed| stream_chat(port, seed)).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=8)
            .map(|seed| s.spawn(move || stream_chat(port, seed)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        together, alone,
        "a sequence's output depends on who shared its batch"
    );
    assert!(alone.iter().any(|t| !t.is_empty()));

    // A client that reads a little and hangs up: its sequence leaves the batch.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Long"}], "stream": true, "max_tokens": 6000}).to_string();
    write!(stream, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut first = [0u8; 256];
    let _ = stream.read(&mut first).unwrap();
    let start = Instant::now();
    while metric(port, "k3_active_sequences") < 1.0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(stream);
    let start = Instant::now();
    while metric(port, "k3_active_sequences") != 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the disconnected stream kept its slot"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let generated = metric(port, "k3_generated_tokens_total");
    assert!(
        generated < 16.0 * 24.0 + 5000.0,
        "the abandoned stream ran to its end ({generated} tokens)"
    );
}

/// PyPI's `openai` client (a venv made by `tests/openai/setup_venv.sh`, pinned) completes a
/// streamed chat against the running server. Where the venv cannot be made (no python3, no
/// package index), the test says why and returns.
#[test]
fn the_openai_python_client_streams_a_chat() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = manifest.join("../../target/openai-venv");
    let setup = Command::new("bash")
        .arg(manifest.join("tests/openai/setup_venv.sh"))
        .arg(&venv)
        .output();
    let python = match setup {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        Ok(out) => {
            eprintln!(
                "skipping: could not set up the openai venv: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        Err(e) => {
            eprintln!("skipping: bash not runnable: {e}");
            return;
        }
    };
    let server = start();
    let model = crate::tiny()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let out = Command::new(python)
        .arg(manifest.join("tests/openai/client.py"))
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(&model)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(report["chunks"].as_u64().unwrap() >= 2, "{report}");
    assert_eq!(report["models"][0], model.as_str());
}
