//! `/metrics`' `k3_requests_total{status}`: every HTTP answer counted by its status code, the
//! router's 404 and 405 and the connection layer's own refusals included, on a loopback port
//! served by `conn::serve` in this process.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use k3_serve::conn::{ConnLimits, serve};
use k3_serve::server::app;
use serde_json::json;

use crate::e2e::request;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_is_counted_by_its_status() {
    let state = crate::router::state(4, 2, 256);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        listener,
        app(state.clone()),
        ConnLimits::default(),
        Arc::clone(&state.responses),
        async {
            let _ = stopped.await;
        },
    ));
    let metrics = tokio::task::spawn_blocking(move || {
        let bad = json!({"messages": "not a list"}).to_string();
        for (method, path, body, status) in [
            ("GET", "/health", None, 200),
            ("POST", "/v1/chat/completions", Some(bad.as_str()), 400),
            ("GET", "/v1/nothing", None, 404),
            ("DELETE", "/health", None, 405),
        ] {
            let (answered, text) = request(port, method, path, body).unwrap();
            assert_eq!(answered, status, "{method} {path}: {text}");
        }
        // A head hyper's parser refuses, answered by the connection layer itself.
        let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let _ = raw.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        let (status, text) = request(port, "GET", "/metrics", None).unwrap();
        assert_eq!(status, 200, "{text}");
        text
    })
    .await
    .unwrap();
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("k3_requests_total{"))
        .collect();
    assert_eq!(
        counted,
        [
            r#"k3_requests_total{status="200"} 1"#,
            r#"k3_requests_total{status="400"} 2"#,
            r#"k3_requests_total{status="404"} 1"#,
            r#"k3_requests_total{status="405"} 1"#,
        ],
        "{metrics}"
    );
    assert!(
        metrics.contains("# TYPE k3_requests_total counter\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nk3_requests_admitted_total 0\n"),
        "{metrics}"
    );
}
