//! The memory plan of a run: every class of memory the engine allocates, summed and checked
//! against the budget ([`expert_store::io::memory_budget`]: the smallest of `MemAvailable` and
//! the process's cgroup headroom) before anything large is allocated, so a run that cannot fit
//! is refused at startup with the numbers instead of being killed by the OOM killer later.
//!
//! Counted: the resident trunk copy (`--resident-trunk`), the expert cache at its capacity,
//! the store's I/O buffers (free list and reads in flight), the MLA latent cache of
//! `max_batch` sequences at `ctx` tokens, their KDA states and conv windows, and the f32
//! copies the model makes at load (MLA `kv_b`, norms and other vectors). Not counted: pages of
//! the file mappings (page cache, which the kernel reclaims) and per-step buffers, left to the
//! safety margin ([`crate::plan::safety_margin`]): a few MB for a decode step, but k3-serve's
//! 32k-token prompt on the k3-wide slice (128-token prefill steps) held 0.37 GB above the
//! counted classes, flat with the depth (PERFORMANCE.md phase 32).

use expert_store::io::MemoryBudget;
use expert_store::{Checkpoint, CheckpointError};

use crate::config::{AttentionKind, K3Config};
use crate::experts::ExpertOptions;
use crate::inventory::{TensorClass, text_tensors};
use crate::knob::Knob;
use crate::units::gb;

/// The shape of a run, from the binary's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunShape {
    /// `--resident-trunk`: every non-expert tensor copied into anonymous memory.
    pub resident_trunk: bool,
    /// Sequences decoded together at most (`--max-batch`).
    pub max_batch: usize,
    /// Tokens a sequence may hold (`--ctx`).
    pub ctx: usize,
}

/// Bytes of each class of memory a run allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryUse {
    /// Trunk tensors copied into anonymous memory: all of them under `--resident-trunk`, or the
    /// share a [`crate::plan::Plan`] keeps resident.
    pub resident_trunk: u64,
    /// Buffers the streamed part of the trunk is read into (`plan::TrunkPlan::slots` of the
    /// largest stream step).
    pub trunk_buffers: u64,
    /// The expert store's cache at its capacity.
    pub expert_cache: u64,
    /// The expert store's read buffers: its free list and the reads in flight.
    pub io_buffers: u64,
    /// MLA latent cache (latent and rope key rows, f32) of every sequence at `ctx` tokens.
    /// Counted at its length: the cache grows by `Vec` doubling, so its capacity may briefly
    /// run ahead of this by up to the length again.
    pub kv_cache: u64,
    /// KDA recurrent states and conv windows (f32) of every sequence.
    pub kda_state: u64,
    /// f32 copies made at load: MLA `kv_b`, and every vector (norms, gates, biases).
    pub f32_copies: u64,
    /// Snapshots the binary's prompt cache may hold in memory (k3-serve's `--prompt-cache-gb`,
    /// [`crate::builder::EngineOptions::prompt_cache_bytes`]): set aside before the weights
    /// take the rest.
    pub prompt_cache: u64,
}

/// A plan over the budget, with both.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the run needs {} but {} of memory is available ({}): {}; lower the expert cache, the \
     batch size or the context length{}",
    gb(plan.total()),
    gb(budget.bytes),
    budget.source,
    plan.describe(),
    if plan.resident_trunk > 0 { ", or drop the resident trunk copy" } else { "" }
)]
pub struct OverBudget {
    /// The plan that does not fit.
    pub plan: MemoryUse,
    /// The memory available, and where that figure came from.
    pub budget: MemoryBudget,
}

impl OverBudget {
    /// The options a person may change to make the run fit.
    pub fn knobs(&self) -> Vec<Knob> {
        let mut knobs = vec![Knob::ExpertCache, Knob::MaxBatch, Knob::Ctx];
        if self.plan.resident_trunk > 0 {
            knobs.push(Knob::ResidentTrunk);
        }
        knobs
    }
}

impl MemoryUse {
    /// The plan for `run` over `ckpt` (its headers only: sizes come from the stored tensors
    /// and the expert table, so any dtype and any sharding are counted as stored).
    pub fn new(
        ckpt: &Checkpoint,
        config: &K3Config,
        experts: &ExpertOptions,
        run: RunShape,
    ) -> Result<Self, CheckpointError> {
        let specs = text_tensors(config);
        let stored = |name: &str| ckpt.tensor(name).map_or(0, |t| t.bytes.len() as u64);
        // `make_resident` starts every tensor at a 64-byte boundary.
        let resident_trunk = if run.resident_trunk {
            specs
                .iter()
                .filter(|t| t.class != TensorClass::RoutedExperts)
                .map(|t| stored(&t.name).next_multiple_of(64))
                .sum()
        } else {
            0
        };
        let (expert_cache, io_buffers) = if experts.wants_store() {
            expert_bytes(ckpt, config, experts)?
        } else {
            (0, 0)
        };
        Ok(Self {
            resident_trunk,
            expert_cache,
            io_buffers,
            ..Self::state(config, run)
        })
    }

