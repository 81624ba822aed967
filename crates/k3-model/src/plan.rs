//! The memory planner (contract 6): one budget split into the classes a run allocates, for a
//! checkpoint that does not fit it. Where everything fits (trunk, every expert, sequence
//! state), weights are read through the file mapping as before and the plan only checks the
//! flags' allocations ([`MemoryUse`]). Where it does not, the plan decides:
//!
//! 1. the fixed costs: sequence state (KV, KDA), the f32 copies made at load, the expert
//!    store's I/O buffers (its free list, one read in flight per I/O thread, and the landed
//!    experts a request hands out at once, at most one per I/O thread: a request keeps no more
//!    reads outstanding); fewer reads in flight where their buffers would take more than a
//!    tenth of the budget;
//! 2. the trunk ([`Layout`]): stream buffers of a size (the cap) and count, and the trunk
//!    bytes resident, to keep the most resident (every trunk byte is read by every token, so
//!    residency is worth more per byte than any expert's). The trunk streams in small units
//!    in forward order (each layer's attention, its dense MLP's gate, up and down or its MoE
//!    block, then the lm_head), a dense MLP's matrices and the lm_head in row blocks of at
//!    most the cap; two buffers where the second takes at most a tenth of the budget, else
//!    one. The least any layout needs, with the fixed costs, is the minimum, and a budget
//!    below it is refused with the numbers; the embedding is never copied (one row of it is
//!    read per token), nor what is widened to f32 at load;
//! 3. the expert cache gets what is left.
//!
//! Trunk tensors left out are streamed from disk every token (`model::trunk`). `--resident-trunk`
//! and `--expert-cache[-gb]` override steps 2 and 3; `--io-threads` sizes the I/O buffers.
//! The planner works on sizes ([`WeightSizes`]), so it is tested without a model.

use expert_store::io::MemoryBudget;

use crate::experts::ExpertOptions;
use crate::knob::Knob;
use crate::units::gb;

pub(crate) mod budget;
mod format;
mod requant;
mod sizes;
mod stream;

pub use budget::{MemoryUse, OverBudget, RunShape};
pub use format::{FloatMatrix, PackAs, QuantFormat, TrunkFormat};

pub use sizes::{
    HeldPacked, MERGE_GAP, PACKED_EXCEPTIONS_PER_10K, PackedAt, Part, StoredTensor, WeightSizes,
    merged_reads, packed_resident_bytes, read_bytes,
};
pub use stream::{BLOCK_ROWS, Layout, MIN_CAP, StreamStep, TrunkPlan, forced_bytes};

/// A second trunk buffer, and the expert store's read buffers, may each take at most
/// 1/`BUFFER_SHARE` of the budget: memory spent on buffers is memory not resident.
pub const BUFFER_SHARE: u64 = 10;

/// Expert reads in flight at most where the trunk or the experts do not all fit. On k3-wide in
/// a cgroup of 1.0x the model (the trunk resident, the experts not), alternating: 2 reads
/// 0.55-0.65 s/token (0.29 GB from disk per token: the buffers 8 reads take go to the expert
/// cache instead), 8 reads 0.74-0.88 (0.53 GB). Measured on k3-wide (3 layers, 32
/// experts of 17.5 MB) in a cgroup of 0.9x the model, 2 threads, the plan otherwise the same,
/// alternating: before a request bounded its outstanding reads, 2 reads 0.89-0.91 s/token,
/// 1 read 0.97, 4 reads 0.98, 8 reads 1.10-1.15. With the bound (4 buffers per read in
/// flight) and the stream spread over the pass, 5 pairs: 2 reads 0.875-0.907 s/token (median
/// 0.877), 4 reads 0.838-1.016 (median 0.889); 2 read 0.936 GB from disk per token, 4 read
/// 1.08 (their buffers keep 0.14 GB less of the trunk resident), and 2 vary less.
pub const STREAMING_IO_THREADS: usize = 2;

