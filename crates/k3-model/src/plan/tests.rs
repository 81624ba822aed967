//! The planner on the tiny checkpoint's sizes: every number below is derived from the sizes
//! and the budget, none is written out.

use super::*;
use crate::synth::{Preset, SynthOptions, generate};

/// `f` over a freshly generated tiny checkpoint (removed after).
fn with_tiny<T>(tag: &str, f: impl FnOnce(&Checkpoint, &K3Config) -> T) -> T {
    let dir = std::env::temp_dir().join(format!("k3-plan-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = generate(&dir, &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let out = f(&ckpt, &config);
    drop(ckpt);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// The tiny checkpoint's sizes and the plan of its flags (nothing asked for: mapped).
fn tiny(tag: &str) -> (WeightSizes, MemoryPlan, K3Config) {
    with_tiny(tag, |ckpt, config| {
        let sizes = WeightSizes::new(ckpt, config).unwrap();
        let flags = MemoryPlan::new(ckpt, config, &options(), run()).unwrap();
        (sizes, flags, config.clone())
    })
}

fn options() -> ExpertOptions {
    ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    }
}

fn run() -> RunShape {
    RunShape {
        resident_trunk: false,
        max_batch: 1,
        ctx: 256,
    }
}

fn budget(bytes: u64) -> Option<MemoryBudget> {
    Some(MemoryBudget {
        bytes,
        source: "a test budget".into(),
    })
}

fn everything(sizes: &WeightSizes, flags: &MemoryPlan) -> u64 {
    flags.kv_cache
        + flags.kda_state
        + flags.f32_copies
        + sizes.trunk_resident_bytes()
        + sizes.expert_total
}

/// The memory of a plan of `slots` layer buffers and `io_threads` expert reads in flight with
/// nothing beyond the fixed costs: state, the trunk buffers, the store's buffers and
/// one selection of experts.
fn minimum(sizes: &WeightSizes, flags: &MemoryPlan, slots: u64, io_threads: usize) -> u64 {
    let selection = sizes
        .top_k
        .min(*sizes.experts_per_layer.iter().max().unwrap()) as u64;
    flags.kv_cache
        + flags.kda_state
        + flags.f32_copies
        + slots * sizes.largest_layer_read()
        + (3 * io_threads as u64 + selection) * sizes.expert_largest
}

#[test]
fn the_sizes_partition_the_checkpoint() {
    with_tiny("sizes", |ckpt, config| {
        let sizes = WeightSizes::new(ckpt, config).unwrap();
        let stored: u64 = sizes
            .head
            .iter()
            .chain(sizes.layers.iter().flatten())
            .map(|t| t.bytes)
            .sum();
        let experts: u64 = ckpt
            .tensor_names()
            .filter(|n| n.contains(".experts."))
            .map(|n| ckpt.tensor(n).unwrap().bytes.len() as u64)
            .sum();
        // Trunk + embedding + experts = every byte of tensor data.
        assert_eq!(stored + sizes.embed + experts, ckpt.data_bytes() as u64);
        assert_eq!(sizes.layers.len(), config.num_layers());
        assert!(sizes.expert_total >= experts, "buffers round out to pages");
        for layer in &sizes.layers {
            assert!(
                layer.windows(2).all(|w| w[0].offset < w[1].offset),
                "file order"
            );
        }
    });
}

#[test]
fn where_everything_fits_the_flags_decide_and_nothing_streams() {
    let (sizes, flags, _) = tiny("fits");
    let all = everything(&sizes, &flags);
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(all), 0).unwrap();
    assert_eq!((plan.trunk.clone(), plan.expert_cache), (None, None));
    assert_eq!(plan.memory, flags);
    assert_eq!(plan.disk_per_token, 0);
    assert!(
        plan.describe().contains("everything fits"),
        "{}",
        plan.describe()
    );
    // One byte less and the plan takes over.
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(all - 1), 0).unwrap();
    assert!(plan.trunk.is_some() && plan.expert_cache.is_some());
    // Unknown budget: the same, nothing checked.
    let plan = Plan::new(&sizes, flags, &options(), run(), None, 0).unwrap();
    assert_eq!(plan.trunk, None);
}

