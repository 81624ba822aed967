//! The planner on the tiny checkpoint's sizes, and on sizes shaped like the k3-wide slice
//! written out by hand: every number asserted is derived from the sizes and the budget.

use super::*;
use expert_store::Checkpoint;

use crate::config::K3Config;
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
fn tiny(tag: &str) -> (WeightSizes, MemoryUse, K3Config) {
    with_tiny(tag, |ckpt, config| {
        let sizes = WeightSizes::new(ckpt, config).unwrap();
        let flags = MemoryUse::new(ckpt, config, &options(), run()).unwrap();
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
        limit: false,
    })
}

/// Everything a decode reads, as stored (what the mapping holds), with the state.
fn everything(sizes: &WeightSizes, flags: &MemoryUse) -> u64 {
    flags.kv_cache
        + flags.kda_state
        + flags.f32_copies
        + sizes.trunk_stored_bytes()
        + sizes.expert_total
}

/// The memory of a plan of `io_threads` expert reads in flight with nothing beyond the fixed
/// costs: state, the least trunk layout (one buffer and what must be resident for it), the
/// store's buffers and one selection of experts.
fn minimum(sizes: &WeightSizes, flags: &MemoryUse, io_threads: usize) -> u64 {
    // A request hands out at most one landed expert per I/O thread at once; at the minimum
    // the cache holds no expert, so no free list is counted (one read in flight per thread).
    let selection = sizes
        .top_k
        .min(*sizes.experts_per_layer.iter().max().unwrap())
        .min(io_threads) as u64;
    let least = Layout::minimum(sizes);
    flags.kv_cache
        + flags.kda_state
        + flags.f32_copies
        + least.resident
        + least.buffers
        + (io_threads as u64 + selection) * sizes.expert_largest
}

/// Every read tensor is resident or streamed (whole, or in row blocks that cover its rows in
/// order), never both; the steps follow the forward pass; each fits one buffer.
fn check_layout(sizes: &WeightSizes, trunk: &TrunkPlan) {
    for (layer, t) in sizes.read_tensors() {
        let steps: Vec<&StreamStep> = trunk
            .steps
            .iter()
            .filter(|s| s.layer == layer && s.tensors.iter().any(|b| b.name == t.name))
            .collect();
        let kept: Vec<&StoredTensor> = trunk
            .resident_rows
            .iter()
            .filter(|b| b.name == t.name)
            .collect();
        assert_ne!(
            trunk.resident.contains(&t.name),
            !steps.is_empty() || !kept.is_empty(),
            "{}",
            t.name
        );
        // Resident leading rows only of a matrix read in row blocks, the rest streamed.
        assert!(kept.len() <= 1, "{}", t.name);
        if let Some(k) = kept.first() {
            assert!(t.part.splits() && !steps.is_empty(), "{}", t.name);
            assert!(k.rows % BLOCK_ROWS == 0 && k.rows < t.rows, "{}", t.name);
        }
        let blocks: Vec<&StoredTensor> = kept
            .into_iter()
            .chain(
                steps
                    .iter()
                    .flat_map(|s| s.tensors.iter().filter(|b| b.name == t.name)),
            )
            .collect();
        if !blocks.is_empty() {
            assert_eq!(blocks[0].offset, t.offset, "{}", t.name);
            assert!(
                blocks
                    .windows(2)
                    .all(|w| w[0].offset + w[0].bytes as usize == w[1].offset)
            );
            assert_eq!(
                blocks.iter().map(|b| b.bytes).sum::<u64>(),
                t.bytes,
                "{}",
                t.name
            );
            assert_eq!(
                blocks.iter().map(|b| b.rows).sum::<usize>(),
                t.rows,
                "{}",
                t.name
            );
        }
        if steps.len() > 1 {
            assert!(t.part.splits(), "{} is split but cannot be", t.name);
        }
    }
    for s in &trunk.steps {
        assert!(
            s.tensors
                .iter()
                .all(|t| t.part == s.part && t.part != Part::Copied)
        );
        if let Some(rows) = &s.rows {
            assert!(rows.start % BLOCK_ROWS == 0, "{rows:?}");
            assert!(s.tensors.iter().all(|t| t.rows == rows.len()));
        }
        assert!(read_bytes(&s.tensors) <= trunk.buffer_bytes());
    }
    let order: Vec<(usize, Part)> = trunk.steps.iter().map(|s| (s.layer, s.part)).collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
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
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(all), 0, None).unwrap();
    assert_eq!((plan.trunk.clone(), plan.expert_cache), (None, None));
    assert_eq!(plan.memory, flags);
    assert_eq!(plan.disk_per_token, 0);
    assert!(
        plan.describe().contains("everything fits"),
        "{}",
        plan.describe()
    );
    // One byte less and the plan takes over.
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(all - 1), 0, None).unwrap();
    assert!(plan.trunk.is_some() && plan.expert_cache.is_some());
    // Unknown budget: the same, nothing checked.
    let plan = Plan::new(&sizes, flags, &options(), run(), None, 0, None).unwrap();
    assert_eq!(plan.trunk, None);
}

