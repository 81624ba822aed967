//! Several domains (`Topology::split`, what `--numa-fake N` builds): row blocks spread over
//! the domains, experts on their home domains, heads split — and the logits bits of one
//! domain, for 1-4 domains x 1-2 threads, step by step and chunked, with experts mapped or
//! served by a placed expert store.

use std::sync::Arc;

use expert_store::{Capacity, Checkpoint, ExpertStore, StoreConfig};
use k3_model::model::{ExpertPlacement, Model, expert_layout, fingerprint};
use k3_model::synth::{Preset, SynthOptions, generate};
use mxfp4_kernels::Kernels;
use numa_sched::{Pool, Threads, Topology};

const TOKENS: [usize; 10] = [1, 500, 17, 42, 1023, 7, 7, 300, 64, 65];

fn fingerprints(model: &Model<'_>, chunk: usize) -> Vec<u64> {
    let mut session = model.session();
    model
        .score(&mut session, &TOKENS, chunk)
        .unwrap()
        .iter()
        .map(|l| fingerprint(l))
        .collect()
}

#[test]
fn fake_domains_and_thread_counts_give_the_same_bits() {
    let dir = std::env::temp_dir().join(format!("k3-numa-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = SynthOptions {
        seed: 5,
        ..SynthOptions::new(Preset::Tiny)
    };
    let config = generate(&dir, &options).unwrap().config;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let kernels = Kernels::detect();
    let reference = fingerprints(&Model::new(&ckpt, &config, kernels).unwrap(), 1);
    let cpus: Vec<usize> = (0..2).collect();
    for domains in 1..=4 {
        for threads in [1, 2] {
            let topology = Topology::split(&cpus, domains, Vec::new());
            let nodes: Vec<Option<usize>> = topology.domains.iter().map(|d| d.node).collect();
            let pool = Arc::new(Pool::with_topology(topology, Threads::Total(threads)).unwrap());
            assert_eq!(pool.domains(), domains);
            let what = format!("{domains} domains, {threads} threads");
            // Threshold 0: every projection, head group and expert is split into tasks.
            let mapped = Model::new(&ckpt, &config, kernels)
                .unwrap()
                .with_pool(Arc::clone(&pool))
                .with_parallel_threshold(0);
            assert_eq!(fingerprints(&mapped, 1), reference, "{what}, step by step");
            assert_eq!(fingerprints(&mapped, 4), reference, "{what}, chunks of 4");
            let homed = Model::new(&ckpt, &config, kernels)
                .unwrap()
                .with_pool(Arc::clone(&pool))
                .with_parallel_threshold(0)
                .with_expert_placement(ExpertPlacement::Home);
            assert_eq!(
                fingerprints(&homed, 2),
                reference,
                "{what}, experts on home domains"
            );
            let store = ExpertStore::open(
                &ckpt,
                expert_layout(&config),
                StoreConfig {
                    capacity: Capacity::PerLayer(3),
                    io_threads: 2,
                    ..StoreConfig::default()
                },
            )
            .unwrap();
            assert!(store.place(nodes, false));
            let (layer, experts) = store.layers().next().unwrap();
            let homes: Vec<usize> = (0..experts).map(|e| store.home(layer, e)).collect();
            assert!(homes.iter().all(|&h| h < domains), "{what}: {homes:?}");
            if domains <= experts {
                // No earlier counts: round-robin.
                assert_eq!(homes, (0..experts).map(|e| e % domains).collect::<Vec<_>>());
            }
            let streamed = Model::with_expert_store(&ckpt, &config, kernels, Arc::new(store))
                .unwrap()
                .with_pool(pool)
                .with_parallel_threshold(0)
                .with_expert_placement(ExpertPlacement::Home);
            assert_eq!(
                fingerprints(&streamed, 3),
                reference,
                "{what}, expert store"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