#[test]
fn below_everything_the_trunk_is_resident_first_and_the_rest_is_streamed() {
    let (sizes, flags, _) = tiny("streams");
    let min = minimum(&sizes, &flags, 2, 16);
    let layer_trunk: u64 = sizes
        .layers
        .iter()
        .flatten()
        .map(StoredTensor::resident_bytes)
        .sum();
    // Room for about half the layers' trunk beyond the minimum, and no experts.
    let bytes = min + layer_trunk / 2;
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0).unwrap();
    let trunk = plan.trunk.clone().expect("planned");
    assert!(plan.streams());
    assert!(plan.memory.total() <= bytes, "{}", plan.describe());
    // Every trunk tensor is either resident or streamed, never both.
    for (layer, tensors) in sizes.units().enumerate() {
        for t in tensors {
            let streamed = trunk.streamed[layer].contains(t);
            assert_ne!(trunk.resident.contains(&t.name), streamed, "{}", t.name);
        }
    }
    let resident: u64 = sizes
        .head
        .iter()
        .chain(sizes.layers.iter().flatten())
        .filter(|t| trunk.resident.contains(&t.name))
        .map(StoredTensor::resident_bytes)
        .sum();
    assert_eq!(plan.memory.resident_trunk, resident);
    // First fit: what was left after the trunk is smaller than any streamed tensor; the
    // experts get it and what the buffers no longer need (they hold the largest streamed
    // part, not the largest unit); the whole budget is used.
    let smallest = trunk
        .streamed
        .iter()
        .flatten()
        .map(StoredTensor::resident_bytes)
        .min();
    let largest_streamed = trunk.streamed.iter().map(|u| read_bytes(u)).max().unwrap();
    let slots = trunk.slots as u64;
    assert_eq!(plan.memory.trunk_buffers, slots * largest_streamed);
    let freed = slots * sizes.largest_layer_read() - plan.memory.trunk_buffers;
    assert!(
        plan.memory.expert_cache - freed < smallest.unwrap(),
        "{}",
        plan.describe()
    );
    assert_eq!(plan.memory.total(), bytes);
    let moe = sizes.experts_per_layer.len() as u64;
    let misses =
        (moe * sizes.top_k as u64 * sizes.expert_largest) as f64 * (1.0 - plan.expert_fraction);
    assert_eq!(
        plan.disk_per_token,
        trunk.streamed_read_bytes() + misses.round() as u64 + sizes.embed_row
    );
    assert!(
        plan.describe().contains("predicted from disk"),
        "{}",
        plan.describe()
    );
}

#[test]
fn a_budget_below_the_minimum_is_refused_with_the_numbers() {
    let (sizes, flags, _) = tiny("minimum");
    let plan = |bytes, margin| Plan::new(&sizes, flags, &options(), run(), budget(bytes), margin);
    // Two trunk buffers where the second takes at most a tenth of the budget, else one; the
    // reads in flight asked for, halved until their buffers take at most a tenth.
    let roomy = 20 * sizes.largest_layer_read().max(48 * sizes.expert_largest);
    // Far more experts than the budget, so that even this budget is planned.
    let many = WeightSizes {
        expert_total: 100 * roomy,
        ..sizes.clone()
    };
    let at = Plan::new(&many, flags, &options(), run(), budget(roomy), 0).unwrap();
    assert_eq!((at.trunk.as_ref().unwrap().slots, at.io_threads), (2, 16));
    let tight = 5 * sizes.largest_layer_read();
    let one = plan(tight, 0).unwrap();
    let io = one.io_threads as u64;
    assert_eq!(one.trunk.as_ref().unwrap().slots, 1);
    assert!(
        io == 1 || 3 * io * sizes.expert_largest <= tight / 10,
        "{io}"
    );
    assert!(
        io == 16 || 3 * 2 * io * sizes.expert_largest > tight / 10,
        "{io}"
    );
    // Down to one of each where the minimum needs it.
    let min = minimum(&sizes, &flags, 1, 1);
    let last = plan(min, 0).unwrap();
    assert_eq!(
        (last.trunk.as_ref().unwrap().slots, last.io_threads),
        (1, 1)
    );
    assert_eq!(last.memory.total(), min);
    let error = plan(min - 1, 0).unwrap_err();
    let PlanError::BelowMinimum { minimum: floor, .. } = &error else {
        panic!("{error}")
    };
    assert_eq!(floor.total(), min);
    let message = error.to_string();
    for needle in [
        &gb(min - 1),
        &gb(min),
        "a test budget",
        "trunk stream buffers",
        "--memory-gb",
    ] {
        assert!(message.contains(needle), "{needle} not in {message}");
    }
    // The margin comes off the budget first, and is named.
    let margin = 1000;
    let error = plan(min + margin - 1, margin).unwrap_err().to_string();
    assert!(error.contains("less a safety margin of"), "{error}");
    assert!(plan(min + margin, margin).is_ok());
}

#[test]
fn the_flags_override_parts_of_the_plan() {
    let (sizes, flags, _) = tiny("flags");
    let min = minimum(&sizes, &flags, 2, 16);
    let bytes = min + sizes.expert_total / 2;
    // --expert-cache-gb: the cache is what was asked; the trunk gets less.
    let cache = sizes.expert_total / 4;
    let asked = ExpertOptions {
        cache_bytes: Some(cache),
        ..options()
    };
    let free = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0).unwrap();
    let fixed = Plan::new(&sizes, flags, &asked, run(), budget(bytes), 0).unwrap();
    assert_eq!(fixed.memory.expert_cache, cache);
    assert!(fixed.memory.resident_trunk <= free.memory.resident_trunk);
    // --resident-trunk: the whole copy, nothing streamed; refused where it cannot fit.
    let resident_run = RunShape {
        resident_trunk: true,
        ..run()
    };
    let ckpt_flags = MemoryPlan {
        resident_trunk: sizes.trunk_resident_bytes() + sizes.embed.next_multiple_of(64),
        ..flags
    };
    let error = Plan::new(&sizes, ckpt_flags, &options(), resident_run, budget(min), 0)
        .unwrap_err()
        .to_string();
    assert!(error.contains("drop --resident-trunk"), "{error}");
    let roomy = min + ckpt_flags.resident_trunk;
    let plan = Plan::new(
        &sizes,
        ckpt_flags,
        &options(),
        resident_run,
        budget(roomy),
        0,
    )
    .unwrap();
    assert_eq!(plan.trunk, None);
    assert!(!plan.streams());
    assert_eq!(plan.memory.resident_trunk, ckpt_flags.resident_trunk);
    assert_eq!(plan.memory.trunk_buffers, 0);
}
