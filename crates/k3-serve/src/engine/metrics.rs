//! The engine's counters, read by `/metrics` ([`Metrics`]).

use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};

use expert_store::StoreStats;

use crate::prompt_cache::PromptCacheStats;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests admitted to the engine.
    pub requests: AtomicU64,
    /// Requests refused with 429 (the queue was full).
    pub rejected: AtomicU64,
    /// Prompt tokens of admitted requests (cached ones included).
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Live jobs waiting for a batch slot (kept by the queue).
    pub queue_depth: Arc<AtomicI64>,
    /// Sequences in the running batch.
    pub active: AtomicI64,
    /// Nanoseconds spent in decode steps (tokens/s = generated / this).
    pub decode_ns: AtomicU64,
    /// The expert store's counters (`None` until the model has loaded).
    pub store: Mutex<Option<StoreStats>>,
    /// The prompt cache's counters (`None`: the cache is off).
    pub prompt_cache: Mutex<Option<PromptCacheStats>>,
}