/// Where everything fits as stored, `resident_everything` holds the trunk resident (packed:
/// less than stored) and every expert, streaming nothing; where the packed trunk and every
/// expert do not fit, or the flags size the cache, or no budget is known, there is none.
#[test]
fn resident_everything_holds_the_packed_trunk_and_every_expert() {
    let (sizes, flags, _) = tiny("everything");
    let all = everything(&sizes, &flags);
    let plan = Plan::resident_everything(&sizes, flags, &options(), run(), budget(all), 0)
        .expect("fits packed where it fits as stored");
    let trunk = plan.trunk.clone().expect("planned");
    assert!(!trunk.streams() && trunk.resident_rows.is_empty());
    assert_eq!(plan.expert_fraction, 1.0);
    assert_eq!(plan.disk_per_token, sizes.embed_row);
    assert!(
        plan.memory.resident_trunk < sizes.trunk_stored_bytes(),
        "packed: {} of {} stored",
        plan.memory.resident_trunk,
        sizes.trunk_stored_bytes()
    );
    // Too small for the packed trunk and every expert: none (`Plan::new` streams instead).
    let tight = plan.memory.resident_trunk + sizes.expert_total / 2;
    assert_eq!(
        Plan::resident_everything(&sizes, flags, &options(), run(), budget(tight), 0),
        None
    );
    // The flags' expert cache, or no budget: none.
    let mut sized = options();
    sized.cache_experts = Some(1);
    assert_eq!(
        Plan::resident_everything(&sizes, flags, &sized, run(), budget(all), 0),
        None
    );
    assert_eq!(
        Plan::resident_everything(&sizes, flags, &options(), run(), None, 0),
        None
    );
}

/// The tiny checkpoint's sizes and flags, and a budget with room for about half the trunk
/// beyond the minimum (and no experts): the trunk-first plan streams the rest.
fn half_the_trunk(tag: &str) -> (WeightSizes, MemoryUse, u64) {
    let (sizes, flags, _) = tiny(tag);
    let bytes = minimum(&sizes, &flags, 16) + sizes.trunk_resident_bytes() / 2;
    (sizes, flags, bytes)
}

#[test]
fn below_everything_the_trunk_is_resident_first_and_the_rest_is_streamed() {
    let (sizes, flags, bytes) = half_the_trunk("streams");
    let plan = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0, None).unwrap();
    let trunk = plan.trunk.clone().expect("planned");
    assert!(plan.streams());
    assert!(plan.memory.total() <= bytes, "{}", plan.describe());
    check_layout(&sizes, &trunk);
    let resident: u64 = sizes
        .read_tensors()
        .filter(|(_, t)| trunk.resident.contains(&t.name))
        .map(|(_, t)| t.resident_bytes())
        .sum();
    assert_eq!(plan.memory.resident_trunk, resident);
    // What is widened at load is neither resident nor streamed.
    let copied = sizes
        .layers
        .iter()
        .flatten()
        .filter(|t| t.part == Part::Copied);
    for t in copied {
        assert!(!trunk.resident.contains(&t.name), "{}", t.name);
    }
    // The buffers hold the largest step; the experts get what is left, the whole budget is
    // used.
    assert_eq!(
        plan.memory.trunk_buffers,
        trunk.slots as u64 * trunk.buffer_bytes()
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
    // No other cap keeps more resident in the same room with as many buffers.
    let m = &plan.memory;
    let room = bytes - (m.kv_cache + m.kda_state + m.f32_copies + m.io_buffers);
    let share = bytes / BUFFER_SHARE;
    // Every cap the planner may take (none below its floor: smaller reads lose disk rate).
    let floor = *Layout::caps(&sizes, share).first().unwrap();
    let caps = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22];
    assert!(
        caps.iter().filter(|&&c| c >= floor).count() >= 3,
        "floor {floor}"
    );
    for cap in caps.into_iter().filter(|&c| c >= floor) {
        for slots in [1, 2] {
            if slots == 2 && cap > share {
                continue;
            }
            if let Some(other) = Layout::new(&sizes, room, cap, slots) {
                check_layout(&sizes, &other.trunk);
                assert!(
                    slots < trunk.slots as u64 || other.resident <= plan.memory.resident_trunk,
                    "cap {cap} slots {slots}: other resident {} buffers {}; {}",
                    other.resident,
                    other.buffers,
                    plan.describe()
                );
                // Two buffers are kept wherever they fit.
                assert!(
                    slots <= trunk.slots as u64,
                    "cap {cap} share {share} room {room} other resident {} buffers {}; {}",
                    other.resident,
                    other.buffers,
                    plan.describe()
                );
            }
        }
    }
}

