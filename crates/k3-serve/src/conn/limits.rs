//! The connection limits ([`ConnLimits`]): the deadlines for a request's head and body, the
//! idle keep-alive timeout and the cap on open connections.

use std::time::Duration;

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
