//! The residency cache as a pure type: which experts are resident or loading, their bytes, and
//! which resident expert makes room for a new one (no I/O, no threads, no locks: the store
//! keeps it behind a mutex and does the reads).
//!
//! Order. Each layer keeps its resident experts ordered by rank = (priority, last use tick):
//! the first goes first. Under [`Policy::Lru`] the priority is 0, so the oldest use goes first;
//! under [`Policy::UsageWeighted`] it is the expert's use count (the caller's number), so the
//! least used goes first, the oldest use breaking ties. A per-layer capacity evicts within the
//! layer that needs room; a byte capacity evicts the lowest rank over all layers. At full
//! residency nothing is ranked or evicted.
//!
//! Loading experts are not ranked, so they are never evicted. Eviction drops only the cache's
//! copy of the data: a caller holding a clone (an `Arc`) keeps it alive.

use std::collections::{BTreeSet, HashMap};

use super::config::{Capacity, Policy};

/// (checkpoint layer, expert id).
pub(super) type Key = (usize, usize);

/// What the cache knows of one expert: its data once landed, or who waits for it.
enum Slot<D, W> {
    Resident {
        data: D,
        bytes: u64,
        /// Its key in the layer's eviction order (absent at full residency).
        rank: (u64, u64),
    },
    Loading {
        waiters: Vec<W>,
    },
}

/// What a request's use of one expert found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Use<D> {
    /// Resident: here is the data (its rank now says "just used").
    Hit(D),
    /// Already loading: the waiter joined the others.
    Joined,
    /// Neither: now loading with this waiter; the caller must start the read.
    Started,
}

/// Resident experts (data `D`, e.g. an `Arc` of the buffer) and loads in flight (waiters `W`).
pub(super) struct Cache<D, W> {
    slots: HashMap<Key, Slot<D, W>>,
    /// Per layer position: resident experts by (priority, last use tick, id).
    order: Vec<BTreeSet<(u64, u64, usize)>>,
    /// Layer position -> checkpoint layer index.
    layer_ids: Vec<usize>,
    resident_per_layer: Vec<usize>,
    resident: u64,
    resident_bytes: u64,
    tick: u64,
    capacity: Capacity,
    /// The capacity holds every expert: nothing is ranked or evicted.
    full: bool,
    policy: Policy,
}

impl<D: Clone, W> Cache<D, W> {
    /// An empty cache over the layers `layer_ids` (position -> checkpoint layer).
    pub(super) fn new(
        layer_ids: Vec<usize>,
        capacity: Capacity,
        full: bool,
        policy: Policy,
    ) -> Self {
        Self {
            slots: HashMap::new(),
            order: layer_ids.iter().map(|_| BTreeSet::new()).collect(),
            resident_per_layer: vec![0; layer_ids.len()],
            layer_ids,
            resident: 0,
            resident_bytes: 0,
            tick: 0,
            capacity,
            full,
            policy,
        }
    }

    /// Experts resident now.
    pub(super) fn resident(&self) -> u64 {
        self.resident
    }

    /// Bytes of the experts resident now.
    pub(super) fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// A request uses `key` (layer position `pos`): a hit re-ranks it as just used; a miss
    /// joins the load in flight or starts one, adding `waiter()`. `uses` is the expert's use
    /// count, counting this use (read only by the usage-weighted policy).
    pub(super) fn use_expert(
        &mut self,
        pos: usize,
        key: Key,
        uses: impl FnOnce() -> u64,
        waiter: impl FnOnce() -> W,
    ) -> Use<D> {
        let tick = self.next_tick();
        match self.slots.get_mut(&key) {
            Some(Slot::Resident { data, rank, .. }) => {
                let data = data.clone();
                if !self.full {
                    let old = *rank;
                    *rank = (priority(self.policy, uses), tick);
                    let new = *rank;
                    self.order[pos].remove(&(old.0, old.1, key.1));
                    self.order[pos].insert((new.0, new.1, key.1));
                }
                Use::Hit(data)
            }
            Some(Slot::Loading { waiters }) => {
                waiters.push(waiter());
                Use::Joined
            }
            None => {
                self.slots.insert(
                    key,
                    Slot::Loading {
                        waiters: vec![waiter()],
                    },
                );
                Use::Started
            }
        }
    }

    /// Marks `key` loading with `waiter()` unless the cache already has it (resident or
    /// loading); true when the caller must start the read.
    pub(super) fn start_load(&mut self, key: Key, waiter: impl FnOnce() -> W) -> bool {
        if self.slots.contains_key(&key) {
            return false;
        }
        self.slots.insert(
            key,
            Slot::Loading {
                waiters: vec![waiter()],
            },
        );
        true
    }

    /// `key`'s load is over (landed or failed): it is no longer loading; returns its waiters.
    pub(super) fn finish_load(&mut self, key: Key) -> Vec<W> {
        match self.slots.remove(&key) {
            Some(Slot::Loading { waiters }) => waiters,
            Some(resident) => {
                // Cannot happen (only one load per key is in flight); keep what is there.
                self.slots.insert(key, resident);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    /// Makes a landed expert (`bytes` of buffer) resident when the capacity allows, evicting
    /// by the policy; false (nothing changed but evictions) when it does not fit. `uses` is its
    /// use count (read only by the usage-weighted policy).
    pub(super) fn admit(
        &mut self,
        pos: usize,
        key: Key,
        data: D,
        bytes: u64,
        uses: impl FnOnce() -> u64,
    ) -> bool {
        if !self.full {
            match self.capacity {
                Capacity::PerLayer(0) => return false,
                Capacity::PerLayer(n) => {
                    while self.resident_per_layer[pos] >= n {
                        if !self.evict_from(pos) {
                            return false;
                        }
                    }
                }
                Capacity::Bytes(budget) => {
                    if bytes > budget {
                        return false;
                    }
                    while self.resident_bytes + bytes > budget {
                        // The globally lowest (priority, tick) among every layer's first.
                        let victim = self
                            .order
                            .iter()
                            .enumerate()
                            .filter_map(|(p, set)| set.first().map(|&(a, b, _)| ((a, b), p)))
                            .min();
                        match victim {
                            Some((_, p)) => {
                                self.evict_from(p);
                            }
                            None => return false,
                        }
                    }
                }
            }
        }
        let rank = if self.full {
            (0, 0)
        } else {
            let tick = self.next_tick();
            let rank = (priority(self.policy, uses), tick);
            self.order[pos].insert((rank.0, rank.1, key.1));
            rank
        };
        self.resident += 1;
        self.resident_bytes += bytes;
        self.resident_per_layer[pos] += 1;
        self.slots.insert(key, Slot::Resident { data, bytes, rank });
        true
    }

    /// Drops the layer's lowest-ranked resident expert; false when it has none.
    fn evict_from(&mut self, pos: usize) -> bool {
        let Some((_, _, expert)) = self.order[pos].pop_first() else {
            return false;
        };
        let layer = self.layer_ids[pos];
        if let Some(Slot::Resident { bytes, .. }) = self.slots.remove(&(layer, expert)) {
            self.resident -= 1;
            self.resident_bytes -= bytes;
            self.resident_per_layer[pos] -= 1;
        }
        true
    }
}

/// The priority part of a rank: `uses` is called only under the usage-weighted policy.
fn priority(policy: Policy, uses: impl FnOnce() -> u64) -> u64 {
    match policy {
        Policy::Lru => 0,
        Policy::UsageWeighted => uses(),
    }
}

#[cfg(test)]
mod tests;
