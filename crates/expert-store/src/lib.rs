//! Checkpoint access (safetensors shards, typed tensor views) and routed-expert residency: an (layer, expert) -> byte-range table, a bounded cache with parallel miss loads, preload, pinning and usage statistics.
//!
//! Implemented so far: [`checkpoint`], the read side of a checkpoint directory, and
//! [`writer`], safetensors files in the release's layout.

pub mod checkpoint;
pub mod writer;

pub use checkpoint::{Checkpoint, CheckpointError, Dtype, ExpertLocation, TensorRef};
