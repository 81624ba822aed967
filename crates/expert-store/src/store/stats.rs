//! Hit, miss, read and wait totals, the read-busy clock, and per-expert use counts.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::open::ExpertStore;
use super::shared::Shared;
use crate::usage::UsageHistory;

/// Totals since the store opened (or since [`ExpertStore::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StoreStats {
    /// Expert uses served from memory.
    pub hits: u64,
    /// Expert uses that needed a read (or joined one in flight).
    pub misses: u64,
    /// Experts read from disk, and their bytes (aligned reads included).
    pub loads: u64,
    /// Bytes of the loads.
    pub bytes_read: u64,
    /// Wall time during which at least one read was in flight.
    pub read_busy: Duration,
    /// Time the forward pass spent blocked waiting for a load.
    pub wait: Duration,
    /// Experts resident now, and their bytes.
    pub resident: u64,
    /// Bytes of the resident experts' buffers.
    pub resident_bytes: u64,
    /// Requests (one per layer per forward step).
    pub requests: u64,
}

impl StoreStats {
    /// Bytes read per second of read-busy time.
    pub fn read_gbps(&self) -> f64 {
        let secs = self.read_busy.as_secs_f64();
        if secs > 0.0 {
            self.bytes_read as f64 / secs / 1e9
        } else {
            0.0
        }
    }

    /// Hits over uses.
    pub fn hit_rate(&self) -> f64 {
        let uses = self.hits + self.misses;
        if uses == 0 {
            0.0
        } else {
            self.hits as f64 / uses as f64
        }
    }
}

impl ExpertStore {
    /// Totals so far.
    pub fn stats(&self) -> StoreStats {
        let s = &self.shared;
        let busy = {
            let busy = s.busy.lock().unwrap_or_else(|p| p.into_inner());
            busy.total
                + if busy.in_flight > 0 {
                    busy.since.elapsed()
                } else {
                    Duration::ZERO
                }
        };
        let cache = s.lock();
        StoreStats {
            hits: s.hits.load(Ordering::Relaxed),
            misses: s.misses.load(Ordering::Relaxed),
            loads: s.loads.load(Ordering::Relaxed),
            bytes_read: s.bytes_read.load(Ordering::Relaxed),
            read_busy: busy,
            wait: Duration::from_nanos(s.wait_ns.load(Ordering::Relaxed)),
            resident: cache.resident(),
            resident_bytes: cache.resident_bytes(),
            requests: s.requests.load(Ordering::Relaxed),
        }
    }

    /// Zeroes the counters (not the residency or the use counts): for timing a phase.
    pub fn reset_stats(&self) {
        let s = &self.shared;
        for counter in [
            &s.hits,
            &s.misses,
            &s.loads,
            &s.bytes_read,
            &s.wait_ns,
            &s.requests,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        s.busy.lock().unwrap_or_else(|p| p.into_inner()).total = Duration::ZERO;
    }

    /// Uses of each expert this run, per checkpoint layer.
    pub fn uses(&self, layer: usize) -> Vec<u64> {
        self.shared
            .layer_pos
            .get(&layer)
            .map(|&pos| {
                self.shared.uses[pos]
                    .iter()
                    .map(|u| u.load(Ordering::Relaxed))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The earlier run's counts plus this run's: what to save for the next start.
    pub fn usage(&self) -> UsageHistory {
        let mut history = self.shared.history.clone();
        for (&layer, &pos) in &self.shared.layer_pos {
            for (expert, uses) in self.shared.uses[pos].iter().enumerate() {
                let n = uses.load(Ordering::Relaxed);
                if n > 0 {
                    history.add(layer, expert, n);
                }
            }
        }
        history
    }
}

impl Shared {
    /// An expert's use count, the usage-weighted policy's priority: the earlier run's plus
    /// this run's.
    pub(super) fn uses_of(&self, layer: usize, expert: usize) -> u64 {
        let pos = self.layer_pos[&layer];
        // Saturating, as the file's counts may be anything (`UsageHistory::add`).
        self.history.count(layer, expert).saturating_add(
            self.uses[pos]
                .get(expert)
                .map_or(0, |u| u.load(Ordering::Relaxed)),
        )
    }

    pub(super) fn busy_change(&self, start: bool) {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if start {
            if busy.in_flight == 0 {
                busy.since = Instant::now();
            }
            busy.in_flight += 1;
        } else {
            busy.in_flight -= 1;
            if busy.in_flight == 0 {
                let elapsed = busy.since.elapsed();
                busy.total += elapsed;
            }
        }
    }
}
