//! Where a forward pass's wall time goes, by bucket (`Model::with_profile`; the decode
//! bench's `--profile`): each bucket is timed on the thread that drives the pass around a
//! whole phase (its pool dispatch included), so the buckets plus "other" add up to the step.
//! Timing only: it never touches the arithmetic, so the logits are the same bits with or
//! without it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::inventory::{BytePlan, TensorClass};

/// A phase of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    /// KDA: the six projections, the conv/recurrence, the gated output projection.
    Kda,
    /// Gated MLA: the projections and the gated output (the attention between them is
    /// [`Bucket::MlaAttention`]).
    Mla,
    /// Gated MLA's attention over the latent caches (scores, softmax, weighted latents, the
    /// absorbed projections per head) and, under several ranks, the gather of the heads.
    MlaAttention,
    /// The dense MLP of the first layers.
    DenseMlp,
    /// Top-k selection, and the router GEMV where the layer has no latent projection (with
    /// one, the GEMV shares the latent down-projection's dispatch and is timed there).
    Router,
    /// Latent down/up projections (the down one with the router GEMV) and the latent norm.
    Latent,
    /// The shared experts.
    SharedExperts,
    /// Routed experts' compute (resident or once loaded).
    RoutedExperts,
    /// Waiting for the expert store to land a missing expert.
    LoadWait,
    /// The final norm and lm_head.
    LmHead,
}

impl Bucket {
    /// Every bucket, in the order a profile prints them (and [`Profile::totals`] returns them).
    pub const ALL: [Bucket; 10] = [
        Bucket::Kda,
        Bucket::Mla,
        Bucket::MlaAttention,
        Bucket::DenseMlp,
        Bucket::Router,
        Bucket::Latent,
        Bucket::SharedExperts,
        Bucket::RoutedExperts,
        Bucket::LoadWait,
        Bucket::LmHead,
    ];

    /// The bucket as a profile prints it.
    pub fn name(self) -> &'static str {
        match self {
            Bucket::Kda => "KDA",
            Bucket::Mla => "MLA",
            Bucket::MlaAttention => "MLA attention over the cache",
            Bucket::DenseMlp => "dense MLP",
            Bucket::Router => "router",
            Bucket::Latent => "latent projections",
            Bucket::SharedExperts => "shared experts",
            Bucket::RoutedExperts => "routed experts",
            Bucket::LoadWait => "load waits",
            Bucket::LmHead => "lm_head",
        }
    }

    /// The weights this bucket reads for one decoded token (0 for load waits).
    pub fn bytes_per_token(self, plan: &BytePlan) -> usize {
        let class = |c: TensorClass| {
            plan.by_class
                .iter()
                .find(|(k, _)| *k == c)
                .map_or(0, |(_, b)| *b)
        };
        match self {
            Bucket::Kda => class(TensorClass::KdaAttention),
            Bucket::Mla => class(TensorClass::MlaAttention),
            Bucket::DenseMlp => class(TensorClass::DenseMlp),
            // With a latent projection the router GEMV runs (and is timed) with it.
            Bucket::Router if class(TensorClass::LatentProjections) > 0 => 0,
            Bucket::Router => class(TensorClass::Router),
            Bucket::Latent => match class(TensorClass::LatentProjections) {
                0 => 0,
                latent => latent + class(TensorClass::Router),
            },
            Bucket::SharedExperts => class(TensorClass::SharedExperts),
            Bucket::RoutedExperts => plan.routed_bytes_per_token,
            // The cache, not weights.
            Bucket::MlaAttention | Bucket::LoadWait => 0,
            Bucket::LmHead => class(TensorClass::LmHead),
        }
    }
}

/// Accumulated nanoseconds per bucket (atomics: a model is shared across threads).
#[derive(Debug, Default)]
pub struct Profile {
    nanos: [AtomicU64; Bucket::ALL.len()],
}

impl Profile {
    /// Every bucket at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Charges `elapsed` to `bucket` (from any thread).
    pub fn add(&self, bucket: Bucket, elapsed: Duration) {
        self.nanos[bucket as usize].fetch_add(
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Runs `f`, charging its wall time to `bucket`.
    pub fn time<T>(&self, bucket: Bucket, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.add(bucket, start.elapsed());
        out
    }

    /// The time charged to each bucket so far, in [`Bucket::ALL`] order.
    pub fn totals(&self) -> [Duration; Bucket::ALL.len()] {
        std::array::from_fn(|i| Duration::from_nanos(self.nanos[i].load(Ordering::Relaxed)))
    }

    /// Sets every bucket back to zero (between a warm-up and the measured run).
    pub fn reset(&self) {
        for n in &self.nanos {
            n.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_accumulate_and_reset() {
        let p = Profile::new();
        p.add(Bucket::Mla, Duration::from_micros(3));
        let v = p.time(Bucket::Mla, || {
            std::thread::sleep(Duration::from_millis(2));
            7
        });
        assert_eq!(v, 7);
        let t = p.totals();
        assert!(t[Bucket::Mla as usize] >= Duration::from_micros(2003));
        assert_eq!(t[Bucket::Kda as usize], Duration::ZERO);
        p.reset();
        assert!(p.totals().iter().all(|d| d.is_zero()));
    }
}