#[test]
fn a_small_cap_reads_the_lm_head_and_the_dense_mlp_in_row_blocks() {
    let (sizes, _, config) = tiny("blocks");
    let head: Vec<&StoredTensor> = sizes.head.iter().filter(|t| t.part == Part::Head).collect();
    let lm_head = read_bytes(&head.iter().map(|&t| t.clone()).collect::<Vec<_>>());
    // Nothing resident: everything streams in buffers of a quarter of the lm_head.
    let cap = lm_head / 4;
    let forced = forced_bytes(&sizes, cap);
    let layout = Layout::new(&sizes, forced + cap, cap, 1).expect("fits");
    assert_eq!(layout.resident, forced);
    check_layout(&sizes, &layout.trunk);
    let head_steps: Vec<&StreamStep> = layout
        .trunk
        .steps
        .iter()
        .filter(|s| s.part == Part::Head)
        .collect();
    assert!(head_steps.len() >= 4, "{}", head_steps.len());
    assert_eq!(
        head_steps.last().unwrap().rows.as_ref().unwrap().end,
        config.vocab_size
    );
    assert!(layout.trunk.buffer_bytes() <= cap);
    // Units that cannot be split and read more than the cap are resident (their largest
    // tensors, until the rest fits); the dense MLP's matrices are cut too where they exceed it.
    for s in &layout.trunk.steps {
        if !s.part.splits() {
            assert!(read_bytes(&s.tensors) <= cap);
        }
    }
    let dense = layout
        .trunk
        .steps
        .iter()
        .filter(|s| matches!(s.part, Part::Gate | Part::Up | Part::Down))
        .count();
    let dense_layers = sizes
        .layers
        .iter()
        .filter(|l| l.iter().any(|t| t.part == Part::Gate))
        .count();
    assert!(
        dense >= 3 * dense_layers,
        "{dense} steps for {dense_layers} dense layers"
    );
    // The same bytes per token as the whole units read (rounding to pages aside): the cut
    // adds at most two pages per block and tensor.
    let whole: u64 = sizes
        .read_tensors()
        .filter(|(_, t)| !layout.trunk.resident.contains(&t.name))
        .map(|(_, t)| t.resident_bytes())
        .sum();
    let pieces: u64 = layout
        .trunk
        .steps
        .iter()
        .map(|s| s.tensors.len() as u64)
        .sum();
    let streamed = layout.trunk.streamed_read_bytes();
    assert!(streamed <= whole + 2 * 4096 * pieces, "{streamed} {whole}");
}

