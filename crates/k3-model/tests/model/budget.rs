//! The memory plan: each class counted from the checkpoint and the run's shape, and a plan
//! over the budget refused with the numbers — inside a real memory cgroup smaller than the
//! plan where this machine lets the test make one (cgroup v1, as root).

use std::path::{Path, PathBuf};
use std::process::Command;

use expert_store::io::{MemoryBudget, memory_budget};
use expert_store::{Checkpoint, ExpertStore};
use k3_model::config::{AttentionKind, K3Config};
use k3_model::experts::ExpertOptions;
use k3_model::inventory::{TensorClass, text_tensors};
use k3_model::plan::{MemoryUse, RunShape};
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;

fn tiny(tag: &str) -> (Scratch, K3Config) {
    let dir = Scratch::new(&format!("budget-{tag}"));
    let report = generate(dir.path(), &SynthOptions::new(Preset::Tiny)).unwrap();
    (dir, report.config)
}

/// The run the cgroup test refuses: a server on the tiny checkpoint with the trunk resident,
/// every expert cached, 64 sequences of 4096 tokens (a KV cache of about 100 MB).
fn big_run() -> (ExpertOptions, RunShape) {
    let experts = ExpertOptions {
        cache_bytes: Some(1_000_000_000),
        usage_cache: false,
        ..ExpertOptions::default()
    };
    let run = RunShape {
        resident_trunk: true,
        max_batch: 64,
        ctx: 4096,
    };
    (experts, run)
}

#[test]
fn every_class_is_counted_from_the_checkpoint_and_the_run() {
    let (scratch, cfg) = tiny("classes");
    let mut ckpt = Checkpoint::open(scratch.path()).unwrap();
    let (experts, run) = big_run();
    let plan = MemoryUse::new(&ckpt, &cfg, &experts, run).unwrap();
    // The trunk is exactly what make_resident copies.
    let trunk: std::collections::HashSet<String> = text_tensors(&cfg)
        .into_iter()
        .filter(|t| t.class != TensorClass::RoutedExperts)
        .map(|t| t.name)
        .collect();
    let copied = ckpt
        .make_resident(|stored| {
            trunk.contains(stored.strip_prefix("language_model.").unwrap_or(stored))
        })
        .unwrap();
    assert_eq!(plan.resident_trunk, copied as u64);
    // A full cache holds what a full preload reads; the store's buffers are 4 per I/O thread
    // (2 free, 1 read in flight, 1 landed expert handed out).
    let store = ExpertStore::open(
        &ckpt,
        k3_model::model::expert_layout(&cfg),
        expert_store::StoreConfig::default(),
    )
    .unwrap();
    let report = store.preload(|_| {}).unwrap();
    assert_eq!(plan.expert_cache, report.bytes);
    // Buffers are counted at the largest expert's size (experts straddle 3 or 4 pages).
    let one = ckpt
        .expert_table(&k3_model::model::expert_layout(&cfg))
        .unwrap()
        .values()
        .map(expert_store::store::buffer_bytes)
        .max()
        .unwrap();
    assert_eq!(plan.io_buffers, 4 * 16 * one);
    // KV: latent + rope rows of every MLA layer, f32, for every sequence's every token.
    let mla = cfg.layers_of(AttentionKind::Mla).len() as u64;
    let row = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) as u64 * 4;
    assert_eq!(plan.kv_cache, 64 * 4096 * mla * row);
    let kda = cfg.layers_of(AttentionKind::Kda).len() as u64;
    assert!(plan.kda_state >= 64 * kda * (cfg.kda.num_heads * cfg.kda.head_dim.pow(2)) as u64 * 4);
    assert!(plan.f32_copies > 0);
    assert_eq!(
        plan.total(),
        plan.resident_trunk
            + plan.expert_cache
            + plan.io_buffers
            + plan.kv_cache
            + plan.kda_state
            + plan.f32_copies
    );
    // Without the flags: no trunk copy, no store, one sequence.
    let small = MemoryUse::new(
        &ckpt,
        &cfg,
        &ExpertOptions::default(),
        RunShape {
            resident_trunk: false,
            max_batch: 1,
            ctx: 4096,
        },
    )
    .unwrap();
    assert_eq!(
        (small.resident_trunk, small.expert_cache, small.io_buffers),
        (0, 0, 0)
    );
    assert_eq!(small.kv_cache * 64, plan.kv_cache);
    // A per-layer capacity counts that many experts of each MoE layer.
    let per_layer = MemoryUse::new(
        &ckpt,
        &cfg,
        &ExpertOptions {
            cache_experts: Some(2),
            ..ExpertOptions::default()
        },
        run,
    )
    .unwrap();
    let moe_layers = store.layers().count() as u64;
    assert_eq!(per_layer.expert_cache, 2 * moe_layers * one);
}

