//! A request keeps at most one read per I/O thread outstanding, so the buffers of a layer's
//! missing experts are bounded by the window, not by how many experts the layer selects; and a
//! request dropped with loads still queued sends them, so a request that joined one gets it.

use std::time::{Duration, Instant};

use expert_store::{Capacity, Checkpoint, ExpertStore, StoreConfig};
use k3_testkit::Scratch;

use crate::checkpoint::{EXPERTS, layout, write_checkpoint};

/// Polls the store's finished loads until `at_least`, or panics after 20 s.
fn wait_for_loads(store: &ExpertStore, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.stats().loads < at_least {
        assert!(
            Instant::now() < deadline,
            "only {} of {at_least} loads finished in 20 s",
            store.stats().loads
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A scratch checkpoint of `EXPERTS` experts and a store over it with `io_threads` I/O
/// threads and no cache (every use a read).
fn store(tag: &str, io_threads: usize) -> (Scratch, Checkpoint, ExpertStore) {
    let dir = Scratch::new(&format!("store-{tag}"));
    write_checkpoint(dir.path(), "");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let config = StoreConfig {
        capacity: Capacity::PerLayer(0),
        io_threads,
        ..StoreConfig::default()
    };
    let store = ExpertStore::open(&ckpt, layout(), config).unwrap();
    (dir, ckpt, store)
}

#[test]
fn a_request_keeps_at_most_one_read_per_io_thread_outstanding() {
    let (_dir, ckpt, store) = store("window", 2);
    assert_eq!(store.window(), 2);
    let experts: Vec<usize> = (0..EXPERTS).collect();
    let mut request = store.request(1, &experts);
    assert_eq!(request.pending(), EXPERTS);
    // The two reads of the window finish; nothing more is read until experts are handed out
    // (the 12 tiny reads of this checkpoint take well under a millisecond together).
    wait_for_loads(&store, 2);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(store.stats().loads, 2, "reads beyond the window went out");
    let mut handed = 0u64;
    let mut seen = [false; EXPERTS];
    loop {
        let batch = request.next_batch();
        if batch.is_empty() {
            break;
        }
        assert!(batch.len() <= store.window(), "a batch of {}", batch.len());
        for (i, expert) in batch {
            let expert = expert.unwrap();
            let base = format!("model.layers.1.block_sparse_moe.experts.{}", experts[i]);
            let mapped = ckpt.mxfp4_matrix(&format!("{base}.w1"), 64, 64).unwrap();
            assert!(expert.matrices()[0].packed() == mapped.packed(), "{base}");
            assert!(!seen[i], "expert {i} handed out twice");
            seen[i] = true;
            handed += 1;
        }
        // Every finished read was handed out, or is one of at most two outstanding.
        let loads = store.stats().loads;
        assert!(
            loads <= handed + 2,
            "{loads} loads with {handed} handed out"
        );
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(store.stats().loads, EXPERTS as u64);
}

#[test]
fn a_dropped_request_sends_what_another_request_joined() {
    let (_dir, ckpt, store) = store("window-drop", 1);
    let experts: Vec<usize> = (0..EXPERTS).collect();
    // One read outstanding: expert 0 (first in the file); 11 waits in the queue...
    let first = store.request(1, &experts);
    // ...and this request joins that queued load instead of starting its own.
    let mut second = store.request(1, &[11]);
    assert_eq!(second.pending(), 1);
    wait_for_loads(&store, 1);
    drop(first);
    // The drop sent the queued loads: 11 lands for the second request.
    wait_for_loads(&store, EXPERTS as u64);
    let batch = second.next_batch();
    assert_eq!(batch.len(), 1);
    assert_eq!(batch[0].0, 0);
    let expert = batch[0].1.as_ref().unwrap();
    let mapped = ckpt
        .mxfp4_matrix("model.layers.1.block_sparse_moe.experts.11.w2", 64, 64)
        .unwrap();
    assert!(expert.matrices()[2].packed() == mapped.packed());
    assert!(second.next_batch().is_empty());
}
