//! The memory planner (contract 6): one budget split into the classes a run allocates, for a
//! checkpoint that does not fit it. Where everything fits (trunk, every expert, sequence
//! state), weights are read through the file mapping as before and the plan only checks the
//! flags' allocations ([`MemoryPlan`]). Where it does not, the plan decides:
//!
//! 1. the fixed costs: sequence state (KV, KDA), the f32 copies made at load, the expert
//!    store's I/O buffers and one layer's selected experts in flight, and two trunk buffers
//!    the size of the largest unit streamed (a layer's trunk, or the head: lm_head and the
//!    output norms) — one where a second would take more than a tenth of the budget, and
//!    fewer expert reads in flight where theirs would; their sum is the minimum, and a
//!    budget below it is refused with the numbers;
//! 2. trunk bytes resident next, tensor by tensor, the head first, then the layers in order
//!    (every trunk byte is read by every token, so residency is worth more per byte than any
//!    expert's); the embedding is never copied (one row of it is read per token);
//! 3. the expert cache gets what is left.
//!
//! Trunk tensors left out are streamed from disk every token (`model::trunk`). `--resident-trunk`
//! and `--expert-cache[-gb]` override steps 2 and 3; `--io-threads` sizes the I/O buffers.
//! The planner works on sizes ([`WeightSizes`]), so it is tested without a model.

use std::collections::HashSet;
use std::ops::Range;
use std::path::PathBuf;

use expert_store::checkpoint::LinearStorage;
use expert_store::io::{MemoryBudget, aligned_span};
use expert_store::{Checkpoint, CheckpointError};

use crate::budget::{MemoryPlan, RunShape, gb};
use crate::config::K3Config;
use crate::experts::ExpertOptions;
use crate::inventory::{Role, TensorClass, expert_layout, text_tensors};

/// Buffers the trunk stream cycles through where the budget allows: one layer computed on
/// while the next is read.
pub const STREAM_SLOTS: u64 = 2;

/// A second trunk buffer, and the expert store's read buffers, may each take at most
/// 1/`BUFFER_SHARE` of the budget: memory spent on buffers is memory not resident.
pub const BUFFER_SHARE: u64 = 10;

/// The safety margin taken off a budget the host reports (not off `--memory-gb`): 0.25 GB
/// plus 2%, for what no class counts (activations, the binary, allocator slack, the pages of
/// the embedding rows read through the mapping).
pub fn safety_margin(budget: u64) -> u64 {
    250_000_000 + budget / 50
}

/// Reads closer than this are merged into one (the gap is read and ignored): a layer's small
/// tensors (norms, biases) lie between its matrices.
pub const MERGE_GAP: usize = 1 << 20;

/// A stored tensor: its name as stored, its file, where it lies in it, its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    pub name: String,
    pub path: PathBuf,
    pub offset: usize,
    pub bytes: u64,
}

/// The reads that fetch `tensors` (in file order): one per run of tensors in one file whose
/// gaps are at most [`MERGE_GAP`].
pub fn merged_reads(tensors: &[StoredTensor]) -> Vec<(PathBuf, Range<usize>)> {
    let mut reads: Vec<(PathBuf, Range<usize>)> = Vec::new();
    for t in tensors {
        let range = t.offset..t.offset + t.bytes as usize;
        match reads.last_mut() {
            Some((path, r))
                if *path == t.path && r.end <= range.start && range.start - r.end <= MERGE_GAP =>
            {
                r.end = range.end;
            }
            _ => reads.push((t.path.clone(), range)),
        }
    }
    reads
}

/// Bytes `O_DIRECT` reads of `tensors` cover (each merged read rounded out to 4 KiB).
pub fn read_bytes(tensors: &[StoredTensor]) -> u64 {
    merged_reads(tensors)
        .iter()
        .map(|(_, r)| aligned_span(r).1 as u64)
        .sum()
}

impl StoredTensor {
    /// Bytes it takes in the resident copy (read alone with `O_DIRECT`: its range rounded
    /// out to 4 KiB).
    pub fn resident_bytes(&self) -> u64 {
        aligned_span(&(self.offset..self.offset + self.bytes as usize)).1 as u64
    }
}