/// The safety margin taken off a budget the host reports (not off `--memory-gb`): 0.25 GB
/// plus 0.5%, for what no class counts (activations, the binary, allocator slack, the pages of
/// the embedding rows read through the mapping, page tables: 0.2% of memory mapped in 4 KiB
/// pages). Measured on k3-wide in a cgroup of 7.11 GB (0.9x) with a budget of 6.824 GB (this
/// margin): the bench peaks at 7.03-7.04 GB with the checkpoint's page cache, k3-serve (three
/// chat requests, prompt cache on) at 6.45 GB with 6.08 GB resident, under its plan. It was
/// 0.25 GB + 2%; the 0.1 GB more of expert cache decodes 1-13% faster there.
pub fn safety_margin(budget: u64) -> u64 {
    250_000_000 + budget / 200
}

/// A budget split over a run's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Bytes of each class.
    pub memory: MemoryUse,
    /// What the plan was made against (`None`: unknown, nothing planned or refused).
    pub budget: Option<MemoryBudget>,
    /// Taken off the budget before splitting it (see [`safety_margin`]).
    pub margin: u64,
    /// `None`: everything fits, the weights are read through the mapping as the flags say.
    pub trunk: Option<TrunkPlan>,
    /// The expert store's capacity in bytes the plan sets (`None`: the flags decide).
    pub expert_cache: Option<u64>,
    /// The expert store's capacity as a fraction of every expert.
    pub expert_fraction: f64,
    /// Bytes predicted to come from disk per decoded token once the cache is warm.
    pub disk_per_token: u64,
    /// Expert reads in flight at once (`--io-threads`, fewer where the budget is tight).
    pub io_threads: usize,
    /// The streamed trunk bytes a token's compute hides, where an earlier run measured it
    /// ([`Plan::new`]) and the plan streamed up to it to cache more experts.
    pub hidden: Option<u64>,
}

/// Why no plan fits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The budget, less the margin, is below the least any trunk layout needs with the fixed costs
    /// (sequence state, f32 copies, expert read buffers at one read in flight).
    #[error(
        "the memory budget of {} ({}{}) is below this run's minimum of {}: {}; raise the memory \
         limit, or lower the batch size, the context length or the expert reads in flight",
        gb(budget.bytes),
        budget.source,
        margin_words(*margin),
        gb(minimum.total()),
        minimum.describe()
    )]
    BelowMinimum {
        /// The budget and where it came from.
        budget: MemoryBudget,
        /// Bytes taken off it ([`safety_margin`]; 0 for `--memory-gb`).
        margin: u64,
        /// The least plan, class by class.
        minimum: MemoryUse,
    },
    /// What the flags fix (an expert cache size, `--resident-trunk`, `--max-batch`, `--ctx`) does
    /// not fit the budget, less the margin, beside the rest the run needs.
    #[error(
        "the memory budget of {} ({}{}) cannot hold what the options ask for: {}; {}",
        gb(budget.bytes),
        budget.source,
        margin_words(*margin),
        plan.describe(),
        advice
    )]
    Flags {
        /// The budget and where it came from.
        budget: MemoryBudget,
        /// Bytes taken off it ([`safety_margin`]; 0 for `--memory-gb`).
        margin: u64,
        /// What the flags ask for, class by class.
        plan: MemoryUse,
        /// What to change, in words.
        advice: &'static str,
        /// The options that advice names.
        knobs: &'static [Knob],
    },
    /// A lossy `--trunk-format` holds its requantised matrices resident, and this plan would
    /// read one of them through the mapping or stream it (the stream reads stored bytes).
    #[error(
        "a requantised trunk is held resident, but the plan for {budget} would {how} {tensor}; \
         {advice}, or keep the trunk as stored (--trunk-format bf16)"
    )]
    Requantised {
        /// What to change, in words.
        advice: &'static str,
        /// The budget, in words (`16.0 GB (cgroup limit)`, `no known budget`).
        budget: String,
        /// What the plan would do with it (`stream`, `map`).
        how: &'static str,
        /// The matrix.
        tensor: String,
    },
}

