//! The HTTP layer over raw sockets: heads that hyper's parser refuses (bad Content-Length,
//! request lines of other HTTP versions, TLS on the plain port, bad header bytes, oversized
//! request lines and heads) are answered with OpenAI's error object; HTTP/2 with prior
//! knowledge is served; a head cut off by the header timeout gets a 408; kept-alive,
//! pipelined and streamed HTTP/1.1 requests still work.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::e2e::{start, start_with};

/// An HTTP/1.1 answer as read off the socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Lower-cased names, values as sent.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one answer (a `content-length` or chunked body, else up to EOF).
fn read_answer(reader: &mut impl BufRead) -> std::io::Result<Answer> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed with no answer",
        ));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not a status line: {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    let mut answer = Answer {
        status,
        headers,
        body: Vec::new(),
    };
    if let Some(n) = answer.header("content-length") {
        let n: usize = n.parse().map_err(std::io::Error::other)?;
        answer.body.resize(n, 0);
        reader.read_exact(&mut answer.body)?;
    } else if answer.header("transfer-encoding") == Some("chunked") {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).map_err(std::io::Error::other)?;
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            answer.body.extend_from_slice(&chunk[..n]);
        }
    } else {
        reader.read_to_end(&mut answer.body)?;
    }
    Ok(answer)
}

/// Sends `bytes` on a fresh connection and reads everything until the server closes it
/// (within 10 s). The bytes are written from a thread: the server may stop reading a head
/// over its limit and answer before the client has finished writing.
fn exchange(port: u16, bytes: Vec<u8>) -> Vec<u8> {
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let sending = std::thread::spawn(move || {
        // A reset or a broken pipe once the server has answered and closed is expected.
        let _ = writer.write_all(&bytes);
    });
    let mut received = Vec::new();
    let mut reader = stream;
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("no end of the answer within 10 s: {e}"),
        }
    }
    sending.join().unwrap();
    received
}

/// Checks that `answer` is a `status` with OpenAI's error object whose message contains
/// `says`, and that the server closes the connection after it; the problem otherwise.
fn check_error_object(answer: &Answer, status: u16, says: &str) -> Result<(), String> {
    if answer.status != status {
        return Err(format!("status {} instead of {status}", answer.status));
    }
    if !answer
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/json"))
    {
        return Err(format!(
            "content-type {:?} instead of application/json",
            answer.header("content-type")
        ));
    }
    let body: Value = serde_json::from_slice(&answer.body).map_err(|e| {
        format!(
            "the body is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&answer.body)
        )
    })?;
    let error = &body["error"];
    let message = error["message"].as_str().unwrap_or("");
    if message.is_empty() || !message.contains(says) {
        return Err(format!("the message does not say {says:?}: {body}"));
    }
    let kind = error["type"].as_str().unwrap_or("");
    // 414 and 431 get their type from the api's mapping of statuses to OpenAI's types.
    if kind.is_empty() || ([400, 408].contains(&status) && kind != "invalid_request_error") {
        return Err(format!("error.type is {:?}: {body}", error["type"]));
    }
    if error["code"] != json!(status.to_string())
        || !error.as_object().unwrap().contains_key("param")
    {
        return Err(format!("error.code or error.param is wrong: {body}"));
    }
    if answer.header("connection") != Some("close") {
        return Err(format!(
            "no `connection: close` with the answer: {:?}",
            answer.headers
        ));
    }
    Ok(())
}