/// The sizes the planner splits a budget over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSizes {
    /// Read every token outside the layers: lm_head and the output norms.
    pub head: Vec<StoredTensor>,
    /// Each decoder layer's trunk tensors (all but the routed experts), in file order.
    pub layers: Vec<Vec<StoredTensor>>,
    /// The embedding table, and the bytes of one row of it (read per token).
    pub embed: u64,
    pub embed_row: u64,
    /// Every routed expert's buffer bytes summed, and the largest one.
    pub expert_total: u64,
    pub expert_largest: u64,
    /// Routed experts per MoE layer (one entry per MoE layer).
    pub experts_per_layer: Vec<usize>,
    /// Experts each token selects per MoE layer.
    pub top_k: usize,
}

impl WeightSizes {
    /// The sizes of `ckpt`'s tensors as stored (any dtype; an MXFP4 linear is two tensors).
    pub fn new(ckpt: &Checkpoint, config: &K3Config) -> Result<Self, CheckpointError> {
        let mut sizes = Self {
            head: Vec::new(),
            layers: vec![Vec::new(); config.num_layers()],
            embed: 0,
            embed_row: 0,
            expert_total: 0,
            expert_largest: 0,
            experts_per_layer: Vec::new(),
            top_k: config.moe.router.top_k,
        };
        let stored = |name: &str| {
            ckpt.tensor(name).map(|t| StoredTensor {
                name: t.name.to_owned(),
                path: t.path.to_owned(),
                offset: t.offset,
                bytes: t.bytes.len() as u64,
            })
        };
        for spec in text_tensors(config) {
            let tensors: Vec<StoredTensor> = match ckpt.linear_format(&spec.name) {
                Ok(LinearStorage::MxFp4(base)) if spec.role() == Role::Linear => {
                    [".weight_packed", ".weight_scale"]
                        .iter()
                        .filter_map(|part| stored(&format!("{base}{part}")))
                        .collect()
                }
                _ => stored(&spec.name).into_iter().collect(),
            };
            match (spec.class, spec.layer) {
                (TensorClass::RoutedExperts, _) => {}
                (TensorClass::Embedding, _) => {
                    sizes.embed = tensors.iter().map(|t| t.bytes).sum();
                    sizes.embed_row = sizes.embed / config.vocab_size.max(1) as u64;
                }
                (_, Some(layer)) => sizes.layers[layer].extend(tensors),
                (_, None) => sizes.head.extend(tensors),
            }
        }
        for layer in &mut sizes.layers {
            layer.sort_by(|a, b| (&a.path, a.offset).cmp(&(&b.path, b.offset)));
        }
        let table = ckpt.expert_table(&expert_layout(config))?;
        let mut per_layer = std::collections::BTreeMap::<usize, usize>::new();
        for (&(layer, _), location) in &table {
            let bytes = expert_store::store::buffer_bytes(location);
            sizes.expert_total += bytes;
            sizes.expert_largest = sizes.expert_largest.max(bytes);
            *per_layer.entry(layer).or_default() += 1;
        }
        sizes.experts_per_layer = per_layer.into_values().collect();
        Ok(sizes)
    }

    /// The trunk's bytes as the resident copy holds them: the head and every layer.
    pub fn trunk_resident_bytes(&self) -> u64 {
        self.head
            .iter()
            .chain(self.layers.iter().flatten())
            .map(StoredTensor::resident_bytes)
            .sum()
    }

    /// The units the trunk is streamed in, in the order a forward pass reads them: each
    /// layer, then the head.
    pub fn units(&self) -> impl Iterator<Item = &Vec<StoredTensor>> {
        self.layers.iter().chain(std::iter::once(&self.head))
    }

    /// The largest unit (a layer's trunk, or the head) as a stream buffer holds it.
    pub fn largest_layer_read(&self) -> u64 {
        self.units().map(|l| read_bytes(l)).max().unwrap_or(0)
    }
}

