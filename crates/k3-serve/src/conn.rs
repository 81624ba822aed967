//! Connections: the accept loop over hyper's HTTP/1.1, with the limits a server on an open
//! port needs — a deadline for a request's head (from its first byte, or from the accept), one
//! for its body, an idle keep-alive timeout, and a cap on open connections (over it, a 503
//! with OpenAI's error object, then close). A request in flight (a long prefill, an SSE
//! stream) is never idle.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::api::ApiError;
use crate::server::MAX_BODY;

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
    let (closing, _) = tokio::sync::watch::channel(false);
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
                        refuse(stream, cap).await;
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

/// One connection: hyper's HTTP/1.1 over the stream, watched for its deadlines.
async fn connection(
    stream: TcpStream,
    router: Router,
    limits: ConnLimits,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Mutex::new(Activity {
        in_flight: 0,
        idle_since: Instant::now(),
        head_since: Some(Instant::now()),
    }));
    let io = TokioIo::new(Watched {
        stream,
        activity: Arc::clone(&activity),
    });
    let service = {
        let activity = Arc::clone(&activity);
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::begin(&activity);
            let router = router.clone();
            async move {
                let response = router.oneshot(request.map(Body::new)).await;
                response.map(|r| {
                    r.map(|inner| {
                        Body::new(Guarded {
                            inner,
                            _in_flight: in_flight,
                        })
                    })
                })
            }
        })
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut shutting_down = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    log::debug!("connection ended: {e}");
                }
                return;
            }
            why = deadline(&activity, limits) => {
                log::debug!("closing a connection: {why}");
                return;
            }
            changed = closing.changed(), if !shutting_down => {
                shutting_down = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// What a connection is doing, for its deadlines.
#[derive(Debug)]
struct Activity {
    /// Requests handed to the router whose responses are not yet fully sent.
    in_flight: usize,
    /// When the last response ended (or the accept).
    idle_since: Instant,
    /// When the head being read began (the accept for a new connection).
    head_since: Option<Instant>,
}

/// Completes when the connection has missed a deadline, saying which.
async fn deadline(activity: &Mutex<Activity>, limits: ConnLimits) -> &'static str {
    loop {
        let now = Instant::now();
        let wait = {
            let a = activity.lock().unwrap_or_else(|p| p.into_inner());
            if a.in_flight > 0 {
                // Busy: look again later (a response ending resets `idle_since`).
                limits.idle.min(limits.header)
            } else if let Some(since) = a.head_since {
                match limits.header.checked_sub(now - since) {
                    Some(left) if !left.is_zero() => left,
                    _ => return "the request head did not arrive in time",
                }
            } else {
                match limits.idle.checked_sub(now - a.idle_since) {
                    Some(left) if !left.is_zero() => left,
                    _ => return "idle",
                }
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// Counts a request in flight until its response body is gone.
struct InFlight(Arc<Mutex<Activity>>);

impl InFlight {
    fn begin(activity: &Arc<Mutex<Activity>>) -> Self {
        let mut a = activity.lock().unwrap_or_else(|p| p.into_inner());
        a.in_flight += 1;
        a.head_since = None;
        Self(Arc::clone(activity))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut a = self.0.lock().unwrap_or_else(|p| p.into_inner());
        a.in_flight -= 1;
        a.idle_since = Instant::now();
    }
}

/// A response body that keeps its request counted in flight while it is sent.
struct Guarded {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting when a new request head begins (bytes received with nothing in flight).
struct Watched {
    stream: TcpStream,
    activity: Arc<Mutex<Activity>>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            let mut a = self.activity.lock().unwrap_or_else(|p| p.into_inner());
            if a.in_flight == 0 && a.head_since.is_none() {
                a.head_since = Some(Instant::now());
            }
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Over the cap: a 503 with the error object, then close (after reading what the client
/// sent, briefly, so the close does not reset the answer away).
async fn refuse(mut stream: TcpStream, cap: usize) {
    let error = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the server has its maximum of {cap} connections open; retry later"),
    );
    let body = error.body().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
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
