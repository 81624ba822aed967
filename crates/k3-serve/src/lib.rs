//! The deployable k3 binary's library: OpenAI-compatible request validation ([`api`]), the
//! engine thread that owns the model (assembled by `k3_model::builder`) and runs batched
//! decode ([`engine`]), the HTTP router with SSE streaming ([`server`]), the connections under
//! it with their deadlines and cap ([`conn`]), the `--api-key` check ([`auth`]), the served
//! model names ([`naming`]), the prompt cache's namespaces and counters ([`prompt_cache`]),
//! the check of `--model`'s directory ([`model_dir`]) and the flag table ([`cli`]: the
//! server's flags and `k3-cli`'s library flags, parsed by `k3-cli`). `main.rs` is the CLI
//! over them.
//!
//! Layers, bottom-up (a module imports only from those before it): `naming`, `model_dir`,
//! `cli`, `prompt_cache`, `auth`, `api`, `engine`, `server`, `conn`.

#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod cli;
pub mod conn;
pub mod engine;
pub mod model_dir;
pub mod naming;
pub mod prompt_cache;
pub mod server;