#[test]
fn a_budget_below_the_minimum_is_refused_with_the_numbers() {
    let (sizes, flags, _) = tiny("minimum");
    let plan = |bytes, margin| {
        Plan::new(
            &sizes,
            flags,
            &options(),
            run(),
            budget(bytes),
            margin,
            None,
        )
    };
    // The reads in flight asked for, halved until their buffers take at most a tenth; two
    // trunk buffers where the second takes at most a tenth of the budget.
    let roomy = 20 * sizes.trunk_resident_bytes().max(48 * sizes.expert_largest);
    // Far more experts than the budget, so that even this budget is planned.
    let many = WeightSizes {
        expert_total: 100 * roomy,
        ..sizes.clone()
    };
    let at = Plan::new(&many, flags, &options(), run(), budget(roomy), 0, None).unwrap();
    // The experts cannot all be resident: the 16 reads asked for drop to
    // STREAMING_IO_THREADS, whose fewer buffers leave more to the cache.
    assert_eq!(
        (at.trunk.as_ref().unwrap().slots, at.io_threads),
        (2, super::STREAMING_IO_THREADS)
    );
    // All of the trunk resident there: nothing to stream, no buffer.
    assert!(!at.streams());
    assert_eq!(at.memory.trunk_buffers, 0);
    // Down to one read in flight and the least layout where the minimum needs it.
    let min = minimum(&sizes, &flags, 1);
    let last = plan(min, 0).unwrap();
    assert_eq!(
        (last.trunk.as_ref().unwrap().slots, last.io_threads),
        (1, 1)
    );
    assert_eq!(last.memory.total(), min);
    check_layout(&sizes, last.trunk.as_ref().unwrap());
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
        "raise the memory limit",
    ] {
        assert!(message.contains(needle), "{needle} not in {message}");
    }
    assert!(
        !message.contains("--"),
        "no flag named in the library: {message}"
    );
    assert_eq!(error.knobs()[0], crate::knob::Knob::MemoryLimit);
    // The margin comes off the budget first, and is named.
    let margin = 1000;
    let error = plan(min + margin - 1, margin).unwrap_err().to_string();
    assert!(error.contains("less a safety margin of"), "{error}");
    assert!(plan(min + margin, margin).is_ok());
}

#[test]
fn the_flags_override_parts_of_the_plan() {
    let (sizes, flags, _) = tiny("flags");
    let min = minimum(&sizes, &flags, 16);
    let bytes = min + sizes.expert_total / 2;
    // --expert-cache-gb: the cache is what was asked; the trunk gets less.
    let cache = sizes.expert_total / 4;
    let asked = ExpertOptions {
        cache_bytes: Some(cache),
        ..options()
    };
    let free = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0, None).unwrap();
    let fixed = Plan::new(&sizes, flags, &asked, run(), budget(bytes), 0, None).unwrap();
    assert_eq!(fixed.memory.expert_cache, cache);
    assert!(fixed.memory.resident_trunk <= free.memory.resident_trunk);
    // --resident-trunk: the whole copy, nothing streamed; refused where it cannot fit.
    let resident_run = RunShape {
        resident_trunk: true,
        ..run()
    };
    let ckpt_flags = MemoryUse {
        resident_trunk: sizes.trunk_resident_bytes() + sizes.embed.next_multiple_of(64),
        ..flags
    };
    let error = Plan::new(
        &sizes,
        ckpt_flags,
        &options(),
        resident_run,
        budget(min),
        0,
        None,
    )
    .unwrap_err();
    assert_eq!(error.knobs(), &[crate::knob::Knob::ResidentTrunk]);
    let error = error.to_string();
    assert!(error.contains("drop the resident trunk copy"), "{error}");
    assert!(
        !error.contains("--"),
        "no flag named in the library: {error}"
    );
    let roomy = min + ckpt_flags.resident_trunk;
    let plan = Plan::new(
        &sizes,
        ckpt_flags,
        &options(),
        resident_run,
        budget(roomy),
        0,
        None,
    )
    .unwrap();
    assert_eq!(plan.trunk, None);
    assert!(!plan.streams());
    assert_eq!(plan.memory.resident_trunk, ckpt_flags.resident_trunk);
    assert_eq!(plan.memory.trunk_buffers, 0);
}

