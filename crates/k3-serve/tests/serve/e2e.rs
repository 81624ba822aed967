//! The binary on a loopback port, driven by a plain HTTP/1.1 client over `TcpStream`: eight
//! concurrent streaming chats, each the same as when run alone (batch invariance), and a
//! client that disconnects mid-stream frees its slot; a model that fails to load ends the
//! process; huge prompts and slow, idle or too many connections do not hold the server up.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        if ranks() > 1 {
            // mpirun passes SIGTERM on to every rank; a SIGKILL would orphan them.
            // SAFETY: kill(2) on our own child's pid; no memory is involved.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ranks each test server runs as: `K3_SERVE_TEST_RANKS=N` (with the `mpi` feature) starts
/// every server under `mpirun -np N`, so this same suite checks the server over MPI; else 1.
pub(crate) fn ranks() -> usize {
    std::env::var("K3_SERVE_TEST_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// The pid of the server's rank 0: the child itself, or under mpirun the child of mpirun that
/// MPI started as rank 0.
pub(crate) fn leader_pid(server: &Server) -> i32 {
    let mpirun = i32::try_from(server.child.id()).unwrap();
    if ranks() <= 1 {
        return mpirun;
    }
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // "pid (comm) state ppid ...": the fields after the last ')'.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if parent != Some(mpirun) {
            continue;
        }
        let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if env
            .split(|&b| b == 0)
            .any(|v| v == b"OMPI_COMM_WORLD_RANK=0")
        {
            return pid;
        }
    }
    panic!("no rank 0 among mpirun's children");
}

/// The k3-serve command: the binary, or under `mpirun` when [`ranks`] says so.
pub(crate) fn k3_serve() -> Command {
    match ranks() {
        0 | 1 => Command::new(env!("CARGO_BIN_EXE_k3-serve")),
        n => {
            let mut c = Command::new("mpirun");
            c.args([
                "--oversubscribe",
                "--allow-run-as-root",
                "-np",
                &n.to_string(),
            ])
            .arg(env!("CARGO_BIN_EXE_k3-serve"));
            c
        }
    }
}

pub(crate) fn start() -> Server {
    start_with(&[])
}

/// A port free on loopback now.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The server on the tiny checkpoint with `extra` flags.
pub(crate) fn start_with(extra: &[&str]) -> Server {
    let port = free_port();
    let mut args: Vec<std::ffi::OsString> = vec!["--model".into(), crate::tiny().into()];
    for arg in [
        "--serve",
        "--port",
        &port.to_string(),
        "--max-batch",
        "8",
        "--threads",
        "2",
        "--ctx",
        "4096",
    ]
    .iter()
    .chain(extra)
    {
        args.push(arg.into());
    }
    start_exactly(&args, &[], port, None)
}

/// The binary with exactly `args` and the environment variables `env` (which must make it
/// serve on `port`), once `/health` says it is up; its stderr (the log) into `log` if given.
pub(crate) fn start_exactly(
    args: &[std::ffi::OsString],
    env: &[(&str, &str)],
    port: u16,
    log: Option<&std::path::Path>,
) -> Server {
    let stderr = match log {
        Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
        None => Stdio::null(),
    };
    let child = k3_serve()
        .args(args)
        .env_remove("K3_API_KEY")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(stderr)
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
pub(crate) fn request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    request_with(port, method, path, body, &[])
}

