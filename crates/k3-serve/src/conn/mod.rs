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
//! error. The socket under it (`watched`) knows when no answer of the router's is under
//! way, so it holds such an answer back. When hyper has given up, its read buffer holds the
//! head (or what followed it, when hyper took the head off to check what a field means, and
//! the socket kept what came before); `diagnosis` says what was wrong with it and
//! `refusal` answers and closes. The alternative, parsing heads before hyper does, would
//! mean following every body's framing to find where the next head begins (pipelining).
//!
//! This file only names the parts, bottom-up: `limits` the limits, `activity` what a connection is doing, `watched` the socket, `diagnosis` a
//! refused head's fault, `refusal` the answers written here, `body` the body reader,
//! `connection` one connection, `accept` the accept loop.

mod accept;
mod activity;
mod body;
mod connection;
mod diagnosis;
pub(crate) mod limits;
mod refusal;
mod watched;

pub use accept::serve;
pub use limits::ConnLimits;
