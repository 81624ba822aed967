//! Checkpoint access (safetensors shards, typed tensor views) and routed-expert residency: an (layer, expert) -> byte-range table, a bounded cache with parallel miss loads, preload, pinning and usage statistics.
//!
//! - [`checkpoint`]: the read side of a checkpoint directory (mapped shards, typed views, the
//!   expert table).
//! - [`layout`]: a routed expert's matrices and their tensor names, supplied by the caller
//!   (the store knows no model's names).
//! - [`store`]: the routed-expert residency cache over it ([`ExpertStore`]); [`io`] reads
//!   experts from their shards; [`usage`] keeps use counts across runs.
//! - [`scan`]: every weight read once for NaN/Inf and 0xFF E8M0 scales.
//! - [`writer`]: safetensors files in the release's layout, and re-sharding.
//! - [`file`]: opening the files a checkpoint and the command line name: regular files only,
//!   never a wait, small ones read whole up to a cap.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod file;
pub mod io;
pub mod layout;
pub mod scan;
pub mod source;
pub mod store;
pub mod usage;
pub mod writer;

pub use layout::{ExpertLayout, LayoutError, MatrixLayout, NamePattern};
pub use store::{
    Capacity, Expert, ExpertStore, Policy, PreloadProgress, PreloadReport, Request, StoreConfig,
    StoreError, StoreStats,
};
pub use usage::UsageHistory;

pub use checkpoint::{Checkpoint, CheckpointError, Dtype, ExpertLocation, ExpertPiece, TensorRef};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