/// A chat completion of `body` on `port` that must answer 200: its body (`label` names the
/// case in the failure message).
pub(crate) fn post_chat(port: u16, body: &Value, label: &str) -> String {
    let (status, text) = request(
        port,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{label}: {text}");
    text
}

/// [`request`] with extra header lines (`"Authorization: Bearer k"`).
pub(crate) fn request_with(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[&str],
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{body}",
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
    let text = post_chat(port, &body, "stream");
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

pub(crate) fn metric(port: u16, name: &str) -> f64 {
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
    let body = json!({"messages": [{"role": "user", "content": "Long"}], "stream": true, "max_tokens": 4000}).to_string();
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
        generated < 16.0 * 24.0 + 2000.0,
        "the abandoned stream ran to its end ({generated} tokens)"
    );
}

/// The venv's python with PyPI's `openai` client (made by `tests/openai/setup_venv.sh`,
/// pinned), or `None` (said why) where it cannot be made: no python3, no package index.
fn openai_python() -> Option<String> {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = manifest.join("../../target/openai-venv");
    let setup = Command::new("bash")
        .arg(manifest.join("tests/openai/setup_venv.sh"))
        .arg(&venv)
        .output();
    match setup {
        Ok(out) if out.status.success() => {
            Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        Ok(out) => {
            eprintln!(
                "skipping: could not set up the openai venv: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            None
        }
        Err(e) => {
            eprintln!("skipping: bash not runnable: {e}");
            None
        }
    }
}

/// Runs `tests/openai/SCRIPT BASE_URL MODEL` with the venv's python against a fresh server on
/// the tiny model: the JSON line it printed, and the model's name. `None` (said why) where
/// the venv cannot be made. The script exits non-zero when what it checks fails.
fn run_openai_script(script: &str) -> Option<(Value, String)> {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = openai_python()?;
    let server = start();
    let model = crate::tiny()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let out = Command::new(python)
        .arg(manifest.join("tests/openai").join(script))
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(&model)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some((serde_json::from_str(stdout.trim()).unwrap(), model))
}

/// The `openai` client's structured outputs against the running server
/// (`tests/openai/structured.py`): `client.beta.chat.completions.parse` with a Pydantic model,
/// and a forced tool call through `tools`/`tool_choice`, each answer parsed and checked.
#[test]
fn the_openai_python_client_parses_structured_outputs() {
    let Some((report, _)) = run_openai_script("structured.py") else {
        return;
    };
    assert_eq!(
        report["parsed"].as_array().map(Vec::len),
        Some(3),
        "{report}"
    );
    for call in report["calls"].as_array().unwrap() {
        assert_eq!(call["name"], "move", "{report}");
        assert!(
            matches!(call["arguments"]["direction"].as_str(), Some("up" | "down")),
            "{report}"
        );
    }
}

/// PyPI's `openai` client (a venv made by `tests/openai/setup_venv.sh`, pinned) completes a
/// streamed chat against the running server. Where the venv cannot be made (no python3, no
/// package index), the test says why and returns.
#[test]
fn the_openai_python_client_streams_a_chat() {
    let Some((report, model)) = run_openai_script("client.py") else {
        return;
    };
    assert!(report["chunks"].as_u64().unwrap() >= 2, "{report}");
    assert_eq!(report["models"][0], model.as_str());
    // client.py exits non-zero unless these hold; checked here too so a report shows them.
    let off = &report["thinking_off"];
    assert!(
        off["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{report}"
    );
    assert!(off["reasoning_content"].is_null(), "{report}");
    let on = &report["thinking_on"];
    assert!(
        on["reasoning_content"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{report}"
    );
}

/// Runs the binary with `args` and waits at most `limit` for it to exit: its status and stderr.
pub(crate) fn run_to_exit(
    args: &[&std::ffi::OsStr],
    limit: Duration,
) -> (std::process::ExitStatus, String) {
    let (status, _, stderr) = run_captured(args, &[], limit);
    (status, stderr)
}

/// Runs the binary with `args` and the environment variables `env`, waiting at most `limit`
/// for it to exit: its status, stdout and stderr (each read on its own thread, so neither
/// pipe can fill and stall the child).
pub(crate) fn run_captured(
    args: &[&std::ffi::OsStr],
    env: &[(&str, &str)],
    limit: Duration,
) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3-serve"))
        .args(args)
        .env_remove("K3_API_KEY")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, stdout.join().unwrap(), stderr.join().unwrap());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("k3-serve {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Finding 2: a damaged checkpoint (a shard cut to half) ends the process with the reason,
/// within 10 s, one-shot and serving; so does a --ctx beyond max_position_embeddings.
#[test]
fn a_model_that_cannot_load_ends_the_process() {
    let dir = crate::router::damaged_copy("e2e-damaged");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let port = port.to_string();
    for mode in [&["--prompt", "hi"][..], &["--serve", "--port", &port]] {
        let mut args = vec![std::ffi::OsStr::new("--model"), dir.as_os_str()];
        args.extend(mode.iter().map(std::ffi::OsStr::new));
        let (status, stderr) = run_to_exit(&args, Duration::from_secs(10));
        assert!(!status.success(), "{mode:?}: {stderr}");
        assert!(
            stderr.contains("did not load") && stderr.contains(".safetensors"),
            "{mode:?}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let tiny = crate::tiny();
    let args: Vec<&std::ffi::OsStr> = vec![
        "--model".as_ref(),
        tiny.as_os_str(),
        "--serve".as_ref(),
        "--port".as_ref(),
        port.as_ref(),
        "--ctx".as_ref(),
        "5000".as_ref(),
    ];
    let (status, stderr) = run_to_exit(&args, Duration::from_secs(10));
    assert!(!status.success());
    assert!(
        stderr.contains("5000") && stderr.contains("4096"),
        "{stderr}"
    );
}

/// Median of five `/health` round trips on fresh connections.
fn health_latency(port: u16) -> Duration {
    let mut times: Vec<Duration> = (0..5)
        .map(|_| {
            let start = Instant::now();
            let (status, text) = request(port, "GET", "/health", None).unwrap();
            assert_eq!(status, 200, "{text}");
            start.elapsed()
        })
        .collect();
    times.sort();
    times[2]
}

/// Finding 3: a 3.9 MB prompt of one long piece is refused (400) within a second, on its byte
/// length, and `/health` stays quick while two of them are in flight.
#[test]
fn a_huge_prompt_is_refused_quickly_and_health_stays_quick() {
    let server = start();
    let port = server.port;
    let body = json!({"prompt": "er".repeat(1_950_000), "max_tokens": 4}).to_string();
    let chat =
        json!({"messages": [{"role": "user", "content": "er".repeat(1_950_000)}], "max_tokens": 4})
            .to_string();
    std::thread::scope(|s| {
        let huge = [
            s.spawn(|| {
                let start = Instant::now();
                (
                    request(port, "POST", "/v1/completions", Some(&body)).unwrap(),
                    start.elapsed(),
                )
            }),
            s.spawn(|| {
                let start = Instant::now();
                (
                    request(port, "POST", "/v1/chat/completions", Some(&chat)).unwrap(),
                    start.elapsed(),
                )
            }),
        ];
        let latency = health_latency(port);
        assert!(
            latency < Duration::from_millis(100),
            "/health took {latency:?}"
        );
        for h in huge {
            let ((status, text), elapsed) = h.join().unwrap();
            assert_eq!(status, 400, "{}", &text[..text.len().min(300)]);
            assert!(text.contains("exceeds the context"), "{text}");
            assert!(elapsed < Duration::from_secs(1), "answered in {elapsed:?}");
        }
    });
}

/// Reads until the server closes the connection (or `limit` passes): how long that took.
fn time_to_close(stream: &mut TcpStream, limit: Duration) -> Duration {
    stream.set_read_timeout(Some(limit)).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return start.elapsed(),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return start.elapsed(),
            Err(e) => panic!("not closed within {limit:?}: {e}"),
        }
    }
}

/// Finding 4: a slow head is cut off at the header timeout, an idle kept-alive connection at
/// the idle timeout, a slow body gets 408; a stream longer than the idle timeout is not cut.
#[test]
fn slow_and_idle_connections_are_closed_on_their_deadlines() {
    let server = start_with(&[
        "--header-timeout-s",
        "1",
        "--idle-timeout-s",
        "1.5",
        "--body-timeout-s",
        "1",
    ]);
    let port = server.port;
    // A head that never ends.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(slow, "GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let closed = time_to_close(&mut slow, Duration::from_secs(5));
    assert!(
        closed < Duration::from_millis(1800),
        "closed after {closed:?}"
    );
    // Nothing at all after the accept: the same deadline.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let closed = time_to_close(&mut silent, Duration::from_secs(5));
    assert!(
        closed < Duration::from_millis(1800),
        "closed after {closed:?}"
    );
    // A kept-alive connection after its answer: closed when idle, not at the header deadline.
    let mut idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reader = BufReader::new(idle.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("200"), "{line}");
    let closed = time_to_close(&mut idle, Duration::from_secs(5));
    assert!(
        closed > Duration::from_millis(1200) && closed < Duration::from_millis(2300),
        "idle connection closed after {closed:?}"
    );
    // A body that stops halfway: 408 with the error object.
    let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(half, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\"").unwrap();
    let mut answer = String::new();
    half.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let start = Instant::now();
    let _ = half.read_to_string(&mut answer);
    assert!(start.elapsed() < Duration::from_millis(1800));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("\"error\"") && answer.contains("did not arrive"),
        "{answer}"
    );
    // A stream that outlasts the idle timeout runs to its end.
    let body = json!({"prompt": "Long", "stream": true, "max_tokens": 3000}).to_string();
    let start = Instant::now();
    let (status, text) = request(port, "POST", "/v1/completions", Some(&body)).unwrap();
    assert_eq!(status, 200);
    assert_eq!(sse_last(&text), "[DONE]", "the stream was cut");
    eprintln!("stream of 3000 tokens took {:?}", start.elapsed());
}

fn sse_last(text: &str) -> &str {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .unwrap_or("")
}

/// Finding 4: 2,000 half-open connections do not stop `/health`, and over the connection cap
/// a client gets a 503 with the error object at once.
#[test]
fn half_open_connections_do_not_stop_health() {
    let server = start_with(&["--header-timeout-s", "30"]);
    let port = server.port;
    let half_open: Vec<TcpStream> = (0..2000)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(s, "GET /health HTTP/1.1\r\nHo").unwrap();
            s
        })
        .collect();
    let latency = health_latency(port);
    assert!(
        latency < Duration::from_millis(100),
        "/health took {latency:?}"
    );
    drop(half_open);
    drop(server);

    // A header deadline long enough that the 8 slots stay taken while a loaded machine gets
    // round to accepting them all (the accept loop may lag the connects: poll for the 503).
    // 10 s: at 3 s a CI run with every test binary's servers on 2 cores once saw the slots
    // freed by the deadline before the first poll was answered.
    let server = start_with(&["--max-connections", "8", "--header-timeout-s", "10"]);
    let port = server.port;
    let half_open: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(s, "GET /health HTTP/1.1\r\nHo").unwrap();
            s
        })
        .collect();
    let held = Instant::now();
    let (status, text, answered_in) = loop {
        let start = Instant::now();
        let (status, text) = request(port, "GET", "/health", None).unwrap();
        if status == 503 || held.elapsed() > Duration::from_secs(8) {
            break (status, text, start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(answered_in < Duration::from_millis(500), "{answered_in:?}");
    assert_eq!(status, 503, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("8 connections"),
        "{text}"
    );
    // Their header deadline (10 s) frees the slots.
    let status = loop {
        let (status, _) = request(port, "GET", "/health", None).unwrap();
        if status == 200 || held.elapsed() > Duration::from_secs(30) {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status, 200, "the header deadline did not free the slots");
    drop(half_open);
}

/// SIGTERM while a stream runs: the stream is finished, new connections are refused, and the
/// process exits cleanly.
#[test]
fn sigterm_finishes_open_streams_then_exits() {
    let mut server = start();
    let port = server.port;
    let body = json!({"prompt": "Long", "stream": true, "max_tokens": 400}).to_string();
    let streaming =
        std::thread::spawn(move || request(port, "POST", "/v1/completions", Some(&body)).unwrap());
    let start = Instant::now();
    while metric(port, "k3_active_sequences") < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the stream did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Under mpirun the signal goes to rank 0, which leads the shutdown (mpirun itself aborts
    // the job on a signal).
    let pid = leader_pid(&server);
    // SAFETY: kill(2) with a valid signal number on our own child's (or its rank 0's) pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (status, text) = streaming.join().unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        sse_last(&text),
        "[DONE]",
        "the stream was cut by the shutdown"
    );
    assert!(text.contains("finish_reason\":\"length") || text.contains("finish_reason\":\"stop"));
    let start = Instant::now();
    let exit = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// A completion's choice (text, log-probabilities with alternatives, finish reason).
fn completion_choice(port: u16, body: &Value) -> Value {
    let (status, text) = request(port, "POST", "/v1/completions", Some(&body.to_string())).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["choices"][0].clone()
}

/// `--spec ngram` answers exactly as `--spec off`, greedy and seeded at temperature 1, alone
/// and batched; verify passes happened (the prompt repeats a block, and the random model's
/// greedy output falls into loops the n-grams then predict). Under `K3_SERVE_TEST_RANKS=2`
/// (CI's MPI stage) both servers run as two ranks.
#[test]
fn speculation_answers_as_without_it() {
    let on = start_with(&["--spec", "ngram"]);
    let off = start_with(&["--spec", "off"]);
    let block = "for i in 0..n {\n    total += values[i] * weights[i];\n}\n";
    let bodies: Vec<Value> = [(0.0, 0), (1.0, 1), (1.0, 2), (0.0, 3)]
        .iter()
        .map(|&(temperature, seed)| {
            json!({"prompt": format!("Copy the loop twice:\n{block}{block}Copy {seed}:\n"),
                   "max_tokens": 48, "temperature": temperature, "seed": seed, "logprobs": 3})
        })
        .collect();
    let want: Vec<Value> = bodies
        .iter()
        .map(|b| completion_choice(off.port, b))
        .collect();
    for (body, want) in bodies.iter().zip(&want) {
        assert_eq!(&completion_choice(on.port, body), want, "{body}");
    }
    let port = on.port;
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || completion_choice(port, b)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, want, "batched");
    assert!(
        metric(on.port, "k3_spec_passes_total") > 0.0,
        "no verify pass"
    );
    assert!(
        metric(on.port, "k3_spec_accepted_tokens_total") > 0.0,
        "no draft accepted"
    );
    assert_eq!(metric(off.port, "k3_spec_passes_total"), 0.0);
}
