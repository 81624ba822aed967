//! The accept loop ([`serve`]): a task per connection under the cap, a 503 over it, and a
//! graceful end that lets open requests finish.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use super::body::read_body_within;
use super::connection::connection;
use super::limits::ConnLimits;
use super::refusal::over_capacity;
use crate::server::status::{StatusCounts, count_status};

/// Connections being refused over the cap at once, at most (beyond, they are just closed).
const REFUSING_AT_ONCE: usize = 64;

/// Serves `router` on `listener` until `shutdown` completes, then lets open requests finish.
/// Every answer is counted in `responses` by its status: the router's, the body reader's
/// and the refusals this layer writes itself.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    responses: Arc<StatusCounts>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let body_deadline = limits.body;
    let router = router
        .layer(axum::middleware::from_fn(move |request, next| {
            read_body_within(body_deadline, request, next)
        }))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&responses),
            count_status,
        ));
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
                let responses = Arc::clone(&responses);
                tokio::spawn(async move {
                    connection(stream, router, limits, &responses, closing).await;
                    drop(permit);
                });
            }
            Err(_) => {
                if let Ok(slot) = Arc::clone(&refusing).try_acquire_owned() {
                    let cap = limits.max_connections;
                    let responses = Arc::clone(&responses);
                    tokio::spawn(async move {
                        over_capacity(stream, cap, &responses).await;
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