    /// The classes that depend on the config and the run alone, not on how the checkpoint
    /// stores its weights: the sequence state (KV, KDA) of `run` and the f32 copies made at
    /// load. Every other class is zero.
    pub fn state(config: &K3Config, run: RunShape) -> Self {
        let specs = text_tensors(config);
        let f32_bytes = 4u64;
        let batch = run.max_batch as u64;
        let mla = &config.mla;
        let mla_layers = config.layers_of(AttentionKind::Mla).len() as u64;
        let kda_layers = config.layers_of(AttentionKind::Kda).len() as u64;
        let kv_cache = batch
            * mla_layers
            * run.ctx as u64
            * (mla.kv_lora_rank + mla.qk_rope_head_dim) as u64
            * f32_bytes;
        let kda = &config.kda;
        let kda_per_layer = (kda.num_heads * kda.head_dim * kda.head_dim
            + 3 * config.kda_width() * (kda.conv_kernel - 1)) as u64;
        let kda_state = batch * kda_layers * kda_per_layer * f32_bytes;
        let kv_b = mla_layers
            * (mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank) as u64;
        // A vector: at most one dimension above 1 (norms, biases, A_log, conv taps per channel
        // count as their element total).
        let vectors: u64 = specs
            .iter()
            .filter(|t| t.shape.iter().filter(|&&d| d > 1).count() <= 1 || t.name.contains("conv"))
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        Self {
            resident_trunk: 0,
            trunk_buffers: 0,
            expert_cache: 0,
            io_buffers: 0,
            kv_cache,
            kda_state,
            f32_copies: (kv_b + vectors) * f32_bytes,
            prompt_cache: 0,
        }
    }

    /// Bytes of every class together.
    pub fn total(&self) -> u64 {
        self.resident_trunk
            + self.trunk_buffers
            + self.expert_cache
            + self.io_buffers
            + self.kv_cache
            + self.kda_state
            + self.f32_copies
            + self.prompt_cache
    }

    /// Each class in GB, then the total.
    pub fn describe(&self) -> String {
        format!(
            "resident trunk {}{} + expert cache {} + I/O buffers {} + KV cache {} + KDA state {} + f32 copies {}{} = {}",
            gb(self.resident_trunk),
            match self.trunk_buffers {
                0 => String::new(),
                b => format!(" + trunk stream buffers {}", gb(b)),
            },
            gb(self.expert_cache),
            gb(self.io_buffers),
            gb(self.kv_cache),
            gb(self.kda_state),
            gb(self.f32_copies),
            match self.prompt_cache {
                0 => String::new(),
                b => format!(" + prompt cache {}", gb(b)),
            },
            gb(self.total())
        )
    }

    /// The plan if it fits `budget` (`None`: unknown, nothing to check against).
    pub fn check(self, budget: Option<MemoryBudget>) -> Result<Self, Box<OverBudget>> {
        match budget {
            Some(budget) if self.total() > budget.bytes => {
                Err(Box::new(OverBudget { plan: self, budget }))
            }
            _ => Ok(self),
        }
    }
}

/// The expert cache at its capacity and the store's I/O buffers, from the expert table (each
/// expert's buffer as the store reads it: its pieces rounded out to 4 KiB).
fn expert_bytes(
    ckpt: &Checkpoint,
    config: &K3Config,
    experts: &ExpertOptions,
) -> Result<(u64, u64), CheckpointError> {
    let table = ckpt.expert_table(&crate::inventory::expert_layout(config))?;
    let largest = table
        .values()
        .map(expert_store::store::buffer_bytes)
        .max()
        .unwrap_or(0);
    let total: u64 = table.values().map(expert_store::store::buffer_bytes).sum();
    let mut per_layer: std::collections::BTreeMap<usize, u64> = Default::default();
    for &(layer, _) in table.keys() {
        *per_layer.entry(layer).or_default() += 1;
    }
    // As `ExpertOptions::open` maps the flags to a capacity: per layer, bytes, or all.
    let cache = match (experts.cache_experts, experts.cache_bytes) {
        (Some(n), _) => per_layer.values().map(|&c| c.min(n as u64)).sum::<u64>() * largest,
        (None, Some(b)) => b.min(total),
        (None, None) => total,
    };
    // The free list and reads in flight, and the landed experts a request hands out at once.
    let io = (expert_store::store::io_buffers(experts.io_threads)
        + expert_store::store::request_buffers(experts.io_threads)) as u64
        * largest;
    Ok((cache, io))
}
