//! Routed experts served by the `ExpertStore`: the same logits bits for every cache capacity,
//! policy, preload and thread count as experts read through the mapping; the store's
//! statistics, usage file, preload choice and failure behaviour on the `tiny` preset.

use std::sync::Arc;

use expert_store::{
    Capacity, Checkpoint, ExpertStore, Policy, StoreConfig, StoreError, UsageHistory,
};
use k3_model::config::K3Config;
use k3_model::model::{Model, expert_layout, fingerprint};
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;

fn tiny(tag: &str, router_skew: f32) -> (Scratch, K3Config) {
    let dir = Scratch::new(&format!("streamed-{tag}"));
    let options = SynthOptions {
        seed: 3,
        router_skew,
        ..SynthOptions::new(Preset::Tiny)
    };
    let report = generate(dir.path(), &options).unwrap();
    (dir, report.config)
}

const TOKENS: [usize; 12] = [1, 500, 17, 42, 1023, 7, 7, 300, 64, 65, 900, 2];

/// Step-by-step fingerprints, then the same tokens scored in chunks of 5 (each must match).
fn fingerprints(model: &Model<'_>) -> Vec<u64> {
    let mut session = model.session();
    let stepped: Vec<u64> = TOKENS
        .iter()
        .map(|&t| fingerprint(&model.decode_step(&mut session, t).unwrap()))
        .collect();
    let mut session = model.session();
    let chunked: Vec<u64> = model
        .score(&mut session, &TOKENS, 5)
        .unwrap()
        .iter()
        .map(|l| fingerprint(l))
        .collect();
    assert_eq!(chunked, stepped, "chunked scoring through the store");
    stepped
}

fn config(capacity: Capacity, policy: Policy) -> StoreConfig {
    StoreConfig {
        capacity,
        policy,
        io_threads: 3,
        ..StoreConfig::default()
    }
}

#[test]
fn every_cache_capacity_gives_the_mapped_bits() {
    let (scratch, cfg) = tiny("caps", 0.0);
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let kernels = Kernels::detect();
    let mapped = fingerprints(&Model::new(&ckpt, &cfg, kernels).unwrap());
    let experts = cfg.moe.num_experts;
    let moe_layers = cfg
        .layers
        .iter()
        .filter(|l| l.ffn == k3_model::config::FfnKind::Moe)
        .count();
    let cases = [
        (Capacity::PerLayer(0), Policy::Lru, false),
        (Capacity::PerLayer(1), Policy::Lru, false),
        (Capacity::PerLayer(3), Policy::UsageWeighted, false),
        (Capacity::PerLayer(3), Policy::Lru, true),
        (Capacity::Bytes(1), Policy::Lru, false),
        (Capacity::Bytes(200_000), Policy::UsageWeighted, true),
        (Capacity::PerLayer(experts), Policy::Lru, false),
        (Capacity::PerLayer(experts), Policy::Lru, true),
    ];
    for (capacity, policy, preload) in cases {
        for threads in [1, 2] {
            let store = Arc::new(
                ExpertStore::open(&ckpt, expert_layout(&cfg), config(capacity, policy)).unwrap(),
            );
            if preload {
                store.preload(|_| {}).unwrap();
            }
            let pool = Arc::new(numa_sched::Pool::new(threads).unwrap());
            let model = Model::with_expert_store(&ckpt, &cfg, kernels, Arc::clone(&store))
                .unwrap()
                .with_pool(pool)
                .with_parallel_threshold(0);
            let what = format!("{capacity:?} {policy:?} preload {preload}, {threads} threads");
            assert_eq!(fingerprints(&model), mapped, "{what}");
            let stats = store.stats();
            // Two passes over TOKENS (stepped, chunked): each step or chunk asks each MoE
            // layer once.
            let requests = (TOKENS.len() + TOKENS.len().div_ceil(5)) * moe_layers;
            assert_eq!(stats.requests as usize, requests, "{what}");
            match capacity {
                Capacity::PerLayer(0) | Capacity::Bytes(1) => {
                    assert_eq!((stats.hits, stats.resident), (0, 0), "{what}");
                    assert_eq!(stats.loads, stats.misses, "{what}: one read per use");
                }
                Capacity::PerLayer(n) if n == experts && preload => {
                    // Every read was the preload's.
                    assert_eq!(
                        (stats.misses, stats.loads as usize),
                        (0, experts * moe_layers),
                        "{what}"
                    );
                    assert_eq!(stats.resident as usize, experts * moe_layers, "{what}");
                }
                Capacity::PerLayer(n) => {
                    assert!(
                        stats.resident as usize <= n * moe_layers,
                        "{what}: {stats:?}"
                    );
                    assert!(stats.hits > 0, "{what}: a cache that never hits: {stats:?}");
                }
                Capacity::Bytes(b) => {
                    assert!(stats.resident_bytes <= b, "{what}: {stats:?}");
                    assert!(stats.hits > 0, "{what}: {stats:?}");
                }
            }
            assert!(stats.bytes_read >= stats.loads * 4096, "{what}: {stats:?}");
        }
    }
}

