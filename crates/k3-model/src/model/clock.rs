//! The decode clock: the compute time of one-token forward passes (wall time less the waits
//! for reads of routed experts and of the trunk stream), kept by an engine for its memory
//! plan's next start (`expert_store::usage::DecodeRates`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Totals of the one-token passes timed so far, the first left out (its reads find nothing
/// resident yet).
#[derive(Debug, Default)]
pub struct DecodeClock {
    compute_ns: AtomicU64,
    steps: AtomicU64,
    first_seen: AtomicBool,
}

impl DecodeClock {
    /// Adds one step's compute time (the first step's is dropped).
    pub fn add(&self, compute: Duration) {
        if !self.first_seen.swap(true, Ordering::Relaxed) {
            return;
        }
        self.compute_ns
            .fetch_add(compute.as_nanos() as u64, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// The mean compute time of a step, once at least `steps` were counted.
    pub fn per_step(&self, steps: u64) -> Option<Duration> {
        let counted = self.steps.load(Ordering::Relaxed);
        (counted >= steps.max(1))
            .then(|| Duration::from_nanos(self.compute_ns.load(Ordering::Relaxed) / counted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_step_is_left_out_and_the_mean_waits_for_enough_steps() {
        let clock = DecodeClock::default();
        clock.add(Duration::from_millis(900));
        assert_eq!(clock.per_step(1), None);
        clock.add(Duration::from_millis(100));
        clock.add(Duration::from_millis(300));
        assert_eq!(clock.per_step(3), None);
        assert_eq!(clock.per_step(2), Some(Duration::from_millis(200)));
    }
}
