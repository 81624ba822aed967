//! What a connection is doing, for its deadlines and for telling the router's answers from
//! hyper's own: requests in flight, an ended answer hyper may not have written out yet, when
//! the last answer ended and when the head being read began.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};

/// The deadline a connection missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Missed {
    /// A request head (or, for a new connection, its first byte) did not arrive in time.
    Head,
    /// Kept alive with nothing in flight and nothing received for too long.
    Idle,
}

/// A connection's activity, shared by its socket, its service and its deadline.
#[derive(Debug, Clone)]
pub(super) struct Tracker(Arc<Mutex<Activity>>);

#[derive(Debug)]
struct Activity {
    /// Requests handed to the router whose responses are not yet fully sent.
    in_flight: usize,
    /// A response body has ended, but hyper may still hold its last bytes: hyper drops the
    /// body when it buffers the last chunk, and writes that out at its next flush.
    unflushed: bool,
    /// When the last response ended (or the accept).
    idle_since: Instant,
    /// When the head being read began (the accept for a new connection).
    head_since: Option<Instant>,
}

impl Tracker {
    /// A connection accepted now: its first head is due within the header timeout.
    pub(super) fn new() -> Self {
        Self(Arc::new(Mutex::new(Activity {
            in_flight: 0,
            unflushed: false,
            idle_since: Instant::now(),
            head_since: Some(Instant::now()),
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Activity> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request handed to the router: in flight until the returned guard is dropped.
    pub(super) fn begin(&self) -> InFlight {
        let mut a = self.lock();
        a.in_flight += 1;
        a.head_since = None;
        InFlight(self.clone())
    }

    /// Bytes of an HTTP/1.1 request arrived: with nothing in flight, they begin a new head.
    pub(super) fn received(&self) {
        let mut a = self.lock();
        if a.in_flight == 0 && a.head_since.is_none() {
            a.head_since = Some(Instant::now());
        }
    }

    /// Whether what hyper writes now belongs to an answer of the router's.
    pub(super) fn router_answering(&self) -> bool {
        let a = self.lock();
        a.in_flight > 0 || a.unflushed
    }

    /// hyper flushed: whatever it held of an ended answer has been written.
    pub(super) fn flushed(&self) {
        self.lock().unflushed = false;
    }

    /// Completes when the connection misses a deadline: a head not done within `header` of
    /// its start, or nothing in flight for `idle`.
    pub(super) async fn missed(&self, header: Duration, idle: Duration) -> Missed {
        loop {
            let now = Instant::now();
            let wait = {
                let a = self.lock();
                if a.in_flight > 0 {
                    // Busy: look again later (a response ending resets `idle_since`).
                    idle.min(header)
                } else if let Some(since) = a.head_since {
                    match header.checked_sub(now - since) {
                        Some(left) if !left.is_zero() => left,
                        _ => return Missed::Head,
                    }
                } else {
                    match idle.checked_sub(now - a.idle_since) {
                        Some(left) if !left.is_zero() => left,
                        _ => return Missed::Idle,
                    }
                }
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// Counts a request in flight until its response body is gone.
#[derive(Debug)]
pub(super) struct InFlight(Tracker);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut a = self.0.lock();
        a.in_flight -= 1;
        a.unflushed = true;
        a.idle_since = Instant::now();
    }
}

/// A response body that keeps its request counted in flight while it is sent.
pub(super) struct Guarded {
    inner: Body,
    _in_flight: InFlight,
}

impl Guarded {
    pub(super) fn new(inner: Body, in_flight: InFlight) -> Self {
        Self {
            inner,
            _in_flight: in_flight,
        }
    }
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