#[test]
fn preload_takes_the_hottest_experts_of_an_earlier_run() {
    let (scratch, cfg) = tiny("usage", 0.0);
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let store = ExpertStore::open(
        &ckpt,
        expert_layout(&cfg),
        config(Capacity::PerLayer(2), Policy::UsageWeighted),
    )
    .unwrap();
    let (layer, experts) = store.layers().next().unwrap();
    assert_eq!(experts, cfg.moe.num_experts);
    let mut history = UsageHistory::default();
    history.add(layer, 5, 100);
    history.add(layer, 2, 50);
    history.add(layer, 7, 1);
    let path = scratch.path().join(expert_store::usage::USAGE_FILE);
    history.save(&path).unwrap();
    let history = UsageHistory::load(&path).unwrap().unwrap();
    let store = ExpertStore::open(
        &ckpt,
        expert_layout(&cfg),
        StoreConfig {
            history: Some(history.clone()),
            ..config(Capacity::PerLayer(2), Policy::UsageWeighted)
        },
    )
    .unwrap();
    let report = store.preload(|_| {}).unwrap();
    let moe_layers = store.layers().count();
    assert_eq!(report.experts, 2 * moe_layers);
    // Experts 5 and 2 of `layer` are resident: asking for them reads nothing.
    let mut request = store.request(layer, &[5, 2]);
    assert_eq!(request.pending(), 0);
    assert_eq!(request.next_batch().len(), 2);
    assert_eq!(store.stats().loads, 2 * moe_layers as u64);
    // Expert 7 is not: it is read, and the usage-weighted policy evicts 2 (fewer uses than 5).
    let mut request = store.request(layer, &[7]);
    assert_eq!(request.pending(), 1);
    let landed = request.next_batch();
    assert!(landed[0].1.is_ok());
    assert_eq!(store.request(layer, &[5]).pending(), 0);
    assert_eq!(store.request(layer, &[2]).pending(), 1);
    // This run's uses are added to the earlier counts.
    let usage = store.usage();
    assert_eq!(usage.count(layer, 5), 102);
    assert_eq!(usage.count(layer, 7), 2);
}

