//! The build's third phase: the expert store opened with the plan's share of experts (less what
//! a packed trunk took beyond its plan), placed on the domains, and preloaded.

use std::sync::Arc;

use expert_store::ExpertStore;
use numa_sched::RanksError;

use super::options::{BuildError, BuildSink, EngineOptions};
use super::plan::Planned;
use crate::config::K3Config;
use crate::experts::ExpertOptions;
use crate::model::{ExpertPlacement, ModelError};

/// The plan-sized expert cache (`cache`) less `overrun`, the bytes a packed trunk took beyond
/// its plan (`planned`): the cache gives them up; where it cannot (none, or too small), the build is
/// refused with the numbers rather than run past the budget.
pub(super) fn take_overrun(
    cache: Option<u64>,
    overrun: u64,
    planned: u64,
) -> Result<Option<u64>, String> {
    if overrun == 0 {
        return Ok(cache);
    }
    match cache {
        Some(bytes) if bytes >= overrun => Ok(Some(bytes - overrun)),
        _ => Err(format!(
            "the packed trunk holds {} more than the plan's {} (blocks whose exponents span too \
             far are kept as BF16) and the expert cache ({}) cannot give that up; turn off the \
             packed trunk",
            crate::units::gb(overrun),
            crate::units::gb(planned),
            crate::units::gb(cache.unwrap_or(0)),
        )),
    }
}

/// Opens the store the options and the plan ask for (`None`: routed experts come through the
/// mapping); returns it with the expert options it was opened with.
pub(super) fn open_store(
    planned: &Planned,
    config: &K3Config,
    options: &EngineOptions,
    overrun: u64,
    nodes: Vec<Option<usize>>,
    sink: &mut dyn BuildSink,
) -> Result<(Option<Arc<ExpertStore>>, ExpertOptions), BuildError> {
    let Planned {
        checkpoint,
        plan,
        pool,
        ..
    } = planned;
    // Under a plan, the store holds the plan's share of experts, filled at startup.
    let mut experts = options.experts.clone();
    let plan_sized = experts.cache_experts.is_none() && experts.cache_bytes.is_none();
    let cache = plan.expert_cache.filter(|_| plan_sized);
    let cache =
        take_overrun(cache, overrun, plan.memory.resident_trunk).map_err(ModelError::Plan)?;
    if let Some(bytes) = cache {
        experts.cache_bytes = Some(bytes);
        experts.preload = true;
    }
    experts.io_threads = plan.io_threads;
    let store = experts
        .open(
            checkpoint,
            config,
            expert_store::io::memory_available(),
            // The store's I/O threads run on domain 0's CPUs (contract 5: every thread placed).
            &pool.topology().domains[0].cpus,
        )?
        .map(Arc::new);
    if store.is_some() && options.ranks.size() > 1 {
        // The store's batches arrive as loads finish, in an order each rank sees
        // differently; the ranks' collectives must match one for one.
        return Err(RanksError::Unsupported {
            what: "the expert store (an expert cache or a preload)",
            ranks: options.ranks.size(),
        }
        .into());
    }
    if let Some(store) = &store {
        sink.line(&format!(
            "expert store: {:?}, {} I/O threads, {}",
            store,
            experts.io_threads,
            if store.is_direct() {
                "O_DIRECT reads"
            } else {
                "buffered reads"
            }
        ));
        // Experts get home domains (balanced by the usage file's counts) before any load.
        store.place(nodes, options.expert_placement == ExpertPlacement::Split);
        if experts.preload {
            let report = store.preload(|p| sink.preload_progress(p))?;
            sink.line(&format!(
                "preloaded {} experts, {:.2} GB in {:.1} s ({:.2} GB/s)",
                report.experts,
                report.bytes as f64 / 1e9,
                report.elapsed.as_secs_f64(),
                report.gbps()
            ));
        }
    }
    Ok((store, experts))
}
