//! The admission queue over real sockets (issue 31.6): requests whose clients go away while
//! they wait leave the queue at once, so `k3_queue_depth` counts only live ones and the
//! engine never prefills an abandoned prompt. Before, 80 streams closed after 0.5 s left the
//! depth at 57 and the next request waited 3.8 s behind their prefills.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::e2e::{free_port, metric, request, start_exactly};

/// Sends `body` to `path` and leaves the connection open (the answer unread).
fn send(port: u16, path: &str, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

/// Waits until `metric` reads `value`, at most `limit`; returns how long it took.
fn wait_for(port: u16, name: &str, value: f64, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if metric(port, name) == value {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn requests_abandoned_in_the_queue_leave_it_at_once() {
    let port = free_port();
    let args: Vec<std::ffi::OsString> = vec![
        "--model".into(),
        crate::tiny().into(),
        "--serve".into(),
        "--port".into(),
        port.to_string().into(),
        "--max-batch".into(),
        "1".into(),
        "--queue".into(),
        "64".into(),
        "--threads".into(),
        "2".into(),
        "--ctx".into(),
        "4096".into(),
    ];
    let _server = start_exactly(&args, &[], port, None);
    // The one batch slot, held by a long stream whose end tokens are banned.
    let tokenizer = k3_model::tokenizer::Tokenizer::from_dir(&crate::tiny()).unwrap();
    let banned: serde_json::Map<String, Value> = ["[EOS]", "<|end_of_msg|>"]
        .iter()
        .filter_map(|s| tokenizer.special(s))
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let occupant = send(
        port,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 4000, "stream": true, "logit_bias": banned}),
    );
    let mut first_line = String::new();
    BufReader::new(occupant.try_clone().unwrap())
        .read_line(&mut first_line)
        .unwrap();
    assert!(first_line.contains("200"), "{first_line}");
    // 40 waiting requests, streamed and not.
    let waiting: Vec<TcpStream> = (0..40)
        .map(|i| {
            let chat = json!({"messages": [{"role": "user", "content": format!("Waiter {i}")}],
                              "max_tokens": 8, "stream": i % 2 == 0});
            send(port, "/v1/chat/completions", &chat)
        })
        .collect();
    assert!(
        wait_for(port, "k3_queue_depth", 40.0, Duration::from_secs(20)).is_some(),
        "the queue never held the 40: {}",
        metric(port, "k3_queue_depth")
    );
    let before = metric(port, "k3_requests_admitted_total");
    // Their clients go away.
    for stream in waiting {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    let took = wait_for(port, "k3_queue_depth", 0.0, Duration::from_secs(2));
    assert!(
        took.is_some(),
        "k3_queue_depth is {} 2 s after every waiting client left",
        metric(port, "k3_queue_depth")
    );
    // The slot's holder goes too; the next request is served at once, behind no prefill of
    // an abandoned prompt.
    drop(occupant);
    let start = Instant::now();
    let (status, text) = request(
        port,
        "POST",
        "/v1/chat/completions",
        Some(
            &json!({"messages": [{"role": "user", "content": "Next"}], "max_tokens": 4})
                .to_string(),
        ),
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let next = start.elapsed();
    // Admitted: the occupant and the next one, none of the 40.
    assert_eq!(metric(port, "k3_requests_admitted_total"), before + 1.0);
    assert!(
        next < Duration::from_secs(10),
        "the next request took {next:?}"
    );
}
