//! The build's first phase: the checkpoint opened, validated and optionally scanned, the memory
//! plan made against the budget (again with the pack cache's packed sizes where the plan
//! streams BF16 matrices), the kernels chosen and the pool built.

use std::sync::Arc;
use std::time::Instant;

use expert_store::Checkpoint;
use expert_store::io::MemoryBudget;
use expert_store::usage::UsageHistory;
use mxfp4_kernels::Kernels;
use numa_sched::Pool;

use super::calibrate::PackedRate;
use super::options::{BuildError, BuildSink, EngineOptions, PackRule};
use crate::checks::validate::validate;
use crate::config::K3Config;
use crate::knob::Knob;
use crate::model::snapshot::file::checkpoint_identity;
use crate::packcache::place::Outcome;
use crate::packcache::types::PackCache;
use crate::plan::budget::{MemoryUse, RunShape};
use crate::plan::{Plan, WeightSizes};

/// What the first phase leaves for the others.
pub(super) struct Planned {
    pub(super) checkpoint: Checkpoint,
    pub(super) sizes: WeightSizes,
    pub(super) plan: Plan,
    pub(super) pack: Option<Arc<PackCache>>,
    pub(super) kernels: Kernels,
    pub(super) pool: Arc<Pool>,
}

/// Opens and checks the checkpoint in `dir` and plans the run within `budget` (less `margin`).
pub(super) fn plan(
    dir: &std::path::Path,
    config: &K3Config,
    options: &EngineOptions,
    budget: Option<MemoryBudget>,
    margin: u64,
    sink: &mut dyn BuildSink,
) -> Result<Planned, BuildError> {
    // A limit the process runs under (the caller's, a cgroup's), not the host's free memory.
    let limit = budget.as_ref().is_some_and(|b| b.limit);
    let checkpoint = Checkpoint::open(dir)?;
    validate(&checkpoint, config)?;
    let unused = crate::checks::census::unused_layer_tensors(&checkpoint, config);
    if let Some(first) = unused.first() {
        sink.line(&format!(
            "warning: {} tensors of the text layers are not used by this config (the first: \
             {first}): does config.json match the weights?",
            unused.len()
        ));
    }
    crate::shares::same_checkpoint(&checkpoint, config, &options.ranks)?;
    if options.scan {
        let started = Instant::now();
        let report = expert_store::scan::require_finite(&checkpoint)?;
        sink.line_about(
            &format!(
                "weight scan: {} tensors read, none holds NaN, Inf or a 0xFF scale ({:.1} s)",
                report.tensors.len(),
                started.elapsed().as_secs_f64()
            ),
            Knob::Scan,
        );
    }
    // Everything the run allocates against the memory it may use, before allocating it.
    let run = RunShape {
        resident_trunk: options.resident_trunk,
        max_batch: options.max_batch,
        ctx: options.ctx,
    };
    let flags = MemoryUse {
        prompt_cache: options.prompt_cache_bytes,
        ..MemoryUse::new(&checkpoint, config, &options.experts, run)?
    };
    let mut sizes = WeightSizes::new(&checkpoint, config)?;
    if !options.pack_trunk {
        sizes = sizes.unpacked();
    }
    sizes = sizes.with_trunk_format(options.trunk_format);
    // The decode rates an earlier run measured (kept with the usage counts): the streamed
    // bytes a token's compute hides. A file that cannot be read only loses them.
    let hidden = options
        .experts
        .usage_path(checkpoint.dir())
        .and_then(|path| UsageHistory::load(&path).ok().flatten())
        .and_then(|history| history.rates())
        .map(|rates| rates.hidden_bytes());
    let kernels = match options.kernel_tier {
        Some(tier) => Kernels::new(tier)?,
        None => Kernels::detect(),
    };
    let pool = Arc::new(options.pool.build_for(Arc::clone(&options.ranks))?);
    // A requantised trunk is held resident (the mapping and the stream hold stored bytes).
    let plan_for = match sizes.requantised() {
        true => Plan::resident_trunk,
        false => Plan::new,
    };
    let mut plan = plan_for(
        &sizes,
        flags,
        &options.experts,
        run,
        budget.clone(),
        margin,
        hidden,
    )?;
    // The packed trunk where it is faster on this machine: measured now, with every worker
    // busy (`PackRule::Measured`, the binaries' rule), or named by the tier under a limit
    // (`PackRule::Tier`). Under a limit with one domain and one rank, every expert is cached
    // too (the mapping's pages count against the limit and are the kernel's to evict);
    // else the experts are read through the mapping beside the resident trunk.
    let wanted = options.pack_trunk && plan.trunk.is_none() && !sizes.requantised();
    let here = wanted
        && match options.pack_rule {
            PackRule::Tier => limit && kernels.packed_at_memory_rate(),
            PackRule::Always => {
                sink.line_about(
                    "packed trunk: held packed (--pack-trunk), not measured",
                    Knob::PackTrunk,
                );
                true
            }
            // With several ranks every rank measures (at once: the ranks of one host share its
            // read rate, as they will when decoding) and the verdicts are agreed below.
            PackRule::Measured => match PackedRate::measure(&kernels, &pool, config.hidden_size) {
                Ok(rate) => {
                    sink.line_about(&rate.describe(), Knob::PackTrunk);
                    rate.packed_faster()
                }
                Err(why) => {
                    sink.line(&format!(
                        "packed trunk: not measured ({why}); read as stored"
                    ));
                    false
                }
            },
        };
    // The ranks' plans agree: the trunk is held packed (each rank its own rows, see
    // `trunk::load_trunk`) only where every rank would hold it so.
    let packed_here = agreed(&options.ranks, here, sink);
    if packed_here {
        // With `--resident-trunk` the trunk held packed is the resident copy: the flag's copy
        // as stored is not made (`trunk::load_trunk`), so it is not counted either.
        let flags = MemoryUse {
            resident_trunk: 0,
            ..flags
        };
        let run = RunShape {
            resident_trunk: false,
            ..run
        };
        let held = match limit && pool.domains() == 1 && options.ranks.size() == 1 {
            true => Plan::resident_everything(
                &sizes,
                flags,
                &options.experts,
                run,
                budget.clone(),
                margin,
            ),
            false => Plan::resident_trunk(
                &sizes,
                flags,
                &options.experts,
                run,
                budget.clone(),
                margin,
                hidden,
            )
            .ok()
            .filter(|p| p.trunk.as_ref().is_some_and(|t| !t.streams())),
        };
        if let Some(held) = held {
            plan = held;
        }
    }
    // Where the plan streams BF16 matrices, they are read packed from the pack cache
    // (written on the first such run), and the plan is made again with their packed sizes.
    let mut pack = None;
    let streams_packable = plan.trunk.as_ref().is_some_and(|t| {
        t.steps
            .iter()
            .flat_map(|s| &s.tensors)
            .any(|t| t.pack_cols.is_some())
    });
    let dirs = options.pack_cache.dirs(checkpoint.dir());
    // A requantised trunk is read from the cache at every start after the first (its blocks
    // are made once); a cache of one format is never another's (the format is in its
    // identity, so in its name and header).
    let requantised = sizes.requantised();
    if (streams_packable || requantised) && !dirs.is_empty() {
        let identity = match options.trunk_format.quant() {
            None => checkpoint_identity(&checkpoint, config),
            Some(_) => {
                let mut sum = crate::io::checksum::Checksum::new();
                sum.update(&checkpoint_identity(&checkpoint, config).to_le_bytes());
                sum.update(options.trunk_format.name().as_bytes());
                sum.finish()
            }
        };
        let opened = PackCache::open_or_write(
            &dirs,
            identity,
            &sizes.packable(),
            &pool,
            &pool.topology().domains[0].cpus,
        );
        // The plan again with the matrices' packed sizes (which may not fit a budget at
        // the stored plan's minimum: the cache's exception blocks and indexes are held too).
        let packed = opened.map_err(|errors| {
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        });
        let replanned = packed.and_then(|(cache, outcome)| {
            let sizes = cache.sizes_with(sizes.clone());
            match plan_for(&sizes, flags, &options.experts, run, budget, margin, hidden) {
                Ok(plan) => Ok((cache, outcome, sizes, plan)),
                Err(e) => Err(format!("the plan with it: {e}")),
            }
        });
        match replanned {
            Ok((cache, outcome, packed_sizes, packed_plan)) => {
                let (body, bf16) = cache.body_bytes();
                let line = format!(
                    "pack cache: {} ({} of BF16 matrices packed in {}, {} held in memory){}; \
                     {}",
                    cache.path().display(),
                    crate::units::gb(bf16),
                    crate::units::gb(body),
                    crate::units::gb(cache.side_bytes()),
                    match outcome {
                        Outcome::Opened => String::new(),
                        Outcome::Written { why, seconds } => {
                            format!(", written in {seconds:.1} s ({why})")
                        }
                    },
                    match requantised {
                        true => format!("the {} trunk is read from it", options.trunk_format),
                        false => "the streamed matrices are read packed".into(),
                    }
                );
                sink.line_about(&line, Knob::PackCache);
                sizes = packed_sizes;
                plan = packed_plan;
                pack = Some(Arc::new(cache));
            }
            Err(why) => sink.line(&format!(
                "pack cache: not used ({why}); the streamed matrices are read as stored"
            )),
        }
    }
    Ok(Planned {
        checkpoint,
        sizes,
        plan,
        pack,
        kernels,
        pool,
    })
}

/// Whether every rank says `here` (one gather; `here` itself with one rank). A rank that
/// differs is named, since the trunk is then read as stored everywhere.
fn agreed(ranks: &numa_sched::Ranks, here: bool, sink: &mut dyn BuildSink) -> bool {
    if ranks.size() == 1 {
        return here;
    }
    let all = ranks.gather_words(&[u64::from(here)]);
    match all.iter().position(|v| v.first() != Some(&1)) {
        None => true,
        Some(_) if !here => false,
        Some(rank) => {
            sink.line(&format!(
                "packed trunk: rank {rank} reads its rows as stored, so every rank does (their \
                 plans agree)"
            ));
            false
        }
    }
}
