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
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Data is an `Arc` (as in the store) so a test can see who still holds it; waiters are
    /// plain numbers.
    type TestCache = Cache<Arc<u64>, u32>;

    const LAYER: usize = 7;

    fn one_layer(capacity: Capacity, policy: Policy) -> TestCache {
        Cache::new(vec![LAYER], capacity, false, policy)
    }

    fn is_resident(cache: &TestCache, key: Key) -> bool {
        matches!(cache.slots.get(&key), Some(Slot::Resident { .. }))
    }

    fn is_loading(cache: &TestCache, key: Key) -> bool {
        matches!(cache.slots.get(&key), Some(Slot::Loading { .. }))
    }

    /// Lands `expert` of `LAYER` (100 bytes) with `uses` uses; whether it became resident.
    fn land(cache: &mut TestCache, expert: usize, uses: u64) -> bool {
        cache.admit(0, (LAYER, expert), Arc::new(expert as u64), 100, || uses)
    }

    /// Experts 0 (5 uses) then 1 (1 use) resident in a layer that holds two, then expert 2
    /// lands: the resident ids left under `policy`.
    fn third_expert_lands(policy: Policy) -> Vec<usize> {
        let mut cache = one_layer(Capacity::PerLayer(2), policy);
        assert!(land(&mut cache, 0, 5));
        assert!(land(&mut cache, 1, 1));
        assert!(land(&mut cache, 2, 1));
        (0..3)
            .filter(|&e| is_resident(&cache, (LAYER, e)))
            .collect()
    }

    #[test]
    fn lru_evicts_the_oldest_use_and_usage_weighted_the_least_used() {
        // Expert 0 is both the oldest and the most used: the two policies disagree on it.
        assert_eq!(third_expert_lands(Policy::Lru), vec![1, 2]);
        assert_eq!(third_expert_lands(Policy::UsageWeighted), vec![0, 2]);
    }

    #[test]
    fn a_hit_makes_an_expert_the_last_lru_victim() {
        let mut cache = one_layer(Capacity::PerLayer(2), Policy::Lru);
        assert!(land(&mut cache, 0, 0));
        assert!(land(&mut cache, 1, 0));
        // Expert 0 was landed first but used last: expert 1 goes.
        assert_eq!(
            cache.use_expert(0, (LAYER, 0), || 0, || 0),
            Use::Hit(Arc::new(0))
        );
        assert!(land(&mut cache, 2, 0));
        assert!(is_resident(&cache, (LAYER, 0)));
        assert!(!is_resident(&cache, (LAYER, 1)));
        assert_eq!(cache.resident(), 2);
        assert_eq!(cache.resident_bytes(), 200);
    }

    #[test]
    fn usage_weighted_breaks_ties_by_the_oldest_use() {
        let mut cache = one_layer(Capacity::PerLayer(2), Policy::UsageWeighted);
        assert!(land(&mut cache, 0, 3));
        assert!(land(&mut cache, 1, 3));
        // Same count; expert 0's rank is refreshed by a use, so expert 1 is now the oldest.
        assert!(matches!(
            cache.use_expert(0, (LAYER, 0), || 3, || 0),
            Use::Hit(_)
        ));
        assert!(land(&mut cache, 2, 9));
        assert!(is_resident(&cache, (LAYER, 0)));
        assert!(!is_resident(&cache, (LAYER, 1)));
    }

    #[test]
    fn a_per_layer_capacity_evicts_within_the_layer_and_bytes_across_layers() {
        // Layer 1's expert is the oldest overall; layer 0 needs room.
        let run = |capacity| {
            let mut cache: TestCache = Cache::new(vec![10, 11], capacity, false, Policy::Lru);
            assert!(cache.admit(1, (11, 0), Arc::new(0), 100, || 0));
            assert!(cache.admit(0, (10, 0), Arc::new(0), 100, || 0));
            assert!(cache.admit(0, (10, 1), Arc::new(0), 100, || 0));
            [(11, 0), (10, 0), (10, 1)].map(|k| is_resident(&cache, k))
        };
        assert_eq!(run(Capacity::PerLayer(1)), [true, false, true]);
        assert_eq!(run(Capacity::Bytes(250)), [false, true, true]);
    }

    #[test]
    fn a_loading_expert_is_never_evicted() {
        let mut cache = one_layer(Capacity::PerLayer(1), Policy::Lru);
        assert_eq!(cache.use_expert(0, (LAYER, 0), || 1, || 40), Use::Started);
        assert_eq!(cache.use_expert(0, (LAYER, 0), || 2, || 41), Use::Joined);
        assert!(!cache.start_load((LAYER, 0), || 42));
        // Two experts land and the second evicts the first; the one in flight stays loading.
        assert!(land(&mut cache, 1, 0));
        assert!(land(&mut cache, 2, 0));
        assert!(!is_resident(&cache, (LAYER, 1)));
        assert!(is_loading(&cache, (LAYER, 0)));
        assert_eq!(cache.resident(), 1);
        // Its waiters are all still there when it lands.
        assert_eq!(cache.finish_load((LAYER, 0)), vec![40, 41]);
        assert!(land(&mut cache, 0, 0));
        assert!(is_resident(&cache, (LAYER, 0)));
        assert!(!is_resident(&cache, (LAYER, 2)));
    }

    #[test]
    fn eviction_drops_only_the_cache_copy_of_a_held_expert() {
        let mut cache = one_layer(Capacity::PerLayer(1), Policy::Lru);
        assert!(land(&mut cache, 0, 0));
        let Use::Hit(held) = cache.use_expert(0, (LAYER, 0), || 0, || 0) else {
            panic!("expert 0 was resident");
        };
        assert_eq!(Arc::strong_count(&held), 2);
        assert!(land(&mut cache, 1, 0));
        assert!(!is_resident(&cache, (LAYER, 0)));
        // The holder's copy is the last one, and still reads the expert's data.
        assert_eq!(Arc::strong_count(&held), 1);
        assert_eq!(*held, 0);
    }

    #[test]
    fn what_does_not_fit_is_not_admitted_and_full_residency_never_evicts() {
        let mut none = one_layer(Capacity::PerLayer(0), Policy::Lru);
        assert!(!land(&mut none, 0, 0));
        assert_eq!(none.resident(), 0);

        let mut small = one_layer(Capacity::Bytes(150), Policy::Lru);
        assert!(land(&mut small, 0, 0));
        // Larger than the whole budget: refused without evicting anything.
        assert!(!small.admit(0, (LAYER, 1), Arc::new(1), 151, || 0));
        assert!(is_resident(&small, (LAYER, 0)));

        let mut full: TestCache = Cache::new(vec![LAYER], Capacity::PerLayer(2), true, Policy::Lru);
        for e in 0..5 {
            assert!(land(&mut full, e, 0));
        }
        assert_eq!(full.resident(), 5);
        assert!(full.order[0].is_empty());
    }
}
