//! Connections: the accept loop over hyper's HTTP/1.1 (and HTTP/2 with prior knowledge), with
//! the limits a server on an open port needs — a deadline for a request's head (from its
//! first byte, or from the accept), one for its body, an idle keep-alive timeout, caps on a
//! head's size and fields, and a cap on open connections. Every refusal is OpenAI's error
//! object: over the cap a 503, a head cut off by its deadline a 408, and a head hyper's parser
//! refuses (bad Content-Length, another HTTP version, TLS, bad bytes, too long) its 400, 414
//! or 431, in place of hyper's bare answer. A request in flight (a long prefill, an SSE
//! stream) is never idle.
//!
//! hyper answers a head it cannot parse on its own, with no body, before it reports the
//! error. The socket under it ([`watched`]) knows when no answer of the router's is under
//! way, so it holds such an answer back. When hyper has given up, its read buffer holds the
//! head (or what followed it, when hyper took the head off to check what a field means, and
//! the socket kept what came before); [`diagnosis`] says what was wrong with it and
//! [`refusal`] answers and closes. The alternative, parsing heads before hyper does, would
//! mean following every body's framing to find where the next head begins (pipelining).

mod activity;
mod diagnosis;
mod refusal;
mod watched;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

use crate::api::ApiError;
use crate::server::MAX_BODY;
use activity::{Guarded, Missed, Tracker};
use diagnosis::{MAX_HEAD_BYTES, MAX_HEADER_FIELDS};
use watched::Watched;

/// The connection limits (the CLI's `--header-timeout-s`, `--body-timeout-s`,
/// `--idle-timeout-s`, `--max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// From a connection's accept, or a request head's first byte, to the head's end.
    pub header: Duration,
    /// From the end of a request's head to the end of its body.
    pub body: Duration,
    /// A kept-alive connection with no request in flight and no byte received is closed
    /// after this.
    pub idle: Duration,
    /// Open connections at most.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            idle: Duration::from_secs(60),
            max_connections: 4096,
        }
    }
}

/// Connections being refused over the cap at once, at most (beyond, they are just closed).
const REFUSING_AT_ONCE: usize = 64;

/// Serves `router` on `listener` until `shutdown` completes, then lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let body_deadline = limits.body;
    let router = router.layer(axum::middleware::from_fn(move |request, next| {
        read_body_within(body_deadline, request, next)
    }));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
    let (closing, _) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or the like: the connections that hold them end on
                    // their deadlines, so wait a moment instead of spinning.
                    log::warn!("accept error: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => {
                let (router, closing) = (router.clone(), closing.subscribe());
                tokio::spawn(async move {
                    connection(stream, router, limits, closing).await;
                    drop(permit);
                });
            }
            Err(_) => {
                if let Ok(slot) = Arc::clone(&refusing).try_acquire_owned() {
                    let cap = limits.max_connections;
                    tokio::spawn(async move {
                        refusal::over_capacity(stream, cap).await;
                        drop(slot);
                    });
                }
            }
        }
    }
    // Accept no more; finish what is in flight: idle connections close at once, the others
    // after their response.
    drop(listener);
    let _ = closing.send(true);
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
    Ok(())
}

