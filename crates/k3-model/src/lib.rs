//! The Kimi K3 model: config parsing, trunk weights, KDA, gated MLA, attention residuals,
//! latent MoE, the per-sequence `Session`, decode and chunked prefill, tokenizer, chat rendering
//! and sampling, and the one builder every binary assembles an engine with.
//!
//! In layers, each importing only from those below it (a test of the workspace checks that no
//! file imports one that imports it back):
//! 1. what the model is: [`config`] (the validated `config.json`), [`inventory`] (every tensor
//!    the config implies and its byte plan), [`knob`] (the options a person turns), and the
//!    leaves [`tokenizer`], [`chat`], [`sampling`], [`ops`] (the forward pass's primitives),
//!    [`profile`], [`speculate`] (drafts for speculative decoding and their length);
//! 2. [`checks`]: a checkpoint validated against the config, and its format census;
//!    [`experts`]: the expert store's options; [`synth`]: synthetic checkpoints in the
//!    release's layout;
//! 3. [`plan`]: the memory a run takes ([`plan::MemoryUse`]) and the budget split over it;
//! 4. bulk I/O (chunked reads, packing, the atomic file writer) and the pack cache, internal;
//! 5. [`model`]: the forward pass, `Session`, snapshots;
//! 6. [`builder`]: config + checkpoint + options into a ready engine.

#![warn(missing_docs)]

pub mod builder;
pub mod chat;
pub mod checks;
pub mod config;
pub mod experts;
pub mod inventory;
mod io;
pub mod knob;
pub mod model;
pub mod ops;
mod packcache;
pub mod plan;
pub mod profile;
pub mod sampling;
mod shares;
pub mod speculate;
pub mod synth;
pub mod tokenizer;
mod units;

pub use config::{AttentionKind, ConfigError, FfnKind, K3Config, KdaGate};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
