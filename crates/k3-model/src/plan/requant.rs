//! The plan of a trunk held resident: the one a lossy `--trunk-format` requantises (never
//! streamed or read through the mapping, which hold the stored bytes), or a packed one where
//! packing is faster on the machine at hand.

use expert_store::io::MemoryBudget;

use super::{ExpertOptions, MemoryUse, Plan, PlanError, RunShape, WeightSizes};
use crate::units::gb;

impl Plan {
    /// The plan that holds the trunk of `sizes` resident (requantised where a lossy
    /// `--trunk-format` says, [`WeightSizes::with_trunk_format`], else packed where `sizes`
    /// packs): planned as [`Plan::new`] plans any budget that does not hold everything as
    /// stored (never the mapping), refused where a requantised matrix would be streamed, and
    /// reading the experts through the mapping where they all fit beside it.
    pub fn resident_trunk(
        sizes: &WeightSizes,
        flags: MemoryUse,
        experts: &ExpertOptions,
        run: RunShape,
        budget: Option<MemoryBudget>,
        margin: u64,
        hidden: Option<u64>,
    ) -> Result<Self, PlanError> {
        // With no budget at all (a library caller's), everything is held.
        let budget = budget.unwrap_or_else(|| MemoryBudget {
            bytes: u64::MAX >> 2,
            source: "no budget given".into(),
            limit: false,
        });
        let words = format!("{} ({})", gb(budget.bytes), budget.source);
        let budget = Some(budget);
        let first = sizes
            .read_tensors()
            .find(|(_, t)| t.quant.is_some())
            .map_or(String::new(), |(_, t)| t.name.clone());
        if run.resident_trunk {
            return Err(PlanError::Requantised {
                advice: "drop --resident-trunk",
                budget: words,
                how: "copy as stored (--resident-trunk)",
                tensor: first,
            });
        }
        let plan = Self::make(sizes, flags, experts, run, budget, margin, hidden, false)?;
        let Some(trunk) = &plan.trunk else {
            return Err(PlanError::Requantised {
                advice: "raise the memory limit",
                budget: words,
                how: "map",
                tensor: first,
            });
        };
        let streamed = trunk
            .steps
            .iter()
            .flat_map(|s| &s.tensors)
            .find(|t| t.quant.is_some());
        if let Some(t) = streamed {
            return Err(PlanError::Requantised {
                advice: "raise the memory limit",
                budget: words,
                how: "stream",
                tensor: t.name.clone(),
            });
        }
        // Where every expert fits beside it, the experts are read through the mapping as in
        // the exact run (no store to fill at startup; none is possible across MPI ranks):
        // only the trunk differs between the formats.
        let mut plan = plan;
        let flags_size = experts.cache_experts.is_some() || experts.cache_bytes.is_some();
        if plan.expert_fraction >= 1.0 && !flags_size && !experts.preload {
            plan.expert_cache = None;
            plan.expert_fraction = 0.0;
            plan.memory.expert_cache = 0;
            plan.memory.io_buffers = 0;
        }
        Ok(plan)
    }
}