/// Sizes shaped like the k3-wide slice (3 layers; layer 0 dense with 484 MB matrices, five
/// 176 MB attention matrices a layer, MoE blocks of 300 MB, a 2.35 GB lm_head), written out
/// by hand: no checkpoint of that size is needed to plan it.
fn wide_like() -> WeightSizes {
    let mut offset = 0;
    let mut tensor = |name: String, part, bytes: u64, rows| {
        let t = StoredTensor {
            name,
            path: "shard".into(),
            offset,
            bytes,
            part,
            rows,
            pack_cols: None,
            packed_at: None,
            float: None,
            quant: None,
        };
        offset += bytes.next_multiple_of(4096) as usize;
        t
    };
    let mut layers = Vec::new();
    for l in 0..3 {
        let mut layer = vec![tensor(format!("{l}.norm"), Part::Copied, 28_672, 7168)];
        for m in ["q", "k", "v", "g", "o"] {
            layer.push(tensor(
                format!("{l}.{m}"),
                Part::Attention,
                176_160_768,
                12_288,
            ));
        }
        if l == 0 {
            for (m, part) in [("gate", Part::Gate), ("up", Part::Up), ("down", Part::Down)] {
                layer.push(tensor(format!("{l}.{m}"), part, 484_442_112, 33_792));
            }
        } else {
            layer.push(tensor(format!("{l}.moe"), Part::Moe, 300_000_000, 7168));
        }
        layers.push(layer);
    }
    let head = vec![tensor("lm_head".into(), Part::Head, 2_348_810_240, 163_840)];
    WeightSizes {
        head,
        layers,
        embed: 2_348_810_240,
        embed_row: 14_336,
        expert_total: 1_120_000_000,
        expert_largest: 17_500_000,
        experts_per_layer: vec![32, 32],
        top_k: 16,
        packed_side: 0,
    }
}

#[test]
fn a_large_lm_head_streams_in_blocks_and_leaves_the_rest_resident() {
    let sizes = wide_like();
    let flags = MemoryUse::default();
    let mut head_cut = false;
    for bytes in [2_000_000_000, 3_600_000_000, 6_700_000_000] {
        let plan = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0, None).unwrap();
        let trunk = plan.trunk.as_ref().unwrap();
        check_layout(&sizes, trunk);
        // No buffer the size of the lm_head or of a whole layer: the lm_head and the dense
        // matrices are cut, the attention shrinks to the cap by keeping its largest
        // matrices resident.
        let attention_unit = 5 * 176_160_768;
        assert!(
            trunk.buffer_bytes() <= attention_unit,
            "{}",
            plan.describe()
        );
        let head_steps = trunk.steps.iter().filter(|s| s.part == Part::Head).count();
        head_cut |= head_steps > 1;
        assert!(
            trunk.resident.contains("lm_head") || head_steps > 1,
            "{}",
            plan.describe()
        );
        // What is left beside the resident trunk and the buffers is less than the smallest
        // read tensor (nothing more would fit) or went to the experts.
        let smallest = sizes
            .read_tensors()
            .filter(|(_, t)| !trunk.resident.contains(&t.name))
            .map(|(_, t)| t.resident_bytes())
            .min()
            .unwrap();
        assert!(
            plan.memory.expert_cache < smallest,
            "{} left for {smallest}",
            plan.memory.expert_cache
        );
        assert_eq!(
            plan.disk_per_token,
            trunk.streamed_read_bytes()
                + ((2 * 16 * sizes.expert_largest) as f64 * (1.0 - plan.expert_fraction)).round()
                    as u64
                + sizes.embed_row
        );
    }
    assert!(head_cut, "the lm_head streamed in no budget");
    // The least budget needs one buffer of the attention unit (cheaper than keeping all
    // attention resident for a smaller cap), far below the lm_head's 2.35 GB.
    let least = Layout::minimum(&sizes);
    assert_eq!(least.resident + least.buffers, 5 * 176_160_768);
}

#[test]
fn a_packed_trunk_holds_what_the_stored_one_streams() {
    let (sizes, flags, _) = tiny("packed");
    let stored = sizes.clone().unpacked();
    assert!(sizes.trunk_resident_bytes() * 10 < stored.trunk_resident_bytes() * 8);
    assert_eq!(sizes.trunk_stored_bytes(), stored.trunk_resident_bytes());
    // A budget the stored weights miss by a tenth of the trunk: the mapping is not chosen
    // (it holds them as stored), the packed plan keeps every trunk byte and expert resident,
    // the stored plan streams.
    let all = everything(&sizes, &flags) + flags.io_buffers;
    let tight = all - stored.trunk_resident_bytes() / 10;
    let packed = Plan::new(&sizes, flags, &options(), run(), budget(tight), 0, None).unwrap();
    let trunk = packed.trunk.as_ref().expect("a plan, not the mapping");
    assert!(!trunk.streams(), "{}", packed.describe());
    assert_eq!(packed.expert_fraction, 1.0, "{}", packed.describe());
    assert_eq!(
        packed.disk_per_token,
        sizes.embed_row,
        "{}",
        packed.describe()
    );
    assert!(packed.memory.total() <= tight);
    let plain = Plan::new(&stored, flags, &options(), run(), budget(tight), 0, None).unwrap();
    assert!(
        plain.disk_per_token > packed.disk_per_token,
        "{}",
        plain.describe()
    );
}

