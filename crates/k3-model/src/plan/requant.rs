//! The plan of a trunk a lossy `--trunk-format` requantises: held resident, never streamed or
//! read through the mapping (which hold the stored bytes).

use expert_store::io::MemoryBudget;

use super::{ExpertOptions, MemoryUse, Plan, PlanError, RunShape, WeightSizes};
use crate::units::gb;

impl Plan {
    /// The plan for `sizes` where a lossy `--trunk-format` requantises some matrices
    /// ([`WeightSizes::with_trunk_format`]): planned as [`Plan::new`] plans any budget that
    /// does not hold everything as stored (the mapping holds stored bytes, so it is never
    /// the plan), and refused where a requantised matrix would be streamed rather than held.
    pub fn requantised(
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