impl PlanError {
    /// The options a person may change to make the plan fit.
    pub fn knobs(&self) -> &'static [Knob] {
        match self {
            PlanError::BelowMinimum { .. } => &[
                Knob::MemoryLimit,
                Knob::MaxBatch,
                Knob::Ctx,
                Knob::IoThreads,
            ],
            PlanError::Flags { knobs, .. } => knobs,
            PlanError::Requantised { .. } => &[Knob::MemoryLimit],
        }
    }
}

fn margin_words(margin: u64) -> String {
    match margin {
        0 => String::new(),
        m => format!(", less a safety margin of {}", gb(m)),
    }
}

impl Plan {
    /// Splits `budget` (less `margin`) over a run of `run` with the expert flags `experts`;
    /// `flags` is the plan of the flags alone ([`MemoryUse::new`]), used as it is where
    /// everything fits.
    ///
    /// `hidden`: the bytes the disk reads while a token computes, where an earlier run
    /// measured them (`expert_store::usage::DecodeRates::hidden_bytes`). Streamed trunk rows
    /// are read a step ahead, while the pass computes; a routed expert that misses is read
    /// after its router, while the pass waits. So where the trunk-first plan streams less than
    /// `hidden`, the trunk streams up to `hidden` and the expert cache takes what that frees:
    /// the stream stays hidden and fewer reads are waited for. A token then takes about
    /// max(compute + missed / rate, (streamed + missed) / rate), least where the stream's
    /// reads take as long as the compute. Where the trunk-first plan already streams more,
    /// or the flags size the cache, it stands. k3-wide at 0.9x, alternating: 0.4 GB of
    /// expert cache for 0.4 GB more streamed, 0.84-0.92 s/token against 0.93-1.13.
    ///
    /// The expert store's free list (buffers of dropped experts kept for the next reads) is
    /// counted only where the cache holds an expert: without one, a read takes a new buffer
    /// only when none is free, so the store never holds more buffers than its reads in
    /// flight and the landed experts handed out (a cache's evictions are what can fill the
    /// free list beyond that).
    pub fn new(
        sizes: &WeightSizes,
        flags: MemoryUse,
        experts: &ExpertOptions,
        run: RunShape,
        budget: Option<MemoryBudget>,
        margin: u64,
        hidden: Option<u64>,
    ) -> Result<Self, PlanError> {
        Self::make(sizes, flags, experts, run, budget, margin, hidden, true)
    }

    /// Where everything fits as stored (so [`Plan::new`] reads it through the mapping), the
    /// plan that holds it all in memory instead: the trunk resident (its BF16 matrices packed
    /// where `sizes` packs them), every expert cached. `None` where that plan streams any of
    /// the trunk or leaves an expert out, where the flags size the trunk or the cache, or
    /// where no budget is known.
    ///
    /// A packed resident trunk reads 0.77x the trunk's bytes per token: on a tier that decodes
    /// packed blocks in registers at the memory's rate, the decode is faster than from the
    /// mapping. k3-wide (7.90 GB) in a cgroup of 1.2x its size, `avx512` on 2 Zen 5 cores,
    /// alternating: 177-186 ms/token (the whole trunk packed, every expert cached) against
    /// 243-348 through the mapping; a 64-token prefill 25.7-27.4 tokens/s against 23.4-27.5.
    pub fn resident_everything(
        sizes: &WeightSizes,
        flags: MemoryUse,
        experts: &ExpertOptions,
        run: RunShape,
        budget: Option<MemoryBudget>,
        margin: u64,
    ) -> Option<Self> {
        let flags_size =
            run.resident_trunk || experts.cache_experts.is_some() || experts.cache_bytes.is_some();
        if flags_size || budget.is_none() {
            return None;
        }
        let plan = Self::make(sizes, flags, experts, run, budget, margin, None, false).ok()?;
        let holds_all =
            plan.trunk.as_ref().is_some_and(|t| !t.streams()) && plan.expert_fraction >= 1.0;
        holds_all.then_some(plan)
    }

