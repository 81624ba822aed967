//! The server (`--serve`): the connection cap within the open-files limit, the API keys, the
//! HTTP runtime on the port while the model loads, and the shutdown on Ctrl-C or SIGTERM.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use anyhow::{Context, Result, bail};
use k3_serve::api::Limits;
use k3_serve::auth::{ApiKeys, require_api_key};
use k3_serve::conn::serve;
use k3_serve::engine::EngineHandle;
use k3_serve::server::{AppState, StatusCounts, app};

use crate::args::Args;
use crate::startup::raise_open_files_limit;

/// Serves `engine` (its thread `engine_thread`, still loading the model perhaps) until a
/// signal ends the process or the load fails.
pub(crate) fn serve_http(
    args: Args,
    engine: EngineHandle,
    engine_thread: JoinHandle<()>,
    limits: Limits,
) -> Result<()> {
    let mut conn = args.conn;
    // A descriptor per connection, and some for the checkpoint's files and the rest.
    if let Some(open_files) = raise_open_files_limit() {
        let room = usize::try_from(open_files.saturating_sub(256))
            .unwrap_or(usize::MAX)
            .max(1);
        if conn.max_connections > room {
            log::warn!(
                "--max-connections {} lowered to {room}: the open-files limit is {open_files}",
                conn.max_connections
            );
            conn.max_connections = room;
        }
    }
    let api_key = ApiKeys::new(&args.api_keys);
    if api_key.is_set() {
        log::info!(
            "API key required on /v1 (/health and /metrics are open); {} key{}, each its own \
             prompt-cache tenant",
            api_key.len(),
            if api_key.len() == 1 { "" } else { "s" }
        );
    } else {
        log::info!("no --api-key: the API is open to anyone who can reach the port");
    }
    // The HTTP runtime is deliberately unpinned: its two threads sleep on sockets and touch
    // no weights, and the compute pool's CPUs are the ones worth keeping for compute.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let waiter = engine.clone();
    let loaded = Arc::clone(&engine.ready);
    let (host, port) = (args.host.clone(), args.port);
    let served = runtime.block_on(async move {
        let address = format!("{host}:{port}");
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("binding {address}"))?;
        let also = &limits.model_names[1..];
        log::info!(
            "serving {:?}{} on http://{}",
            limits.model_name(),
            if also.is_empty() {
                String::new()
            } else {
                format!(" (also as {})", also.join(", "))
            },
            listener.local_addr()?
        );
        let responses = Arc::new(StatusCounts::default());
        let state = AppState {
            engine,
            limits: Arc::new(limits),
            responses: Arc::clone(&responses),
        };
        let router = app(state).layer(axum::middleware::from_fn_with_state(
            api_key,
            require_api_key,
        ));
        let shutdown = async {
            // Ctrl-C or SIGTERM (what service managers send).
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match &mut term { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
            log::info!("shutting down: finishing open responses");
        };
        // The model loads while the server answers 503 "loading"; if it fails to load,
        // the process ends with the reason rather than answering 503 forever.
        let load_failed = async {
            match tokio::task::spawn_blocking(move || waiter.wait_loaded(None)).await {
                Ok(Ok(())) => std::future::pending().await,
                Ok(Err(why)) => why,
                Err(e) => format!("waiting for the load failed: {e}"),
            }
        };
        tokio::select! {
            served = serve(listener, router, conn, responses, shutdown) => served?,
            why = load_failed => bail!("the model did not load: {why}"),
        }
        // The router (and with it the engine's queue) is gone: the engine finishes what it
        // runs, saves the usage counts and stops. A model still loading is not waited for:
        // the load may take minutes, or wait on a file for ever, and holds nothing to save;
        // the process's exit ends it.
        if loaded.load(Ordering::Acquire) {
            let _ = engine_thread.join();
        } else {
            log::info!("the model had not loaded: not waiting for the load");
        }
        Ok(())
    });
    // Nothing blocking is left to wait for.
    runtime.shutdown_background();
    served
}