/// A TLS 1.3 ClientHello for `localhost`, as a client that took `http://` for `https://`
/// sends first.
fn client_hello() -> Vec<u8> {
    let name = b"localhost";
    let mut server_name = vec![0x00, 0x00]; // extension type: server_name
    server_name.extend((u16::try_from(name.len()).unwrap() + 5).to_be_bytes());
    server_name.extend((u16::try_from(name.len()).unwrap() + 3).to_be_bytes());
    server_name.push(0x00); // host_name
    server_name.extend(u16::try_from(name.len()).unwrap().to_be_bytes());
    server_name.extend(name);
    let mut hello = vec![0x03, 0x03]; // legacy_version TLS 1.2
    hello.extend([0x5a; 32]); // random
    hello.push(0x00); // no session id
    hello.extend([0x00, 0x02, 0x13, 0x01]); // one suite: TLS_AES_128_GCM_SHA256
    hello.extend([0x01, 0x00]); // compression: null
    hello.extend(u16::try_from(server_name.len()).unwrap().to_be_bytes());
    hello.extend(server_name);
    let mut handshake = vec![0x01]; // client_hello
    handshake.extend(&u32::try_from(hello.len()).unwrap().to_be_bytes()[1..]);
    handshake.extend(hello);
    let mut record = vec![0x16, 0x03, 0x01]; // handshake record, TLS 1.0 framing
    record.extend(u16::try_from(handshake.len()).unwrap().to_be_bytes());
    record.extend(handshake);
    record
}

/// The heads the outside probe sent that hyper's parser refuses: (what, bytes, the status,
/// what the message must say).
fn refused_heads() -> Vec<(&'static str, Vec<u8>, u16, &'static str)> {
    let post = |content_length: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{content_length}\r\n\r\n{{}}"
        )
        .into_bytes()
    };
    let with_headers = |n: usize| {
        let mut head = String::from("GET /health HTTP/1.1\r\nHost: x\r\n");
        for i in 0..n {
            head.push_str(&format!("X-Field-{i}: v\r\n"));
        }
        head.push_str("\r\n");
        head.into_bytes()
    };
    vec![
        (
            "a negative Content-Length",
            post("Content-Length: -1"),
            400,
            "Content-Length",
        ),
        (
            "a non-numeric Content-Length",
            post("Content-Length: abc"),
            400,
            "Content-Length",
        ),
        (
            "a huge Content-Length",
            post("Content-Length: 99999999999999999999999"),
            400,
            "Content-Length",
        ),
        (
            "two Content-Length headers",
            post("Content-Length: 2\r\nContent-Length: 3"),
            400,
            "Content-Length",
        ),
        (
            "an HTTP/0.9 request",
            b"GET /\r\n".to_vec(),
            400,
            "HTTP version",
        ),
        (
            "an HTTP/2.0 request line",
            b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n".to_vec(),
            400,
            "HTTP/2.0",
        ),
        (
            "an HTTP/3.7 request line",
            b"GET /health HTTP/3.7\r\nHost: x\r\n\r\n".to_vec(),
            400,
            "HTTP/3.7",
        ),
        ("a TLS ClientHello", client_hello(), 400, "TLS"),
        (
            "the bytes 0x00 0xff in a header value",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Probe: \x00\xff\r\n\r\n".to_vec(),
            400,
            "X-Probe",
        ),
        (
            "the byte 0xff in a header name",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-\xff: 1\r\n\r\n".to_vec(),
            400,
            "header field name",
        ),
        (
            "a 100 KB path",
            format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(100_000)).into_bytes(),
            414,
            "request line",
        ),
        ("1,000 headers", with_headers(1_000), 431, "header fields"),
        ("10,000 headers", with_headers(10_000), 431, "header fields"),
        (
            "a 1 MB header",
            format!(
                "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
                "a".repeat(1 << 20)
            )
            .into_bytes(),
            431,
            "bytes",
        ),
    ]
}