#[test]
fn a_plan_over_the_budget_names_every_class_the_total_and_the_source() {
    let (scratch, cfg) = tiny("over");
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let (experts, run) = big_run();
    let plan = MemoryUse::new(&ckpt, &cfg, &experts, run).unwrap();
    let budget = MemoryBudget {
        bytes: plan.total() - 1,
        source: "cgroup v1 /sys/fs/cgroup/memory/test".into(),
        limit: true,
    };
    let over = plan.check(Some(budget.clone())).unwrap_err();
    // What to turn, as options the binaries name by their flags.
    assert!(over.knobs().contains(&k3_model::knob::Knob::MaxBatch));
    let err = over.to_string();
    for needle in [
        "resident trunk",
        "expert cache",
        "I/O buffers",
        "KV cache",
        "KDA state",
        "GB",
        "cgroup v1 /sys/fs/cgroup/memory/test",
        "the batch size",
    ] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    let fits = MemoryBudget {
        bytes: plan.total(),
        ..budget
    };
    assert_eq!(plan.check(Some(fits)).unwrap(), plan);
    assert_eq!(plan.check(None).unwrap(), plan);
}

/// Removes the cgroup when the test ends (after its child has exited).
struct Group(PathBuf);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

const CHILD_GROUP: &str = "K3_BUDGET_TEST_CGROUP";
const CHILD_MODEL: &str = "K3_BUDGET_TEST_MODEL";
const LIMIT: u64 = 64 << 20;

#[test]
fn inside_a_memory_cgroup_smaller_than_the_plan_startup_refuses_without_an_oom_kill() {
    let root = Path::new("/sys/fs/cgroup/memory");
    if !root.join("cgroup.procs").exists() {
        println!(
            "no cgroup v1 memory hierarchy at {}: not run here",
            root.display()
        );
        return;
    }
    let group = root.join(format!("k3-budget-test-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&group) {
        println!(
            "cannot create a memory cgroup at {} ({e}): not run here",
            group.display()
        );
        return;
    }
    let group = Group(group);
    if let Err(e) = std::fs::write(group.0.join("memory.limit_in_bytes"), LIMIT.to_string()) {
        println!("cannot set the cgroup's limit ({e}): not run here");
        return;
    }
    let (scratch, _) = tiny("cgroup");
    // The child is this test binary running only the child half below, which moves itself
    // into the group before it opens anything.
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "budget::child_startup_inside_the_cgroup",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_GROUP, &group.0)
        .env(CHILD_MODEL, scratch.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child {:?} (a signal 9 is the OOM killer)\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let refused = stdout
        .lines()
        .find_map(|l| l.find("refused: ").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no refusal in the child's output: {stdout}"));
    assert!(
        refused.contains(&format!("cgroup v1 {}", group.0.display()))
            && refused.contains("memory.limit_in_bytes 67108864")
            && refused.contains("KV cache")
            && refused.contains("resident trunk"),
        "{refused}"
    );
    assert!(stdout.contains("a plan that fits: accepted"), "{stdout}");
    // The group never ran out: no OOM event was recorded.
    let failcnt = std::fs::read_to_string(group.0.join("memory.failcnt")).unwrap_or_default();
    println!("{refused}\nmemory.failcnt {}", failcnt.trim());
}

/// The child half of the cgroup test (does nothing when run on its own).
#[test]
fn child_startup_inside_the_cgroup() {
    let (Some(group), Some(model)) = (std::env::var_os(CHILD_GROUP), std::env::var_os(CHILD_MODEL))
    else {
        println!("runs only as the child of the cgroup test");
        return;
    };
    let group = PathBuf::from(group);
    std::fs::write(group.join("cgroup.procs"), std::process::id().to_string()).unwrap();
    // The startup path of the binaries: config, checkpoint, validation, then the plan against
    // the budget before anything large is allocated.
    let model = PathBuf::from(model);
    let config =
        K3Config::from_json(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let ckpt = Checkpoint::open(&model).unwrap();
    k3_model::checks::validate(&ckpt, &config).unwrap();
    let budget = memory_budget().unwrap();
    assert!(budget.bytes <= LIMIT, "{budget:?}");
    let (experts, run) = big_run();
    let plan = MemoryUse::new(&ckpt, &config, &experts, run).unwrap();
    assert!(plan.total() > LIMIT, "{}", plan.describe());
    let err = plan.check(Some(budget.clone())).unwrap_err();
    println!("refused: {err}");
    let fits = MemoryUse::new(
        &ckpt,
        &config,
        &experts,
        RunShape {
            max_batch: 1,
            ..run
        },
    )
    .unwrap();
    fits.check(Some(budget)).unwrap();
    println!("a plan that fits: accepted ({})", fits.describe());
}
