//! A connection's last words: OpenAI's error object in an HTTP/1.1 answer that closes the
//! connection, written whole before the close (for a head hyper's parser refused, a head that
//! did not arrive in time, and a connection over the cap).

use std::time::Duration;

use axum::http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::api::error::ApiError;
use crate::server::status::StatusCounts;

/// How long a closing connection reads, and drops, what the client still sends.
const LINGER: Duration = Duration::from_secs(1);

/// A head begun but not finished within `header`.
pub(super) fn head_timeout(header: Duration) -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        format!(
            "the request head did not arrive within {} s",
            header.as_secs_f64()
        ),
    )
}

/// `error` as an HTTP/1.1 answer that ends the connection, with `extra` header lines (each
/// ending in CRLF).
fn answer(error: &ApiError, extra: &str) -> Vec<u8> {
    let body = error.body().to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
        error.status.as_u16(),
        error.status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// Sends `answer` and closes: the sending side is shut first, then what the client still
/// sends is read and dropped for up to [`LINGER`]. Closing a socket with unread bytes resets
/// the connection, and a reset can destroy the answer before the client reads it (a head
/// over the limit is refused before all of it is read).
async fn close_with(mut stream: TcpStream, answer: &[u8]) {
    let _ = tokio::time::timeout(LINGER, async {
        stream.write_all(answer).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Over the cap: a 503 with the error object, then close.
pub(super) async fn over_capacity(stream: TcpStream, cap: usize, responses: &StatusCounts) {
    let error = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the server has its maximum of {cap} connections open; retry later"),
    );
    refuse(stream, &error, "retry-after: 1\r\n", responses).await;
}

/// `error` as the connection's last answer (with `extra` header lines), counted in
/// `responses`, then close.
pub(super) async fn refuse(
    stream: TcpStream,
    error: &ApiError,
    extra: &str,
    responses: &StatusCounts,
) {
    responses.record(error.status);
    close_with(stream, &answer(error, extra)).await;
}