/// Where the trunk's bytes are under a plan that does not fit the mapping.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrunkPlan {
    /// Stored names copied into resident memory.
    pub resident: HashSet<String>,
    /// Per layer and last the head (lm_head, output norms): the tensors read from disk every
    /// token (empty: all resident).
    pub streamed: Vec<Vec<StoredTensor>>,
    /// Layer buffers the stream cycles through (2: a layer is read while the one before is
    /// computed; 1 where the budget allows no more).
    pub slots: usize,
}

impl TrunkPlan {
    /// Bytes read from disk per token for the streamed trunk.
    pub fn streamed_read_bytes(&self) -> u64 {
        self.streamed.iter().map(|l| read_bytes(l)).sum()
    }

    pub fn streams(&self) -> bool {
        self.streamed.iter().any(|l| !l.is_empty())
    }
}

/// A budget split over a run's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Bytes of each class.
    pub memory: MemoryPlan,
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
}

/// Why no plan fits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the memory budget of {} ({}{}) is below this run's minimum of {}: {}; raise --memory-gb or lower --max-batch, --ctx or --io-threads",
        gb(budget.bytes),
        budget.source,
        margin_words(*margin),
        gb(minimum.total()),
        minimum.describe()
    )]
    BelowMinimum {
        budget: MemoryBudget,
        margin: u64,
        minimum: MemoryPlan,
    },
    #[error(
        "the memory budget of {} ({}{}) cannot hold what the flags ask for: {}; {}",
        gb(budget.bytes),
        budget.source,
        margin_words(*margin),
        plan.describe(),
        advice
    )]
    Flags {
        budget: MemoryBudget,
        margin: u64,
        plan: MemoryPlan,
        advice: &'static str,
    },
}

fn margin_words(margin: u64) -> String {
    match margin {
        0 => String::new(),
        m => format!(", less a safety margin of {}", gb(m)),
    }
}

