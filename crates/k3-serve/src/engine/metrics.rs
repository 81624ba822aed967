//! The engine's counters, read by `/metrics` ([`Metrics`]), and the latency histograms
//! ([`Histogram`]).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// Sequences in the running batch (those being prefilled included).
    pub active: AtomicI64,
    /// Nanoseconds spent in engine steps (tokens/s = generated / this).
    pub decode_ns: AtomicU64,
    /// Engine steps run.
    pub steps: AtomicU64,
    /// Decode tokens fed by the steps (one per running sequence and step).
    pub step_decode_tokens: AtomicU64,
    /// Prompt tokens fed by the steps (prefilled, not restored from the prompt cache).
    pub step_prefill_tokens: AtomicU64,
    /// Output-constraint masks taken (one per constrained token).
    pub masks: AtomicU64,
    /// Nanoseconds spent computing those masks (on their threads, mostly overlapping the
    /// steps' forward passes).
    pub mask_ns: AtomicU64,
    /// Drafted tokens fed to verify passes (speculative decoding).
    pub spec_drafted: AtomicU64,
    /// Drafted tokens the sampler accepted (each the token it drew there).
    pub spec_accepted: AtomicU64,
    /// Verify passes: a sequence's step that fed drafted tokens.
    pub spec_passes: AtomicU64,
    /// Time from a request's arrival to its first token.
    pub ttft: Histogram,
    /// Time between a stream's successive tokens.
    pub itl: Histogram,
    /// Time from a request's arrival to its admission to the running batch.
    pub queue_wait: Histogram,
    /// The expert store's counters (`None` until the model has loaded).
    pub store: Mutex<Option<StoreStats>>,
    /// The prompt cache's counters (`None`: the cache is off).
    pub prompt_cache: Mutex<Option<PromptCacheStats>>,
}

/// The upper bounds, in seconds, of a [`Histogram`]'s buckets (a last one, `+Inf`, takes the
/// rest): from a fast decode step's few milliseconds to a long prompt's minutes of prefill.
pub const BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A latency histogram in Prometheus' form: counts per bucket (not cumulative here; the
/// exposition sums them), the count and the sum.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len() + 1],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Counts one observation.
    pub fn observe(&self, value: Duration) {
        let seconds = value.as_secs_f64();
        let bucket = BUCKETS
            .iter()
            .position(|&le| seconds <= le)
            .unwrap_or(BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The cumulative counts, one per bound of [`BUCKETS`] and a last for `+Inf`; the count;
    /// the sum in seconds.
    pub fn snapshot(&self) -> (Vec<u64>, u64, f64) {
        let mut total = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                total += b.load(Ordering::Relaxed);
                total
            })
            .collect();
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (cumulative, self.count.load(Ordering::Relaxed), sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_buckets_cumulatively() {
        let h = Histogram::default();
        for ms in [1, 5, 6, 80, 400_000] {
            h.observe(Duration::from_millis(ms));
        }
        let (cumulative, count, sum) = h.snapshot();
        assert_eq!(count, 5);
        assert!((sum - 400.092).abs() < 1e-9, "{sum}");
        // <= 5 ms: 1 and 5; <= 10 ms: and 6; <= 100 ms: and 80; 400 s: only +Inf.
        assert_eq!(&cumulative[..3], &[2, 3, 3]);
        assert_eq!(cumulative[5], 4);
        assert_eq!(cumulative[BUCKETS.len() - 1], 4);
        assert_eq!(cumulative[BUCKETS.len()], 5);
    }
}
