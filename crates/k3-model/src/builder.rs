//! The one place an engine is assembled: config + checkpoint directory + [`EngineOptions`] →
//! a ready [`Engine`] (checkpoint opened and validated, optionally scanned, the memory plan
//! checked against the budget, the worker pool built, the trunk optionally copied resident with
//! each domain's rows on its node, the expert store opened, placed and preloaded), from which
//! [`Engine::model`] makes the [`Model`] on the pool. Every binary (server, decode bench,
//! examples) builds through here, so they cannot drift apart.
//!
//! It prints nothing: what it did goes to the caller's [`BuildSink`] as lines.
//!
//! The build runs in phases, each in a file of its own: `plan` (checkpoint checks, the memory
//! plan, the pack cache, kernels and pool), `trunk` (the resident trunk), `experts` (the
//! store), `warm` (the mapping read in); `engine` orchestrates them and holds the result.
//!
//! [`Model`]: crate::model::Model

mod calibrate;
mod engine;
mod experts;
mod options;
mod plan;
#[cfg(test)]
mod tests;
mod trunk;
mod warm;

pub use engine::{Engine, RATE_STEPS};
pub use options::{BuildError, BuildSink, EngineOptions, PackRule};

// What the options and the engine hand out, whose homes are internal.
pub use crate::packcache::place::PackCachePlace;
pub use crate::shares::RankShare;