#[test]
fn the_prompt_cache_is_set_aside_before_the_weights() {
    let (sizes, flags, _) = tiny("prompt-cache");
    // As stored: packed, the trunk and every expert would fit beside the cache here.
    let sizes = sizes.unpacked();
    let all = everything(&sizes, &flags);
    let cache = sizes.trunk_resident_bytes() / 4;
    let with_cache = MemoryUse {
        prompt_cache: cache,
        ..flags
    };
    // Where the weights fit without the cache, its bytes make the plan take over: less than
    // every weight held, within the budget.
    let plan = Plan::new(&sizes, with_cache, &options(), run(), budget(all), 0, None).unwrap();
    assert!(plan.trunk.is_some(), "{}", plan.describe());
    assert!(
        plan.memory.resident_trunk + plan.memory.expert_cache
            < sizes.trunk_resident_bytes() + sizes.expert_total,
        "{}",
        plan.describe()
    );
    assert_eq!(plan.memory.prompt_cache, cache);
    assert!(plan.memory.total() <= all, "{}", plan.describe());
    assert!(
        plan.describe().contains("prompt cache"),
        "{}",
        plan.describe()
    );
    // With room for both, everything fits again.
    let plan = Plan::new(
        &sizes,
        with_cache,
        &options(),
        run(),
        budget(all + cache),
        0,
        None,
    )
    .unwrap();
    assert_eq!(plan.trunk, None, "{}", plan.describe());
    // The minimum alone no longer fits once the cache is set aside: refused, naming it.
    let min = minimum(&sizes, &flags, 1);
    let error = Plan::new(&sizes, with_cache, &options(), run(), budget(min), 0, None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("prompt cache"), "{error}");
}

/// Told the bytes a token's compute hides, a plan whose trunk-first split streams less streams
/// up to them and gives the room that frees to the expert cache; one that already streams as
/// much, and one whose flags size the cache, stand as trunk-first makes them. Either way the
/// plan fits the budget.
#[test]
fn a_hidden_stream_trades_trunk_residency_for_expert_cache() {
    let (sizes, flags, bytes) = half_the_trunk("hiding");
    let first = Plan::new(&sizes, flags, &options(), run(), budget(bytes), 0, None).unwrap();
    let streamed = |p: &Plan| p.trunk.as_ref().map_or(0, TrunkPlan::streamed_read_bytes);
    let s0 = streamed(&first);
    assert!(s0 > 0, "{}", first.describe());
    let hidden = s0 + sizes.expert_total / 4;
    let plan = |hidden, options: &ExpertOptions, run| {
        Plan::new(&sizes, flags, options, run, budget(bytes), 0, Some(hidden)).unwrap()
    };
    let hiding = plan(hidden, &options(), run());
    assert_eq!(hiding.hidden, Some(hidden));
    assert!(hiding.memory.total() <= bytes, "{}", hiding.describe());
    check_layout(&sizes, hiding.trunk.as_ref().unwrap());
    let s = streamed(&hiding);
    assert!(s <= hidden && s > s0, "{s0} -> {s}, hidden {hidden}");
    // What the trunk gave up went to the cache.
    assert!(hiding.memory.expert_cache > first.memory.expert_cache);
    assert!(hiding.memory.resident_trunk < first.memory.resident_trunk);
    assert!(
        hiding.describe().contains("a token's compute hides"),
        "{}",
        hiding.describe()
    );
    // Hiding no more than trunk-first streams changes nothing.
    assert_eq!(
        plan(s0, &options(), run()),
        Plan {
            hidden: None,
            ..first.clone()
        }
    );
    // The flags' cache, or a resident trunk: the plan stands.
    let asked = ExpertOptions {
        cache_bytes: Some(sizes.expert_largest),
        ..options()
    };
    assert_eq!(
        plan(hidden, &asked, run()),
        Plan::new(&sizes, flags, &asked, run(), budget(bytes), 0, None).unwrap()
    );
}

