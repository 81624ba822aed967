//! Tests of `diagnosis.rs`.

use super::*;

fn says(status: u16, rest: &[u8], before: &[u8], from_start: bool) -> (u16, String) {
    let read = Read {
        rest,
        before: Some(before),
        from_start,
    };
    let error = refused_head(StatusCode::from_u16(status).unwrap(), read, &"HYPER");
    (error.status.as_u16(), error.message)
}

/// hyper's own parser on `head`: whether it hands the request on (answered 200 here)
/// rather than refusing it.
async fn hyper_accepts(head: &[u8]) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let service = hyper::service::service_fn(|_| async {
        Ok::<_, std::convert::Infallible>(hyper::Response::new(http_body_util::Empty::<
            axum::body::Bytes,
        >::new()))
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .max_headers(MAX_HEADER_FIELDS)
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(hyper_util::rt::TokioIo::new(server), service);
    tokio::spawn(conn);
    client.write_all(head).await.unwrap();
    let mut status = [0u8; 12];
    client.read_exact(&mut status).await.unwrap();
    match &status[9..] {
        b"200" => true,
        b"400" => false,
        other => panic!("{}: {}", head.escape_ascii(), other.escape_ascii()),
    }
}

/// The checks follow hyper's: of these heads, the ones hyper refuses are found wrong
/// (before or after it takes them off its buffer) and the ones it serves are not.
#[tokio::test]
async fn what_is_found_wrong_is_what_hyper_refuses() {
    let heads: [&[u8]; 23] = [
        b"GET / HTTP/1.1\r\n\r\n",
        b"GET /v1/models?x=1 HTTP/1.0\r\nHost: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\n{}",
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: -1\r\n\r\n0\r\n\r\n",
        b"GET http://h:1/p HTTP/1.1\r\nX-Obs: \xff\xfe\tv\r\n\n",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\nx",
        b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET http://[::1 HTTP/1.1\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"GET / HTTP/1.1 x\r\n\r\n",
        b"G@T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-Probe: \x00\xff\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-\xff: 1\r\n\r\n",
        b"GET / HTTP/1.1\r\nNo colon\r\n\r\n",
        b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-Del: a\x7fb\r\n\r\n",
        b"GET / HTTP/1.1\r\n Folded: x\r\n\r\n",
    ];
    for head in heads {
        let found = meaning(head).or_else(|| syntax(head));
        assert_eq!(
            hyper_accepts(head).await,
            found.is_none(),
            "{}: {found:?}",
            head.escape_ascii()
        );
    }
}

/// hyper takes a head off its buffer before it checks Content-Length: the head is found
/// just before what it left, on a new connection and after a served request; glued to a
/// body, or cut from what was kept, it is not guessed at and hyper's words stand.
#[test]
fn a_head_taken_off_the_buffer_is_found_before_the_rest() {
    let bad = b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n";
    let expected =
        "invalid Content-Length \"-1\": it must be a number of bytes, at most 18446744073709551613";
    assert_eq!(says(400, b"{}", bad, true), (400, expected.into()));
    let after_a_get = [&b"GET / HTTP/1.1\r\n\r\n"[..], bad].concat();
    assert_eq!(says(400, b"", &after_a_get, false), (400, expected.into()));
    // Past hyper's largest length it answers 431; the value is what is wrong.
    let huge = b"POST / HTTP/1.1\r\nContent-Length: 18446744073709551615\r\n\r\n";
    assert_eq!(says(431, b"", huge, true).0, 400);

    let glued = [&b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"[..], bad].concat();
    let unknown = (400, "the request head could not be parsed: HYPER".into());
    assert_eq!(says(400, b"{}", &glued, true), unknown);
    assert_eq!(says(400, b"{}", &bad[5..], false), unknown);
    // Kept from a cut, a first line that reads as a request line may be the tail of a
    // field line: it is not trusted.
    assert_eq!(says(400, b"{}", bad, false), unknown);
    // Not even the rest was kept: whether a head was taken off is not known.
    let read = Read {
        rest: b"{}",
        before: None,
        from_start: false,
    };
    let error = refused_head(StatusCode::BAD_REQUEST, read, &"HYPER");
    assert_eq!((error.status.as_u16(), error.message), unknown);
}

/// A bad head pipelined after a served one: hyper still holds it, and it is read there.
#[test]
fn a_head_hyper_still_holds_is_read_there() {
    let served = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    let (status, message) = says(400, b"GET / HTTP/3.7\r\n\r\n", served, true);
    assert_eq!(status, 400);
    assert!(message.contains("\"HTTP/3.7\""), "{message}");
    let (status, message) = says(400, b"GET / HTTP/1.1\r\nA B: c\r\n", b"", true);
    assert_eq!(status, 400);
    assert!(message.contains("invalid byte 0x20: \"A B\""), "{message}");
    // A request line cut before its end is not judged by what has not arrived.
    assert_eq!(
        says(400, b"GET /\x01", b"", true).1,
        "the request head could not be parsed: HYPER"
    );
}

#[test]
fn a_request_line_that_fills_the_buffer_is_a_414() {
    let line = [&b"GET /"[..], &[b'a'; MAX_HEAD_BYTES]].concat();
    let (status, message) = says(431, &line, b"", true);
    assert_eq!(status, 414);
    assert!(message.contains("longer than 65536 bytes"), "{message}");
    let head = [&b"GET /h HTTP/1.1\r\n"[..], &b"X: y\r\n".repeat(101)].concat();
    assert!(
        says(431, &head, b"", true)
            .1
            .contains("limit of 100 header fields")
    );
    let head = [&b"GET /h HTTP/1.1\r\nX: "[..], &[b'y'; MAX_HEAD_BYTES]].concat();
    assert!(
        says(431, &head, b"", true)
            .1
            .contains("limit of 65536 bytes")
    );
}
