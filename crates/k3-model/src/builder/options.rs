//! What an engine is built from besides the config and the checkpoint ([`EngineOptions`]),
//! where the build reports what it did ([`BuildSink`]), and why it may fail ([`BuildError`]).

use std::sync::Arc;

use expert_store::StoreError;
use expert_store::checkpoint::CheckpointError;
use expert_store::scan::ScanError;
use expert_store::store::PreloadProgress;
use mxfp4_kernels::Tier;
use numa_sched::{PoolOptions, Ranks, RanksError};

use crate::experts::{ExpertOptions, ExpertOptionsError};
use crate::knob::Knob;
use crate::model::{ExpertPlacement, ModelError};
use crate::packcache::place::PackCachePlace;
use crate::plan::{PlanError, TrunkFormat};

/// Everything an engine is built from besides the config and the checkpoint.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// The kernel tier (`None`: the best this CPU supports).
    pub kernel_tier: Option<Tier>,
    /// Domains and workers.
    pub pool: PoolOptions,
    /// Whether routed experts come from the expert store, and how it is set up.
    pub experts: ExpertOptions,
    /// How routed experts are spread over the domains (results do not depend on it).
    pub expert_placement: ExpertPlacement,
    /// Copy every text tensor but the routed experts into huge-page memory, each domain's rows
    /// of every matrix bound to its node (on real NUMA), before anything runs.
    pub resident_trunk: bool,
    /// Where a memory plan keeps BF16 matrices of the trunk resident, keep them packed
    /// (`mxfp4_kernels::packed`: lossless, 12.25 bits per weight, so 1.3x as many fit; their
    /// GEMVs run at about 0.8x the BF16 rate on two Zen 3 cores), and read the ones it streams
    /// packed from the pack cache ([`Self::pack_cache`]). `--no-pack-trunk` clears it.
    pub pack_trunk: bool,
    /// When the whole trunk is held packed rather than read through the mapping, where
    /// everything fits (`pack_trunk` set): by a measurement at startup, or by the tier.
    pub pack_rule: PackRule,
    /// The trunk as stored (`bf16`, exact: the default), or its large projections requantised
    /// once at load to Q8_0 or MXFP4 and held resident (`--trunk-format`; lossy, opt-in).
    pub trunk_format: TrunkFormat,
    /// Where the pack cache is kept (`--pack-cache DIR|off`): by default beside the checkpoint,
    /// else where `PackCachePlace::Auto` says (k3-serve: `$XDG_CACHE_HOME/k3`).
    pub pack_cache: PackCachePlace,
    /// Read every weight once first: a NaN/Inf in a float tensor or a 0xFF E8M0 scale fails
    /// the build, naming the tensors.
    pub scan: bool,
    /// Sequences decoded together at most (sizes the KV cache in the memory plan).
    pub max_batch: usize,
    /// Tokens a sequence may hold (sizes the KV cache in the memory plan).
    pub ctx: usize,
    /// The processes the engine's rows are split over (one, unless under `mpirun`).
    pub ranks: Arc<Ranks>,
    /// The memory the run may use, in bytes (`--memory-gb`; `None`: the smaller of the host's
    /// available memory and the process's cgroup headroom, less [`safety_margin`]).
    ///
    /// [`safety_margin`]: crate::plan::safety_margin
    pub memory_bytes: Option<u64>,
    /// Bytes of memory the binary's own prompt cache may hold (k3-serve's `--prompt-cache-gb`;
    /// 0: none). The plan sets them aside before the weights take the rest, so the cache and
    /// the weights together stay within the budget.
    pub prompt_cache_bytes: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            kernel_tier: None,
            pool: PoolOptions::default(),
            experts: ExpertOptions::default(),
            expert_placement: ExpertPlacement::default(),
            resident_trunk: false,
            pack_trunk: true,
            pack_rule: PackRule::Tier,
            trunk_format: TrunkFormat::Bf16,
            pack_cache: PackCachePlace::default(),
            scan: false,
            max_batch: 1,
            ctx: 4096,
            ranks: Arc::new(Ranks::single()),
            memory_bytes: None,
            prompt_cache_bytes: 0,
        }
    }
}

/// When a plan that everything fits holds the whole trunk packed instead of reading it
/// through the mapping (same logits either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackRule {
    /// Under a memory limit, on a tier whose packed GEMV runs at the memory's rate
    /// (`Kernels::packed_at_memory_rate`): the library's default, which no measurement
    /// changes.
    Tier,
    /// Where a measurement at startup finds the packed GEMV faster per core than the stored
    /// one with every worker busy, with or without a limit: the binaries' rule. With several
    /// ranks every rank measures, and the trunk is held packed only where all of them find it
    /// faster (their plans agree).
    Measured,
    /// Wherever everything fits, without measuring (`--pack-trunk`: a server whose operator
    /// knows its cores' share of the read rate is below the packed decode's rate).
    Always,
}

/// Where the build reports what it did: one line per step, and the preload's progress.
/// A closure `FnMut(&str)` is a sink that takes the lines and ignores the progress.
pub trait BuildSink {
    /// One line saying what was done (no trailing newline).
    fn line(&mut self, line: &str);
    /// A line about what an option (`knob`) decides, which a binary may follow with how to
    /// change it (its flag: `k3_cli::FlagHints`); by default just the line.
    fn line_about(&mut self, line: &str, _knob: Knob) {
        self.line(line);
    }
    /// The expert preload's progress, as it goes.
    fn preload_progress(&mut self, _progress: PreloadProgress) {}
}

impl<F: FnMut(&str)> BuildSink for F {
    fn line(&mut self, line: &str) {
        self(line)
    }
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The checkpoint cannot be opened, does not match the config (a tensor missing, of the
    /// wrong shape or format), or its trunk could not be copied resident.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// `scan` found a NaN/Inf in a float tensor or a 0xFF E8M0 scale, or could not read a tensor.
    #[error("the weight scan: {0}")]
    Scan(#[from] ScanError),
    /// No memory plan fits the budget.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The kernel tier asked for is not supported on this CPU.
    #[error(transparent)]
    Kernel(#[from] mxfp4_kernels::Error),
    /// The worker pool could not be built (no workers asked for, a domain's threads that would
    /// not start).
    #[error("worker pool: {0}")]
    Pool(#[from] numa_sched::Error),
    /// The ranks disagree (different checkpoints) or ask for what a multi-rank run does not support
    /// (the expert store).
    #[error(transparent)]
    Ranks(#[from] RanksError),
    /// The expert options are contradictory, or the store or its usage file could not be opened.
    #[error(transparent)]
    Experts(#[from] ExpertOptionsError),
    /// Preloading the expert store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Reading the plan's resident trunk failed, or the packed trunk took more memory than its
    /// plan and the expert cache could not give the excess up.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl BuildError {
    /// The options a person may change to get past this error (a binary names their flags).
    pub fn knobs(&self) -> Vec<Knob> {
        match self {
            BuildError::Plan(e) => e.knobs().to_vec(),
            BuildError::Scan(_) => vec![Knob::Scan],
            BuildError::Experts(ExpertOptionsError::TwoCapacities) => vec![Knob::ExpertCache],
            BuildError::Ranks(RanksError::Unsupported { .. }) => vec![Knob::ExpertStore],
            // A packed trunk past its plan that the expert cache cannot make room for.
            BuildError::Model(ModelError::Plan(_)) => vec![Knob::PackTrunk],
            _ => Vec::new(),
        }
    }
}