    /// [`Plan::new`], with `map_fitting`: whether a budget that everything fits as stored
    /// reads the weights through the mapping (else it is planned as any other).
    #[allow(clippy::too_many_arguments)]
    fn make(
        sizes: &WeightSizes,
        flags: MemoryUse,
        experts: &ExpertOptions,
        run: RunShape,
        budget: Option<MemoryBudget>,
        margin: u64,
        hidden: Option<u64>,
        map_fitting: bool,
    ) -> Result<Self, PlanError> {
        // One pass of the plan, counting the expert store's free list (`free_list`) or not.
        let pass = |free_list: bool| -> Result<Self, PlanError> {
            let budget = budget.clone();
            let mapped = |memory: MemoryUse, budget| Self {
                io_threads: experts.io_threads,
                memory,
                budget,
                margin,
                trunk: None,
                expert_cache: None,
                expert_fraction: 0.0,
                disk_per_token: 0,
                hidden: None,
            };
            let Some(budget) = budget else {
                return Ok(mapped(flags, None));
            };
            let usable = budget.bytes.saturating_sub(margin);
            let state = flags.kv_cache + flags.kda_state + flags.f32_copies + flags.prompt_cache;
            // Everything a decode reads held at once, as stored (the mapping packs nothing):
            // trunk, every expert, state (of the embedding a token reads one row). Then the flags
            // decide as before.
            let everything =
                state + sizes.trunk_stored_bytes() + sizes.expert_total + flags.io_buffers;
            if map_fitting && everything <= usable {
                return if flags.total() <= usable {
                    Ok(mapped(flags, Some(budget)))
                } else {
                    Err(PlanError::Flags {
                        budget,
                        margin,
                        plan: flags,
                        advice: "lower the expert cache, the batch size or the context length",
                        knobs: &[Knob::ExpertCache, Knob::MaxBatch, Knob::Ctx],
                    })
                };
            }
            let largest = sizes.expert_largest;
            // The landed experts a layer's request hands out at once: at most its window of reads
            // (one per I/O thread), and at most the experts a layer selects.
            let in_flight = |io_threads: usize| {
                (sizes.top_k * run.max_batch)
                    .min(sizes.experts_per_layer.iter().copied().max().unwrap_or(0))
                    .min(expert_store::store::request_buffers(io_threads)) as u64
                    * largest
            };
            // The fixed costs with `io_threads` reads in flight, and the flag's whole copy of the
            // trunk where --resident-trunk asks for it.
            let fixed = |io_threads: usize| {
                let mut memory = MemoryUse {
                    resident_trunk: 0,
                    trunk_buffers: 0,
                    io_buffers: match free_list {
                        true => expert_store::store::io_buffers(io_threads),
                        // One read in flight per I/O thread.
                        false => io_threads,
                    } as u64
                        * largest
                        + in_flight(io_threads),
                    ..flags
                };
                memory.expert_cache = 0;
                if run.resident_trunk {
                    memory.resident_trunk = flags.resident_trunk;
                }
                memory
            };
            // The least trunk layout (one buffer, what must be resident for it).
            let least = (!run.resident_trunk).then(|| Layout::minimum(sizes));
            let minimum = |io_threads: usize| {
                let mut memory = fixed(io_threads);
                if let Some(least) = &least {
                    memory.resident_trunk = least.resident;
                    memory.trunk_buffers = least.buffers;
                }
                memory
            };
            // Buffers cost residency: the expert reads in flight asked for, halved until their
            // buffers take at most a tenth of the budget, then down to one where the minimum
            // needs it.
            let share = usable / BUFFER_SHARE;
            let mut io_threads = experts.io_threads.max(1);
            while io_threads > 1
                && expert_store::store::io_buffers(io_threads) as u64 * largest > share
            {
                io_threads /= 2;
            }
            // Where the trunk and every expert cannot all be resident beside them, each byte of an
            // expert buffer is a trunk byte streamed or an expert byte missed again and again:
            // expert reads in flight drop to `STREAMING_IO_THREADS`.
            if !run.resident_trunk
                && fixed(io_threads).total() + sizes.trunk_resident_bytes() + sizes.expert_total
                    > usable
            {
                io_threads = io_threads.min(STREAMING_IO_THREADS);
            }
            while io_threads > 1 && minimum(io_threads).total() > usable {
                io_threads /= 2;
            }
            if minimum(io_threads).total() > usable {
                return Err(if run.resident_trunk {
                    PlanError::Flags {
                        budget,
                        margin,
                        plan: minimum(io_threads),
                        advice: "drop the resident trunk copy (the plan then streams what does \
                                 not fit)",
                        knobs: &[Knob::ResidentTrunk],
                    }
                } else {
                    PlanError::BelowMinimum {
                        budget,
                        margin,
                        minimum: minimum(io_threads),
                    }
                });
            }
            let mut memory = fixed(io_threads);
            // The flags' expert cache, if they set one, before the trunk takes the rest.
            let asked = match (experts.cache_experts, experts.cache_bytes) {
                (Some(n), _) => Some(
                    sizes
                        .experts_per_layer
                        .iter()
                        .map(|&c| c.min(n) as u64)
                        .sum::<u64>()
                        * largest,
                ),
                (None, Some(b)) => Some(b.min(sizes.expert_total)),
                (None, None) => None,
            };
            let trunk_floor = least.as_ref().map_or(0, |l| l.resident + l.buffers);
            if let Some(cache) = asked {
                memory.expert_cache = cache;
                if usable < memory.total() + trunk_floor {
                    memory.resident_trunk += least.as_ref().map_or(0, |l| l.resident);
                    memory.trunk_buffers = least.as_ref().map_or(0, |l| l.buffers);
                    return Err(PlanError::Flags {
                        budget,
                        margin,
                        plan: memory,
                        advice: "lower the expert cache, or leave it to the plan",
                        knobs: &[Knob::ExpertCache],
                    });
                }
            }
            let room = usable - memory.total();
            let mut trunk = None;
            // The hidden bytes in force: where the flags leave the cache to the plan and the
            // trunk-first layout streams less.
            let mut hid = None;
            if !run.resident_trunk {
                let best = Layout::best(sizes, room, share).expect("the minimum layout fits");
                // Only where the trunk-first layout leaves experts out: with the whole trunk and
                // every expert resident (a packed trunk can do that) there is nothing to trade.
                let caches_all = best.resident + best.buffers + sizes.expert_total <= room;
                hid = hidden.filter(|&h| {
                    asked.is_none() && !caches_all && best.trunk.streamed_read_bytes() < h
                });
                let layout = match hid {
                    Some(h) => hiding_layout(sizes, room, share, h),
                    None => best,
                };
                memory.resident_trunk = layout.resident;
                memory.trunk_buffers = layout.buffers;
                trunk = Some(layout.trunk);
            }
            let left = usable - memory.total();
            if asked.is_none() {
                memory.expert_cache = left.min(sizes.expert_total);
            }
            let fraction = match sizes.expert_total {
                0 => 1.0,
                total => memory.expert_cache as f64 / total as f64,
            };
            // Uniform routing: each selection hits the cache with the cache's share of experts.
            let moe_layers = sizes.experts_per_layer.len() as u64;
            let experts_read = ((moe_layers * sizes.top_k as u64 * largest) as f64
                * (1.0 - fraction.min(1.0)))
            .round() as u64;
            let streamed = trunk.as_ref().map_or(0, TrunkPlan::streamed_read_bytes);
            Ok(Self {
                memory,
                budget: Some(budget),
                margin,
                disk_per_token: streamed + experts_read + sizes.embed_row,
                trunk,
                expert_cache: Some(memory.expert_cache),
                expert_fraction: fraction.min(1.0),
                io_threads,
                hidden: hid,
            })
        };
        let full = pass(true);
        let caches_none = |p: &Self| {
            p.expert_cache
                .is_some_and(|cache| cache < sizes.expert_largest.max(1))
        };
        let flags_cache = experts.cache_experts.is_some() || experts.cache_bytes.is_some();
        if flags_cache || run.resident_trunk || full.as_ref().is_ok_and(|p| !caches_none(p)) {
            return full;
        }
        // Without the free list the trunk gets its room (and the minimum is lower), if the
        // cache still holds no expert.
        let lean = pass(false);
        match (full, lean) {
            (_, Ok(lean)) if caches_none(&lean) => Ok(lean),
            (Ok(full), _) => Ok(full),
            (Err(_), Err(e)) | (Err(e), Ok(_)) => Err(e),
        }
    }