/// One connection: hyper's HTTP/1.1 over the stream, watched for its deadlines, and handed
/// to hyper's HTTP/2 when it opens with HTTP/2's preface (prior knowledge). A head hyper
/// refuses, or one begun and not finished in time, is answered here with the error object.
async fn connection(
    stream: TcpStream,
    router: Router,
    limits: ConnLimits,
    mut closing: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let tracker = Tracker::new();
    let service = {
        let tracker = tracker.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let in_flight = tracker.begin();
            let router = router.clone();
            async move {
                let response = router.oneshot(request.map(Body::new)).await;
                response.map(|r| r.map(|inner| Body::new(Guarded::new(inner, in_flight))))
            }
        })
    };
    let mut http1 = http1::Builder::new()
        .keep_alive(true)
        .max_headers(MAX_HEADER_FIELDS)
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(Watched::new(stream, tracker.clone())), service);
    let ended = drive(
        Pin::new(&mut http1),
        |conn| conn.graceful_shutdown(),
        &tracker,
        limits,
        &mut closing,
    )
    .await;
    if let Ended::Served(Ok(())) | Ended::Missed(Missed::Idle) = ended {
        return;
    }
    // hyper gave up on the connection, or its head is late: `read_buf` holds what it read
    // and did not consume.
    let parts = http1.into_parts();
    let mut watched = parts.io.into_inner();
    if let Some(status) = watched.held_back() {
        let why = match &ended {
            Ended::Served(Err(e)) => e.to_string(),
            _ => "no reason given".into(),
        };
        let before = watched.read_before(&parts.read_buf);
        let read = diagnosis::Read {
            rest: &parts.read_buf,
            before: before.map(|(bytes, _)| bytes),
            from_start: before.is_some_and(|(_, from_start)| from_start),
        };
        let error = diagnosis::refused_head(status, read, &why);
        log::debug!("refused a request head: {}", error.message);
        refusal::close_with(watched.into_stream(), &refusal::answer(&error, "")).await;
        return;
    }
    match ended {
        Ended::Served(Err(_)) if parts.read_buf.starts_with(H2_PREFACE) => {
            watched.speak_http2(parts.read_buf);
            let http2 = http2::Builder::new(TokioExecutor::new())
                .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
                .serve_connection(TokioIo::new(watched), parts.service);
            let mut http2 = std::pin::pin!(http2);
            let ended = drive(
                http2.as_mut(),
                |conn| conn.graceful_shutdown(),
                &tracker,
                limits,
                &mut closing,
            )
            .await;
            log::debug!("an HTTP/2 connection ended: {ended:?}");
        }
        Ended::Missed(Missed::Head) if !parts.read_buf.is_empty() => {
            let error = refusal::head_timeout(limits.header);
            refusal::close_with(watched.into_stream(), &refusal::answer(&error, "")).await;
        }
        ended => log::debug!("a connection ended: {ended:?}"),
    }
}

/// What HTTP/2 with prior knowledge opens with (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How hyper's serving of a connection ended.
#[derive(Debug)]
enum Ended {
    /// hyper finished: the client closed, a graceful shutdown completed, or it gave up.
    Served(hyper::Result<()>),
    Missed(Missed),
}

/// Polls `conn` until it ends or misses a deadline; once the server shuts down, asks it
/// (`graceful`) to finish what is in flight and close.
async fn drive<C: Future<Output = hyper::Result<()>>>(
    mut conn: Pin<&mut C>,
    graceful: fn(Pin<&mut C>),
    tracker: &Tracker,
    limits: ConnLimits,
    closing: &mut watch::Receiver<bool>,
) -> Ended {
    let mut shutting_down = *closing.borrow_and_update();
    if shutting_down {
        graceful(conn.as_mut());
    }
    loop {
        tokio::select! {
            result = conn.as_mut() => return Ended::Served(result),
            missed = tracker.missed(limits.header, limits.idle) => return Ended::Missed(missed),
            changed = closing.changed(), if !shutting_down => {
                shutting_down = true;
                if changed.is_ok() {
                    graceful(conn.as_mut());
                }
            }
        }
    }
}

/// Reads the whole request body within `deadline` (408 otherwise) and at most [`MAX_BODY`]
/// bytes (413), before the handler sees it.
async fn read_body_within(deadline: Duration, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        deadline,
        http_body_util::Limited::new(body, MAX_BODY).collect(),
    );
    let bytes = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body exceeds the limit of {MAX_BODY} bytes"),
            )
            .into_response();
        }
        Ok(Err(e)) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("could not read the request body: {e}"),
            )
            .into_response();
        }
        Err(_) => {
            let mut response = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    deadline.as_secs_f64()
                ),
            )
            .into_response();
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            return response;
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
