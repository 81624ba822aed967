//! The deployable k3 binary's library: OpenAI-compatible request validation ([`api`]), the
//! engine thread that owns the model and runs batched decode ([`engine`]), and the HTTP router
//! with SSE streaming ([`server`]). `main.rs` is the CLI over them.

pub mod api;
pub mod auth;
pub mod cli;
pub mod engine;
pub mod server;