    /// Whether the plan streams part of the trunk.
    pub fn streams(&self) -> bool {
        self.trunk.as_ref().is_some_and(TrunkPlan::streams)
    }

    /// The plan in one line: the budget, each class, what is streamed, the bytes predicted
    /// from disk per token.
    pub fn describe(&self) -> String {
        let Some(budget) = &self.budget else {
            return format!("{} (no budget known)", self.memory.describe());
        };
        let head = format!(
            "budget {} ({}{})",
            gb(budget.bytes),
            budget.source,
            margin_words(self.margin)
        );
        match (&self.trunk, self.expert_cache) {
            (None, None) => format!(
                "{head}: everything fits, weights read through the file mapping; {}",
                self.memory.describe()
            ),
            (Some(_), None) => format!(
                "{head}: {}; the trunk resident, the experts read through the file mapping",
                self.memory.describe()
            ),
            (trunk, _) => format!(
                "{head}: {}; trunk streamed {} per token in {} reads{} of at most {} through {} buffer(s), experts cached {:.0}% with {} reads in flight; predicted from disk {} per token",
                self.memory.describe(),
                gb(trunk.as_ref().map_or(0, TrunkPlan::streamed_read_bytes)),
                trunk.as_ref().map_or(0, |t| t.steps.len()),
                trunk
                    .as_ref()
                    .map_or(String::new(), TrunkPlan::describe_steps),
                gb(trunk.as_ref().map_or(0, TrunkPlan::buffer_bytes)),
                trunk.as_ref().map_or(0, |t| t.slots),
                self.expert_fraction * 100.0,
                self.io_threads,
                gb(self.disk_per_token)
            ) + &self.hidden.map_or(String::new(), |h| {
                format!(
                    "; the stream sized to the {} a token's compute hides (an earlier run's rates)",
                    gb(h)
                )
            }),
        }
    }
}

/// The layout that streams at most `hidden` bytes per token in the least room: what it
/// leaves of `room` goes to the expert cache (no more than every expert: the room never drops
/// below `room` less every expert's bytes). `Layout::best` of more room streams no more, so
/// the least room is found by bisection, to a MB (less for a small room).
fn hiding_layout(sizes: &WeightSizes, room: u64, share: u64, hidden: u64) -> Layout {
    let fits =
        |r: u64| Layout::best(sizes, r, share).filter(|l| l.trunk.streamed_read_bytes() <= hidden);
    let mut hi = room;
    let mut lo = room.saturating_sub(sizes.expert_total);
    if let Some(layout) = fits(lo) {
        return layout;
    }
    // To a MB, or a thousandth of the room where that is less (small checkpoints).
    let step = (room / 1024).clamp(4096, 1_000_000);
    while hi - lo > step {
        let mid = lo + (hi - lo) / 2;
        match fits(mid) {
            Some(_) => hi = mid,
            None => lo = mid,
        }
    }
    fits(hi).expect("the whole room streams less than hidden")
}

#[cfg(test)]
mod tests;
