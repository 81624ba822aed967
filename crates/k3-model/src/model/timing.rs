//! A model's timing of its own passes: the waits for reads (routed experts, the trunk stream),
//! and the compute time of one-token passes added to its decode clock.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::forward::Model;

/// A pass being timed: its start and the model's waits so far.
pub(super) struct PassTimer {
    start: Instant,
    waited_ns: u64,
}

impl Model<'_> {
    /// Routed experts this model has asked its source for so far: one per layer and distinct
    /// expert of each pass, whatever number of the pass's tokens chose it (each is read once
    /// per pass). Times an expert's bytes, what a pass reads of the experts.
    pub fn experts_read(&self) -> u64 {
        self.experts_asked.load(Ordering::Relaxed)
    }

    /// Runs `wait` (blocking on a read), adding its wall time to the model's waits.
    pub(super) fn waiting<T>(&self, wait: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = wait();
        self.waited_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Starts timing a pass of `tokens` tokens, if it is one token and a clock is kept.
    pub(super) fn pass_timer(&self, tokens: usize) -> Option<PassTimer> {
        (tokens == 1 && self.clock.is_some()).then(|| PassTimer {
            start: Instant::now(),
            waited_ns: self.waited_ns.load(Ordering::Relaxed),
        })
    }

    /// Adds a timed pass to the clock: its wall time less what it waited for reads.
    pub(super) fn pass_done(&self, timer: PassTimer) {
        let Some(clock) = &self.clock else { return };
        let waited = self.waited_ns.load(Ordering::Relaxed) - timer.waited_ns;
        clock.add(
            timer
                .start
                .elapsed()
                .saturating_sub(Duration::from_nanos(waited)),
        );
    }
}
