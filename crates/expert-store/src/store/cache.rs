//! The residency cache: which experts are resident or loading, and which one makes room.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;

use super::Shared;
use super::buffer::{Expert, ExpertData};
use super::config::{Capacity, Policy, Result};
use crate::io::{AlignedBuf, memlock_limit};

/// What the cache knows of one expert.
pub(super) enum Slot {
    Resident {
        data: Arc<ExpertData>,
        /// Its key in the layer's eviction order (absent at full residency).
        rank: (u64, u64),
    },
    Loading {
        waiters: Vec<(Sender<Landed>, usize)>,
    },
}

pub(super) type Landed = (usize, Result<Expert>);

pub(super) struct Cache {
    pub(super) slots: HashMap<(usize, usize), Slot>,
    /// Per layer (index into `layers`): resident experts by (priority, last use tick).
    pub(super) order: Vec<BTreeSet<(u64, u64, usize)>>,
    pub(super) resident_per_layer: Vec<usize>,
    pub(super) resident: u64,
    pub(super) resident_bytes: u64,
    pub(super) tick: u64,
}

impl Cache {
    pub(super) fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

impl Shared {
    pub(super) fn priority(&self, layer: usize, expert: usize) -> u64 {
        match self.policy {
            Policy::Lru => 0,
            Policy::UsageWeighted => {
                let pos = self.layer_pos[&layer];
                self.history.count(layer, expert)
                    + self.uses[pos]
                        .get(expert)
                        .map_or(0, |u| u.load(Ordering::Relaxed))
            }
        }
    }

    /// Makes a landed expert resident when the capacity allows, evicting by the policy.
    pub(super) fn admit(&self, cache: &mut Cache, key: (usize, usize), data: &Arc<ExpertData>) {
        let (layer, expert) = key;
        let pos = self.layer_pos[&layer];
        let bytes = data.bytes();
        if !self.full {
            match self.capacity {
                Capacity::PerLayer(0) => return,
                Capacity::PerLayer(n) => {
                    while cache.resident_per_layer[pos] >= n {
                        if !self.evict_from(cache, pos) {
                            return;
                        }
                    }
                }
                Capacity::Bytes(budget) => {
                    if bytes > budget {
                        return;
                    }
                    while cache.resident_bytes + bytes > budget {
                        // The globally lowest (priority, tick) among every layer's first.
                        let victim = cache
                            .order
                            .iter()
                            .enumerate()
                            .filter_map(|(p, set)| set.first().map(|&(a, b, _)| ((a, b), p)))
                            .min();
                        match victim {
                            Some((_, p)) => {
                                self.evict_from(cache, p);
                            }
                            None => return,
                        }
                    }
                }
            }
        }
        let rank = if self.full {
            (0, 0)
        } else {
            let tick = cache.next_tick();
            let rank = (self.priority(layer, expert), tick);
            cache.order[pos].insert((rank.0, rank.1, expert));
            rank
        };
        if self.mlock.load(Ordering::Relaxed)
            && let Some(Err(e)) = data.buf.as_ref().map(AlignedBuf::lock)
            && self.mlock.swap(false, Ordering::Relaxed)
        {
            let limit = memlock_limit().map_or("unknown".to_string(), |l| {
                if l == libc::RLIM_INFINITY {
                    "unlimited".to_string()
                } else {
                    format!("{l} bytes")
                }
            });
            log::warn!(
                "mlock of expert buffers failed ({e}); RLIMIT_MEMLOCK is {limit}. Experts stay resident but may be swapped; to pin them raise the limit (ulimit -l unlimited, or LimitMEMLOCK=infinity in a systemd unit, or run with CAP_IPC_LOCK). Not trying again."
            );
        }
        cache.resident += 1;
        cache.resident_bytes += bytes;
        cache.resident_per_layer[pos] += 1;
        cache.slots.insert(
            key,
            Slot::Resident {
                data: Arc::clone(data),
                rank,
            },
        );
    }

    /// Drops the layer's lowest-ranked resident expert; false when it has none.
    pub(super) fn evict_from(&self, cache: &mut Cache, pos: usize) -> bool {
        let Some((_, _, expert)) = cache.order[pos].pop_first() else {
            return false;
        };
        let layer = self.layer_ids[pos];
        if let Some(Slot::Resident { data, .. }) = cache.slots.remove(&(layer, expert)) {
            cache.resident -= 1;
            cache.resident_bytes -= data.bytes();
            cache.resident_per_layer[pos] -= 1;
        }
        true
    }
}