impl Plan {
    /// Splits `budget` (less `margin`) over a run of `run` with the expert flags `experts`;
    /// `flags` is the plan of the flags alone ([`MemoryPlan::new`]), used as it is where
    /// everything fits.
    pub fn new(
        sizes: &WeightSizes,
        flags: MemoryPlan,
        experts: &ExpertOptions,
        run: RunShape,
        budget: Option<MemoryBudget>,
        margin: u64,
    ) -> Result<Self, PlanError> {
        let mapped = |memory: MemoryPlan, budget| Self {
            io_threads: experts.io_threads,
            memory,
            budget,
            margin,
            trunk: None,
            expert_cache: None,
            expert_fraction: 0.0,
            disk_per_token: 0,
        };
        let Some(budget) = budget else {
            return Ok(mapped(flags, None));
        };
        let usable = budget.bytes.saturating_sub(margin);
        let state = flags.kv_cache + flags.kda_state + flags.f32_copies;
        // Everything a decode reads held at once: trunk, every expert, state (of the embedding
        // a token reads one row). Then the flags decide as before.
        let everything =
            state + sizes.trunk_resident_bytes() + sizes.expert_total + flags.io_buffers;
        if everything <= usable {
            return if flags.total() <= usable {
                Ok(mapped(flags, Some(budget)))
            } else {
                Err(PlanError::Flags {
                    budget,
                    margin,
                    plan: flags,
                    advice: "lower the expert cache (--expert-cache/--expert-cache-gb), --max-batch or --ctx",
                })
            };
        }
        let largest = sizes.expert_largest;
        let in_flight = (sizes.top_k * run.max_batch)
            .min(sizes.experts_per_layer.iter().copied().max().unwrap_or(0))
            as u64
            * largest;
        let minimum = |slots: u64, io_threads: usize| {
            let mut memory = MemoryPlan {
                resident_trunk: 0,
                trunk_buffers: slots * sizes.largest_layer_read(),
                io_buffers: expert_store::store::io_buffers(io_threads) as u64 * largest
                    + in_flight,
                ..flags
            };
            memory.expert_cache = 0;
            if run.resident_trunk {
                // The flag's copy: every trunk tensor and the embedding, nothing streamed.
                memory.resident_trunk = flags.resident_trunk;
                memory.trunk_buffers = 0;
            }
            memory
        };
        // Buffers cost residency, so they may take at most a tenth of the budget each: a
        // second trunk buffer (a layer's read overlapping the previous layer's compute) where
        // it fits that, the reads in flight asked for halved until their buffers do; then,
        // where the minimum still does not fit, one trunk buffer and fewer reads down to one.
        let share = usable / BUFFER_SHARE;
        let preferred_slots = if sizes.largest_layer_read() <= share {
            STREAM_SLOTS
        } else {
            1
        };
        let mut preferred_io = experts.io_threads.max(1);
        while preferred_io > 1
            && expert_store::store::io_buffers(preferred_io) as u64 * largest > share
        {
            preferred_io /= 2;
        }
        let mut shapes = vec![(preferred_slots, preferred_io)];
        let mut io_threads = preferred_io;
        loop {
            shapes.push((1, io_threads));
            if io_threads <= 1 {
                break;
            }
            io_threads /= 2;
        }
        let Some(&(slots, io_threads)) = shapes
            .iter()
            .find(|&&(slots, io)| minimum(slots, io).total() <= usable)
        else {
            let (slots, io) = *shapes.last().expect("at least one shape");
            return Err(if run.resident_trunk {
                PlanError::Flags {
                    budget,
                    margin,
                    plan: minimum(slots, io),
                    advice: "drop --resident-trunk (the plan then streams what does not fit)",
                }
            } else {
                PlanError::BelowMinimum {
                    budget,
                    margin,
                    minimum: minimum(slots, io),
                }
            });
        };
        let mut memory = minimum(slots, io_threads);
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
        if let Some(cache) = asked {
            memory.expert_cache = cache;
            if usable < memory.total() {
                return Err(PlanError::Flags {
                    budget,
                    margin,
                    plan: memory,
                    advice: "lower --expert-cache/--expert-cache-gb, or leave the expert cache to the plan",
                });
            }
        }
        let units = sizes.layers.len() + 1;
        let mut trunk = TrunkPlan {
            resident: HashSet::new(),
            streamed: vec![Vec::new(); units],
            slots: slots as usize,
        };
        let mut left = usable - memory.total();
        if !run.resident_trunk {
            // First fit, the head first (the largest unit: streamed, it sets the buffers' size),
            // then the layers in order.
            let order = std::iter::once(units - 1).chain(0..units - 1);
            for unit in order {
                let tensors = sizes
                    .units()
                    .nth(unit)
                    .expect("a unit per layer and the head");
                for tensor in tensors {
                    if tensor.resident_bytes() <= left {
                        left -= tensor.resident_bytes();
                        memory.resident_trunk += tensor.resident_bytes();
                        trunk.resident.insert(tensor.name.clone());
                    } else {
                        trunk.streamed[unit].push(tensor.clone());
                    }
                }
            }
            // The buffers need hold only the largest streamed part (none if all is resident).
            let buffers = slots
                * trunk
                    .streamed
                    .iter()
                    .map(|l| read_bytes(l))
                    .max()
                    .unwrap_or(0);
            left += memory.trunk_buffers - buffers;
            memory.trunk_buffers = buffers;
        }
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
        Ok(Self {
            memory,
            budget: Some(budget),
            margin,
            disk_per_token: trunk.streamed_read_bytes() + experts_read + sizes.embed_row,
            trunk: (!run.resident_trunk).then_some(trunk),
            expert_cache: Some(memory.expert_cache),
            expert_fraction: fraction.min(1.0),
            io_threads,
        })
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
            (trunk, _) => format!(
                "{head}: {}; trunk streamed {} per token through {} buffer(s), experts cached {:.0}% with {} reads in flight; predicted from disk {} per token",
                self.memory.describe(),
                gb(trunk.as_ref().map_or(0, TrunkPlan::streamed_read_bytes)),
                trunk.as_ref().map_or(0, |t| t.slots),
                self.expert_fraction * 100.0,
                self.io_threads,
                gb(self.disk_per_token)
            ),
        }
    }
}

#[cfg(test)]
mod tests;