#[test]
fn a_bad_read_fails_that_request_and_the_store_carries_on() {
    let (scratch, cfg) = tiny("badread", 0.0);
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    // The expert stored last in the last file: every other expert lies before it.
    let table = ckpt.expert_table(&expert_layout(&cfg)).unwrap();
    let ((layer, expert), last) = table
        .iter()
        .max_by_key(|(_, loc)| (loc.path.clone(), loc.offset))
        .map(|(k, v)| (*k, v.clone()))
        .unwrap();
    let store = ExpertStore::open(
        &ckpt,
        expert_layout(&cfg),
        config(Capacity::PerLayer(0), Policy::Lru),
    )
    .unwrap();
    // Cut the file 10 bytes into that expert (what follows it is never touched here).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&last.path)
        .unwrap()
        .set_len((last.offset + 10) as u64)
        .unwrap();
    let other = (0..cfg.moe.num_experts).find(|&e| e != expert).unwrap();
    let mut request = store.request(layer, &[expert, other]);
    let mut landed = Vec::new();
    loop {
        let batch = request.next_batch();
        if batch.is_empty() {
            break;
        }
        landed.extend(batch);
    }
    landed.sort_by_key(|(i, _)| *i);
    let err = landed[0].1.as_ref().unwrap_err().to_string();
    let file = last
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        err.contains(&file)
            && err.contains(&format!("layer {layer} expert {expert}"))
            && err.contains("short read"),
        "{err}"
    );
    assert!(
        landed[1].1.is_ok(),
        "the other expert of the request still lands"
    );
    // The store keeps serving.
    let mut again = store.request(layer, &[other]);
    assert!(again.next_batch()[0].1.is_ok());
    // An expert the checkpoint lacks is an error, not a panic.
    let missing = store
        .request(layer, &[cfg.moe.num_experts + 3])
        .next_batch();
    assert!(matches!(missing[0].1, Err(StoreError::NoExpert { .. })));
}

#[test]
fn a_cache_larger_than_memory_is_refused_with_the_numbers() {
    let (scratch, cfg) = tiny("toolarge", 0.0);
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let err = ExpertStore::open(
        &ckpt,
        expert_layout(&cfg),
        StoreConfig {
            memory_limit: Some(100_000),
            ..config(Capacity::PerLayer(8), Policy::Lru)
        },
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            StoreError::TooLarge {
                available: 100_000,
                ..
            }
        ) && text.contains("100000")
            && text.contains("experts per layer"),
        "{text}"
    );
    // A store whose shapes disagree with the config is refused by the model.
    let mut other = cfg.clone();
    other.moe.expert_intermediate = 32;
    let wrong = expert_layout(&other);
    let store = Arc::new(ExpertStore::open(&ckpt, wrong, StoreConfig::default()).unwrap());
    assert!(Model::with_expert_store(&ckpt, &cfg, Kernels::detect(), store).is_err());
}

#[test]
fn a_resharded_checkpoint_with_experts_across_shards_gives_the_same_bits() {
    let (scratch, cfg) = tiny("reshard-src", 0.0);
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let kernels = Kernels::detect();
    let original = fingerprints(&Model::new(&ckpt, &cfg, kernels).unwrap());
    let expert_bytes = k3_model::inventory::expert_bytes(&cfg);
    // Shards of about a third of an expert, tensors shuffled: experts straddle files, and
    // within a file their tensors lie apart.
    let copy = Scratch::new("streamed-resharded");
    let report = expert_store::writer::reshard(
        scratch.path(),
        copy.path(),
        expert_store::writer::ReshardLayout {
            max_shard_bytes: expert_bytes / 3,
            shuffle_seed: Some(11),
        },
    )
    .unwrap();
    let resharded = Checkpoint::open(copy.path()).unwrap();
    let table = resharded.expert_table(&expert_layout(&cfg)).unwrap();
    let spanning = table.values().filter(|l| l.spans_shards()).count();
    assert!(
        spanning * 2 > table.len(),
        "{spanning} of {} experts span shards ({} shards)",
        table.len(),
        report.shards
    );
    k3_model::checks::validate(&resharded, &cfg).unwrap();
    let mapped = fingerprints(&Model::new(&resharded, &cfg, kernels).unwrap());
    assert_eq!(mapped, original, "mapped, re-sharded");
    for (capacity, preload) in [
        (Capacity::PerLayer(0), false),
        (Capacity::PerLayer(cfg.moe.num_experts), true),
    ] {
        let store = Arc::new(
            ExpertStore::open(
                &resharded,
                expert_layout(&cfg),
                config(capacity, Policy::Lru),
            )
            .unwrap(),
        );
        if preload {
            store.preload(|_| {}).unwrap();
        }
        let model =
            Model::with_expert_store(&resharded, &cfg, kernels, Arc::clone(&store)).unwrap();
        assert_eq!(
            fingerprints(&model),
            original,
            "streamed, re-sharded, {capacity:?}"
        );
        assert!(store.stats().loads > 0);
    }
}