/// The preface an HTTP/2 client with prior knowledge opens with, and its empty SETTINGS frame.
const H2_PREFACE_AND_SETTINGS: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Finding (issue 31): each head the parser refuses is answered with its status, a JSON
/// content type and OpenAI's error object saying what was wrong, then the connection is
/// closed; the HTTP/2 preface is answered with the server's own SETTINGS frame. Every case
/// is tried and the failures are listed together.
#[test]
fn heads_the_parser_refuses_get_an_error_object() {
    let server = start();
    let heads = refused_heads();
    // The heads and the HTTP/2 preface: the outside probe's 15 cases.
    let n_cases = heads.len() + 1;
    let mut failures = Vec::new();
    for (what, bytes, status, says) in heads {
        let received = exchange(server.port, bytes);
        let checked = read_answer(&mut received.as_slice())
            .map_err(|e| {
                format!(
                    "{e}; received {:?}",
                    String::from_utf8_lossy(&received[..received.len().min(300)])
                )
            })
            .and_then(|answer| check_error_object(&answer, status, says));
        if let Err(problem) = checked {
            failures.push(format!("{what}: {problem}"));
        }
    }
    // HTTP/2 prior knowledge: the server's preface, a SETTINGS frame (type 4 on stream 0),
    // is the first thing back. The stream stays open, so read just the frame's 9-byte head.
    let mut h2 = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    h2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    h2.write_all(H2_PREFACE_AND_SETTINGS).unwrap();
    let mut frame = [0u8; 9];
    match h2.read_exact(&mut frame) {
        Ok(()) if frame[3] == 0x04 && frame[5..9] == [0; 4] => {}
        Ok(()) => failures.push(format!(
            "the HTTP/2 preface: the first frame back is not SETTINGS: {frame:02x?}"
        )),
        Err(e) => failures.push(format!("the HTTP/2 preface: no frame back: {e}")),
    }
    assert!(
        failures.is_empty(),
        "{} of {n_cases} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The server is still serving.
    let (status, _) = crate::e2e::request(server.port, "GET", "/health", None).unwrap();
    assert_eq!(status, 200);
}

/// A real HTTP/2 client with prior knowledge (hyper's) gets JSON from `/v1/models`, OpenAI's
/// error object for an unknown route, and a streamed completion, all on one connection.
#[test]
fn http2_with_prior_knowledge_is_served() {
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let server = start();
    let port = server.port;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let mut send = async |method: &str, path: &str, body: &str| {
            let request = hyper::Request::builder()
                .method(method)
                .uri(format!("http://127.0.0.1:{port}{path}"))
                .header("content-type", "application/json")
                .body(Full::new(axum::body::Bytes::from(body.to_owned())))
                .unwrap();
            let response =
                tokio::time::timeout(Duration::from_secs(20), sender.send_request(request))
                    .await
                    .expect("an HTTP/2 answer within 20 s")
                    .unwrap_or_else(|e| panic!("{method} {path} over HTTP/2: {e}"));
            assert_eq!(response.version(), hyper::Version::HTTP_2);
            let status = response.status().as_u16();
            let content_type = response
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                content_type,
                String::from_utf8_lossy(&body).into_owned(),
            )
        };

        let (status, content_type, body) = send("GET", "/v1/models", "").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(content_type.as_deref(), Some("application/json"));
        let models: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(models["object"], "list", "{body}");

        let (status, content_type, body) = send("GET", "/no/such/route", "").await;
        assert_eq!(status, 404, "{body}");
        assert_eq!(content_type.as_deref(), Some("application/json"));
        let error: Value = serde_json::from_str(&body).unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("/no/such/route")),
            "{body}"
        );
        assert_eq!(error["error"]["code"], "404", "{body}");

        let stream = json!({"prompt": "Once", "max_tokens": 8, "stream": true}).to_string();
        let (status, _, body) = send("POST", "/v1/completions", &stream).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    });
}

/// Reads until the server closes the connection (within `limit`): the bytes it sent and how
/// long that took.
fn until_closed(stream: &mut TcpStream, limit: Duration) -> (Vec<u8>, Duration) {
    stream.set_read_timeout(Some(limit)).unwrap();
    let start = Instant::now();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (received, start.elapsed()),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (received, start.elapsed());
            }
            Err(e) => panic!("not closed within {limit:?}: {e}"),
        }
    }
}

