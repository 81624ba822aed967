//! One connection ([`connection`]): hyper's HTTP/1.1 over the watched socket, handed to
//! HTTP/2 when it opens with HTTP/2's preface, driven against its deadlines; a head hyper
//! refuses, or one begun and not finished in time, is answered here with the error object.

use std::future::Future;
use std::pin::Pin;

use axum::Router;
use axum::body::Body;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::ServiceExt;

use super::activity::{Guarded, Missed, Tracker};
use super::diagnosis::{MAX_HEAD_BYTES, MAX_HEADER_FIELDS, Read, refused_head};
use super::limits::ConnLimits;
use super::refusal::{head_timeout, refuse};
use super::watched::Watched;
use crate::server::status::StatusCounts;

/// One connection: hyper's HTTP/1.1 over the stream, watched for its deadlines, and handed
/// to hyper's HTTP/2 when it opens with HTTP/2's preface (prior knowledge). A head hyper
/// refuses, or one begun and not finished in time, is answered here with the error object.
pub(super) async fn connection(
    stream: TcpStream,
    router: Router,
    limits: ConnLimits,
    responses: &StatusCounts,
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
        let read = Read {
            rest: &parts.read_buf,
            before: before.map(|(bytes, _)| bytes),
            from_start: before.is_some_and(|(_, from_start)| from_start),
        };
        let error = refused_head(status, read, &why);
        log::debug!("refused a request head: {}", error.message);
        refuse(watched.into_stream(), &error, "", responses).await;
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
            let error = head_timeout(limits.header);
            refuse(watched.into_stream(), &error, "", responses).await;
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
