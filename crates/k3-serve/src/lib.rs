//! The deployable k3 binary's library: OpenAI-compatible request validation ([`api`]), the
//! engine thread that owns the model and runs batched decode ([`engine`]), the HTTP router
//! with SSE streaming ([`server`]), and the connections under it with their deadlines and cap
//! ([`conn`]). `main.rs` is the CLI over them.

pub mod api;
pub mod conn;
pub mod engine;
pub mod server;