/// Finding (issue 31): a request whose head stops halfway gets a 408 with the error object at
/// the header timeout, on a new connection and on a kept-alive one; a connection that sent
/// nothing, or a kept-alive one between requests, is closed without a word.
#[test]
fn a_head_cut_off_by_the_header_timeout_gets_a_408() {
    let server = start_with(&["--header-timeout-s", "1", "--idle-timeout-s", "1.5"]);
    let port = server.port;
    let expect_408 = |stream: &mut TcpStream, what: &str| {
        let (received, took) = until_closed(stream, Duration::from_secs(5));
        assert!(took < Duration::from_millis(1800), "{what}: took {took:?}");
        let answer = read_answer(&mut received.as_slice()).unwrap_or_else(|e| {
            panic!(
                "{what}: {e}; received {:?}",
                String::from_utf8_lossy(&received)
            )
        });
        if let Err(problem) = check_error_object(&answer, 408, "did not arrive") {
            panic!("{what}: {problem}");
        }
    };

    let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    expect_408(&mut half, "half a head on a new connection");

    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (received, took) = until_closed(&mut silent, Duration::from_secs(5));
    assert!(took < Duration::from_millis(1800), "silent: took {took:?}");
    assert!(
        received.is_empty(),
        "a connection that sent nothing got {:?}",
        String::from_utf8_lossy(&received)
    );

    // Kept alive after an answer: idle, it is closed without a word at the idle timeout; a
    // head begun on it and left unfinished gets the 408.
    for half_a_head in [false, true] {
        let mut kept = TcpStream::connect(("127.0.0.1", port)).unwrap();
        kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut reader = BufReader::new(kept.try_clone().unwrap());
        let first = read_answer(&mut reader).unwrap();
        assert_eq!(first.status, 200);
        if half_a_head {
            kept.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
                .unwrap();
            expect_408(&mut kept, "half a head on a kept-alive connection");
        } else {
            let (received, took) = until_closed(&mut kept, Duration::from_secs(5));
            assert!(
                took > Duration::from_millis(1200) && took < Duration::from_millis(2300),
                "idle connection closed after {took:?}"
            );
            assert!(
                received.is_empty(),
                "an idle kept-alive connection got {:?}",
                String::from_utf8_lossy(&received)
            );
        }
    }
}

/// What the error answers must not break: two requests on one kept-alive connection with an
/// SSE stream between them, pipelined requests answered in order, and a bad head pipelined
/// after a good request answered with its error object after the good answer.
#[test]
fn kept_alive_pipelined_and_streamed_requests_still_work() {
    let server = start();
    let port = server.port;

    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    writer
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let models = read_answer(&mut reader).unwrap();
    assert_eq!(models.status, 200);
    let body = json!({"prompt": "Once", "max_tokens": 8, "stream": true}).to_string();
    write!(
        writer,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let streamed = read_answer(&mut reader).unwrap();
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.header("content-type"), Some("text/event-stream"));
    let text = String::from_utf8_lossy(&streamed.body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    writer
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_answer(&mut reader).unwrap().status, 200);

    // Two requests in one write, then a good one and a bad one in one write.
    let received = exchange(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
    );
    let mut answers = received.as_slice();
    assert_eq!(read_answer(&mut answers).unwrap().status, 200);
    let models = read_answer(&mut answers).unwrap();
    assert_eq!(models.status, 200);
    assert!(String::from_utf8_lossy(&models.body).contains("\"list\""));

    let received = exchange(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/3.7\r\nHost: x\r\n\r\n".to_vec(),
    );
    let mut answers = received.as_slice();
    assert_eq!(read_answer(&mut answers).unwrap().status, 200);
    let refused = read_answer(&mut answers).unwrap();
    if let Err(problem) = check_error_object(&refused, 400, "HTTP/3.7") {
        panic!(
            "the bad pipelined head: {problem}; received {:?}",
            String::from_utf8_lossy(&received)
        );
    }
}
