//! The Kimi K3 model: config parsing, trunk weights, KDA, gated MLA, attention residuals, latent MoE, the per-sequence Session, decode and chunked prefill, tokenizer, chat rendering and sampling.
//!
//! Implemented so far: [`config`], the typed and validated `config.json`; [`inventory`],
//! every tensor the config implies with its byte plan; [`checkpoint`], validation of a
//! checkpoint against the config; [`synth`], synthetic checkpoints in the release's layout;
//! [`ops`], the forward pass's primitives (norms, AttnRes mix, router, KDA gate/conv/step);
//! [`model`], the forward pass and `Session`; [`profile`], its wall time by bucket; [`experts`], the expert-store options the
//! binaries share; [`budget`], the memory plan checked at startup; [`plan`], the budget split over it; [`census`], bytes per
//! storage format and tensor class.

#![warn(missing_docs)]

pub mod budget;
pub mod builder;
pub mod census;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod experts;
pub mod inventory;
pub(crate) mod io;
pub mod knob;
pub mod model;
pub mod ops;
pub mod packcache;
pub mod plan;
pub mod profile;
pub mod sampling;
pub mod shares;
pub mod synth;
pub mod tokenizer;
pub(crate) mod units;

pub use config::{AttentionKind, ConfigError, FfnKind, K3Config, KdaGate};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
