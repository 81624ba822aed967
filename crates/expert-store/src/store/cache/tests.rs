//! The eviction order's unit tests: LRU and usage-weighted victims, per-layer and byte
//! capacities, loads in flight, held experts, full residency.

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
