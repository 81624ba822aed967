//! The read probe's size under a memory limit.

use super::*;

/// Finding 3 of issue 31: the read probe is allocated beside the memory plan, so under a
/// limit (a cgroup's, `--memory-gb`) it runs only where it fits what the plan leaves (the
/// margin kept); a plan that fills the limit, as one in a cgroup of 0.9x the model does,
/// turns the default 512 MiB probe off with the numbers. Without a limit, as before.
#[test]
fn the_read_probe_runs_under_a_memory_limit_only_where_it_fits_beside_the_plan() {
    use expert_store::io::MemoryBudget;
    use k3_model::plan::MemoryUse;
    const MIB: u64 = 1 << 20;
    let probe = 512 * MIB;
    let plan = |bytes: u64, limit: bool, margin: u64, planned: u64| Plan {
        memory: MemoryUse {
            expert_cache: planned,
            ..MemoryUse::default()
        },
        budget: Some(MemoryBudget {
            bytes,
            source: "a memory cgroup (test)".into(),
            limit,
        }),
        margin,
        trunk: None,
        expert_cache: None,
        expert_fraction: 0.0,
        disk_per_token: 0,
        io_threads: 1,
        hidden: None,
    };
    let gb = 1_000_000_000;
    // A plan that fills the limit less its margin leaves nothing.
    let full = plan(7 * gb, true, 250_000_000, 7 * gb - 250_000_000);
    let why = probe_bytes(probe, &full).unwrap_err();
    assert!(
        why.starts_with("off: its 512 MiB")
            && why.contains("0.000 GB the memory plan leaves of the 7.000 GB limit")
            && why.contains("a memory cgroup (test)"),
        "{why}"
    );
    // Room for it beside the plan, and the margin kept: on; a byte less: off.
    let roomy = plan(7 * gb, true, 250_000_000, 7 * gb - 250_000_000 - probe);
    assert_eq!(probe_bytes(probe, &roomy), Ok(probe));
    assert!(probe_bytes(probe + 1, &roomy).is_err());
    assert!(probe_bytes(64 * MIB, &full).is_err());
    // Not a limit (the host's free memory), or no budget known: the probe as asked.
    assert_eq!(
        probe_bytes(probe, &plan(7 * gb, false, 0, 7 * gb)),
        Ok(probe)
    );
    let unknown = Plan {
        budget: None,
        ..full.clone()
    };
    assert_eq!(probe_bytes(probe, &unknown), Ok(probe));
    // --probe-mb 0 is off whatever the plan.
    assert_eq!(probe_bytes(0, &roomy), Err("--probe-mb 0".into()));
}
