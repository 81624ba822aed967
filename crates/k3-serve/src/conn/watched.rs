//! The socket under hyper: it notes when a request head begins (for the header deadline),
//! holds back the bare answer hyper writes on its own for a head it refuses (so that the
//! connection can answer with OpenAI's error object in its place), keeps the last bytes read
//! (to tell what was wrong with such a head), and gives HTTP/2 the bytes HTTP/1.1's parser
//! read before handing over.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::activity::Tracker;

/// Bytes read that are kept, at least (when as many were read): more than an ordinary head.
/// At most twice as many are kept, per connection.
const RECENT: usize = 8 << 10;

/// A connection's socket as hyper sees it.
#[derive(Debug)]
pub(super) struct Watched {
    stream: TcpStream,
    tracker: Tracker,
    /// HTTP/2 once handed over; HTTP/1.1 until then.
    http2: bool,
    /// Read before, by HTTP/1.1's parser, and read again first by HTTP/2.
    replay: Bytes,
    /// The status of the answer hyper wrote for a head it refused, which was held back.
    held_back: Option<StatusCode>,
    /// The last bytes read over HTTP/1.1: from [`RECENT`] to twice as many.
    recent: Vec<u8>,
    /// Whether `recent` holds every byte read.
    recent_from_start: bool,
}

impl Watched {
    pub(super) fn new(stream: TcpStream, tracker: Tracker) -> Self {
        Self {
            stream,
            tracker,
            http2: false,
            replay: Bytes::new(),
            held_back: None,
            recent: Vec::new(),
            recent_from_start: true,
        }
    }

    /// What was read just before `rest`, the last bytes read (hyper's unconsumed buffer), as
    /// far as it was kept, and whether that starts at the connection's first byte; `None`
    /// when not even `rest` was kept.
    pub(super) fn read_before(&self, rest: &[u8]) -> Option<(&[u8], bool)> {
        let before = self.recent.len().checked_sub(rest.len())?;
        self.recent
            .ends_with(rest)
            .then(|| (&self.recent[..before], self.recent_from_start))
    }

    /// The status hyper gave a head it refused, if it refused one (its answer was held back).
    pub(super) fn held_back(&self) -> Option<StatusCode> {
        self.held_back
    }

    /// From now on the connection speaks HTTP/2, starting with `read_before`.
    pub(super) fn speak_http2(&mut self, read_before: Bytes) {
        self.http2 = true;
        self.replay = read_before;
        self.recent = Vec::new();
    }

    pub(super) fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// Whether to hold back what hyper writes, `first` being its first bytes. In HTTP/1.1
    /// with no answer of the router's under way, hyper is answering a head it refused on its
    /// own (`Conn::on_parse_error` in hyper's `proto/h1/conn.rs`: a status line and no body,
    /// then the end of the connection): that answer is held back and its status kept.
    fn holds_back(&mut self, first: &[u8]) -> bool {
        if self.held_back.is_some() {
            return true;
        }
        if self.http2 || self.tracker.router_answering() || !first.starts_with(b"HTTP/1.") {
            return false;
        }
        // "HTTP/1.1 431 Request Header Fields Too Large\r\n..."
        self.held_back = first
            .get(9..12)
            .and_then(|code| StatusCode::from_bytes(code).ok());
        self.held_back.is_some()
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.replay.is_empty() {
            let n = self.replay.len().min(buf.remaining());
            let replayed = self.replay.split_to(n);
            buf.put_slice(&replayed);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        // HTTP/2's frames are not heads: an HTTP/2 connection has the header deadline until
        // its first request, then the idle one.
        if buf.filled().len() > before && !self.http2 {
            self.tracker.received();
            let Self {
                recent,
                recent_from_start,
                ..
            } = &mut *self;
            recent.extend_from_slice(&buf.filled()[before..]);
            if recent.len() > 2 * RECENT {
                recent.drain(..recent.len() - RECENT);
                *recent_from_start = false;
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
        if self.holds_back(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
        if self.holds_back(first) {
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // hyper flushes its own buffer into the socket before flushing the socket.
        self.tracker.flushed();
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // hyper shuts the socket down after its answer to a refused head; the connection's
        // own answer must go first, and it shuts the socket down itself.
        if self.held_back.is_some() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
