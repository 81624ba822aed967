//! Every HTTP answer counted by its status code ([`StatusCounts`]), for `/metrics`'
//! `k3_requests_total{status="..."}`: the connection layer counts what it answers itself (a
//! connection over the cap, a head refused or late) and, through [`count_status`] wrapped
//! around everything else, every answer of the router, the body reader and the API key check.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;

/// Answers given, by status code. Shared by the connection layer, which counts, and
/// `/metrics`, which reads.
#[derive(Debug, Default)]
pub struct StatusCounts(Mutex<BTreeMap<u16, u64>>);

impl StatusCounts {
    /// Counts one answer with `status`.
    pub fn record(&self, status: StatusCode) {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(status.as_u16()).or_default() += 1;
    }

    /// `(status, answers)` for every status answered at least once, by status.
    pub fn counts(&self) -> Vec<(u16, u64)> {
        let counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        counts.iter().map(|(&status, &n)| (status, n)).collect()
    }
}

/// The middleware: the next service's answer, counted by its status once its head is ready
/// (a stream counts when it starts).
pub(crate) async fn count_status(
    State(counts): State<Arc<StatusCounts>>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    counts.record(response.status());
    response
}