/// The expert store's free list is counted only where the cache holds an expert: without
/// one, the store never holds more buffers than its reads in flight and the landed experts
/// handed out, and the room goes to the trunk.
#[test]
fn the_free_list_is_counted_only_where_the_cache_holds_an_expert() {
    let sizes = wide_like();
    let largest = sizes.expert_largest;
    let plan = |bytes, experts: &ExpertOptions| {
        Plan::new(
            &sizes,
            MemoryUse::default(),
            experts,
            run(),
            budget(bytes),
            0,
            None,
        )
        .unwrap()
    };
    let tight = plan(3_600_000_000, &options());
    assert!(
        tight.expert_cache.unwrap() < largest,
        "{}",
        tight.describe()
    );
    let io = tight.io_threads as u64;
    let free_list = |p: &Plan| expert_store::store::io_buffers(p.io_threads) as u64 * largest;
    // One read in flight and one handed-out expert per I/O thread.
    assert_eq!(tight.memory.io_buffers, 2 * io * largest);
    // A cache the flags size (here 0 bytes) keeps the free list counted, and less of the
    // trunk resident.
    let sized = ExpertOptions {
        cache_bytes: Some(0),
        ..options()
    };
    let counted = plan(3_600_000_000, &sized);
    assert_eq!(
        counted.memory.io_buffers,
        free_list(&counted) + io * largest
    );
    assert!(counted.memory.resident_trunk < tight.memory.resident_trunk);
    let roomy = plan(7_800_000_000, &options());
    assert!(
        roomy.expert_cache.unwrap() >= largest,
        "{}",
        roomy.describe()
    );
    let threads = roomy.io_threads as u64;
    assert_eq!(
        roomy.memory.io_buffers,
        free_list(&roomy) + threads * largest
    );
}

/// The release's requantised bytes per trunk format, by hand from its config.json: a KDA
/// layer's q, k, v and g (`96·128 x 7168`) and o (`7168 x 12288`); an MLA layer's q_a
/// (`1536 x 7168`), q_b (`96·192 x 1536`), kv_a (`576 x 7168`), o and gate (`12288` by `7168`
/// each way); the dense layer's three `33792`-wide projections; each MoE layer's two shared
/// experts (`6144`-wide gate, up, down) and latent down and up (`3584 x 7168`). 69 KDA, 24 MLA,
/// 1 dense and 92 MoE layers. Q8_0 holds 34 bytes and MXFP4 17 per 32 weights; `-all` adds the
/// router (`896 x 7168` a MoE layer), the lm_head (`163840 x 7168`) and KDA's f_a (`128 x
/// 7168`), f_b (`12288 x 128`) and b (`96 x 7168`).
#[test]
fn the_releases_requantised_bytes_are_the_hand_count() {
    let config = K3Config::from_json(crate::synth::RELEASE_CONFIG).unwrap();
    let (hidden, kda_width) = (7168usize, 96 * 128);
    let kda = 5 * kda_width * hidden;
    let mla = 1536 * hidden + 96 * 192 * 1536 + 576 * hidden + 2 * 96 * 128 * hidden;
    let dense = 3 * 33792 * hidden;
    let moe = 3 * 2 * 3072 * hidden + 2 * 3584 * hidden;
    let weights = 69 * kda + 24 * mla + dense + 92 * moe;
    assert_eq!(weights, 53_267_136_512);
    let kept =
        92 * 896 * hidden + 163_840 * hidden + 69 * (128 * hidden + 12288 * 128 + 96 * hidden);
    let sizes = WeightSizes::of_config(&config);
    assert_eq!(sizes.requantised_bytes(), (0, 0));
    for (format, n, bytes) in [
        (TrunkFormat::Q8_0 { all: false }, weights, 34),
        (TrunkFormat::MxFp4 { all: false }, weights, 17),
        (TrunkFormat::Q8_0 { all: true }, weights + kept, 34),
        (TrunkFormat::MxFp4 { all: true }, weights + kept, 17),
    ] {
        let got = sizes.clone().with_trunk_format(format).requantised_bytes();
        assert_eq!(got, (2 * n as u64, (n / 32 * bytes) as u64), "{format}");
    }
}
