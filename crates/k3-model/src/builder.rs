//! The one place an engine is assembled: config + checkpoint directory + [`EngineOptions`] →
//! a ready [`Engine`] (checkpoint opened and validated, optionally scanned, the memory plan
//! checked against the budget, the worker pool built, the trunk optionally copied resident with
//! each domain's rows on its node, the expert store opened, placed and preloaded), from which
//! [`Engine::model`] makes the [`Model`] on the pool. Every binary (server, decode bench,
//! examples) builds through here, so they cannot drift apart.
//!
//! It prints nothing: what it did goes to the caller's [`BuildSink`] as lines.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use expert_store::io::MemoryBudget;
use expert_store::scan::ScanError;
use expert_store::store::PreloadProgress;
use expert_store::usage::{DecodeRates, UsageError, UsageHistory};
use expert_store::{Checkpoint, CheckpointError, ExpertStore, StoreError};
use mxfp4_kernels::{Kernels, Tier};
use numa_sched::{Pool, PoolOptions, Ranks, RanksError};

use crate::budget::{MemoryPlan, RunShape};
use crate::checkpoint::{trunk_tensor_names, validate};
use crate::config::K3Config;
use crate::experts::{ExpertOptions, ExpertOptionsError};
use crate::model::snapshot::file::checkpoint_identity;
use crate::model::{DecodeClock, ExpertPlacement, Model, ModelError, ResidentTrunk};
use crate::packcache::{Outcome, PackCache, PackCachePlace};
use crate::plan::{Plan, PlanError, WeightSizes, safety_margin};

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

/// Where the build reports what it did: one line per step, and the preload's progress.
/// A closure `FnMut(&str)` is a sink that takes the lines and ignores the progress.
pub trait BuildSink {
    /// One line saying what was done (no trailing newline).
    fn line(&mut self, line: &str);
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
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("--scan: {0}")]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Kernel(#[from] mxfp4_kernels::Error),
    #[error("worker pool: {0}")]
    Pool(#[from] numa_sched::Error),
    #[error(transparent)]
    Ranks(#[from] RanksError),
    #[error(transparent)]
    Experts(#[from] ExpertOptionsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// The plan-sized expert cache (`cache`) less `overrun`, the bytes a packed trunk took beyond
/// its plan (`planned`): the cache gives them up; where it cannot (none, or too small), the build is
/// refused with the numbers rather than run past the budget.
fn take_overrun(cache: Option<u64>, overrun: u64, planned: u64) -> Result<Option<u64>, String> {
    if overrun == 0 {
        return Ok(cache);
    }
    match cache {
        Some(bytes) if bytes >= overrun => Ok(Some(bytes - overrun)),
        _ => Err(format!(
            "the packed trunk holds {} more than the plan's {} (blocks whose exponents span too \
             far are kept as BF16) and the expert cache ({}) cannot give that up; run with \
             --no-pack-trunk",
            crate::budget::gb(overrun),
            crate::budget::gb(planned),
            crate::budget::gb(cache.unwrap_or(0)),
        )),
    }
}

/// One-token steps a run decodes (after its first) before [`Engine::decode_rates`] trusts
/// the mean.
pub const RATE_STEPS: u64 = 3;

/// An assembled engine: what a [`Model`] is made from, and what the binaries report on.
#[derive(Debug)]
pub struct Engine {
    pub config: K3Config,
    pub checkpoint: Checkpoint,
    pub kernels: Kernels,
    pub pool: Arc<Pool>,
    /// The expert store, where the options ask for one (placed, and preloaded if asked).
    pub store: Option<Arc<ExpertStore>>,
    /// The memory plan: the budget split over the run's memory.
    pub plan: Plan,
    expert_placement: ExpertPlacement,
    /// Where the store's usage counts are saved ([`Engine::save_usage`]).
    usage_path: Option<PathBuf>,
    /// The trunk tensors the plan keeps resident (models built here share them).
    resident: Option<Arc<ResidentTrunk>>,
    /// The pack cache the plan reads streamed BF16 matrices from (exception blocks and row
    /// indexes in memory).
    pack: Option<Arc<PackCache>>,
    /// The compute time of the one-token passes of every model built here, saved with the
    /// usage counts for the next start's plan.
    clock: Arc<DecodeClock>,
}

impl Engine {
    /// Builds the engine over the checkpoint in `dir`, its memory planned within
    /// `options.memory_bytes`, or else [`expert_store::io::memory_budget`] less
    /// [`safety_margin`].
    pub fn build(
        dir: &Path,
        config: K3Config,
        options: &EngineOptions,
        sink: &mut dyn BuildSink,
    ) -> Result<Self, BuildError> {
        let (budget, margin) = match options.memory_bytes {
            Some(bytes) => (
                Some(MemoryBudget {
                    bytes,
                    source: "--memory-gb".into(),
                    limit: true,
                }),
                0,
            ),
            None => {
                let budget = expert_store::io::memory_budget();
                let margin = budget.as_ref().map_or(0, |b| safety_margin(b.bytes));
                (budget, margin)
            }
        };
        Self::build_planned(dir, config, options, budget, margin, sink)
    }

    /// [`Engine::build`] against a given budget taken as it is, its `limit` included (`None`:
    /// unknown, nothing is planned or refused).
    pub fn build_within(
        dir: &Path,
        config: K3Config,
        options: &EngineOptions,
        budget: Option<MemoryBudget>,
        sink: &mut dyn BuildSink,
    ) -> Result<Self, BuildError> {
        Self::build_planned(dir, config, options, budget, 0, sink)
    }

    /// [`Engine::build_within`] with `budget` taken as a limit the process runs under (a
    /// cgroup's, --memory-gb), whatever its `limit` says: where everything fits as stored,
    /// the plan may hold it all in memory, the trunk packed ([`Plan::resident_everything`]).
    pub fn build_within_limit(
        dir: &Path,
        config: K3Config,
        options: &EngineOptions,
        budget: MemoryBudget,
        sink: &mut dyn BuildSink,
    ) -> Result<Self, BuildError> {
        let budget = MemoryBudget {
            limit: true,
            ..budget
        };
        Self::build_planned(dir, config, options, Some(budget), 0, sink)
    }

    fn build_planned(
        dir: &Path,
        config: K3Config,
        options: &EngineOptions,
        budget: Option<MemoryBudget>,
        margin: u64,
        sink: &mut dyn BuildSink,
    ) -> Result<Self, BuildError> {
        // A limit the process runs under (--memory-gb, a cgroup's), not the host's free memory.
        let limit = budget.as_ref().is_some_and(|b| b.limit);
        let mut checkpoint = Checkpoint::open(dir)?;
        validate(&checkpoint, &config)?;
        crate::shares::same_checkpoint(&checkpoint, &config, &options.ranks)?;
        if options.scan {
            let started = Instant::now();
            let report = expert_store::scan::require_finite(&checkpoint)?;
            sink.line(&format!(
                "--scan: {} tensors read, none holds NaN, Inf or a 0xFF scale ({:.1} s)",
                report.tensors.len(),
                started.elapsed().as_secs_f64()
            ));
        }
        // Everything the run allocates against the memory it may use, before allocating it.
        let run = RunShape {
            resident_trunk: options.resident_trunk,
            max_batch: options.max_batch,
            ctx: options.ctx,
        };
        let flags = MemoryPlan {
            prompt_cache: options.prompt_cache_bytes,
            ..MemoryPlan::new(&checkpoint, &config, &options.experts, run)?
        };
        let mut sizes = WeightSizes::new(&checkpoint, &config)?;
        if !options.pack_trunk {
            sizes = sizes.unpacked();
        }
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
        let mut plan = Plan::new(
            &sizes,
            flags,
            &options.experts,
            run,
            budget.clone(),
            margin,
            hidden,
        )?;
        // Under a limit that everything fits as stored, on a tier whose packed GEMV runs at
        // the memory's rate: the whole trunk resident and packed, every expert cached, rather
        // than the mapping (whose pages count against the limit and are the kernel's to
        // evict). One domain and one rank: the mapping's per-domain placement and the ranks'
        // shares are not planned here.
        if limit
            && plan.trunk.is_none()
            && options.pack_trunk
            && kernels.packed_at_memory_rate()
            && pool.domains() == 1
            && options.ranks.size() == 1
            && let Some(resident) = Plan::resident_everything(
                &sizes,
                flags,
                &options.experts,
                run,
                budget.clone(),
                margin,
            )
        {
            plan = resident;
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
        if streams_packable && !dirs.is_empty() {
            let identity = checkpoint_identity(&checkpoint, &config);
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
                let sizes = sizes.clone().with_pack_cache(&cache);
                match Plan::new(&sizes, flags, &options.experts, run, budget, margin, hidden) {
                    Ok(plan) => Ok((cache, outcome, sizes, plan)),
                    Err(e) => Err(format!("the plan with it: {e}")),
                }
            });
            match replanned {
                Ok((cache, outcome, packed_sizes, packed_plan)) => {
                    let (body, bf16) = cache.body_bytes();
                    sink.line(&format!(
                        "pack cache: {} ({} of BF16 matrices packed in {}, {} held in memory){}; \
                         the streamed matrices are read packed (--pack-cache off reads them as \
                         stored)",
                        cache.path().display(),
                        crate::budget::gb(bf16),
                        crate::budget::gb(body),
                        crate::budget::gb(cache.side_bytes()),
                        match outcome {
                            Outcome::Opened => String::new(),
                            Outcome::Written { why, seconds } => {
                                format!(", written in {seconds:.1} s ({why})")
                            }
                        }
                    ));
                    sizes = packed_sizes;
                    plan = packed_plan;
                    pack = Some(Arc::new(cache));
                }
                Err(why) => sink.line(&format!(
                    "pack cache: not used ({why}); the streamed matrices are read as stored"
                )),
            }
        }
        sink.line(&format!("memory plan: {}", plan.describe()));
        sink.line(&pool.topology().describe());
        sink.line(&format!(
            "kernel tier {}, {} compute threads ({} per domain)",
            kernels.tier(),
            pool.threads(),
            (0..pool.domains())
                .map(|d| pool.domain_threads(d).to_string())
                .collect::<Vec<_>>()
                .join("/")
        ));
        let nodes: Vec<Option<usize>> = pool.topology().domains.iter().map(|d| d.node).collect();
        // The flag's copy (the whole trunk, through the mapping, each domain's rows of every
        // matrix on its node on real NUMA), or the plan's share of it (read with O_DIRECT).
        let mut resident = None;
        // Bytes the packed trunk holds beyond the plan (more wide blocks than it allowed for).
        let mut overrun = 0;
        if options.resident_trunk {
            let keep = trunk_tensor_names(&checkpoint, &config);
            let started = Instant::now();
            let bytes = checkpoint.make_resident_placed(
                |stored| keep.contains(stored),
                |_, shape, bytes| {
                    if let [rows, _] = shape {
                        numa_sched::memory::bind_row_split(bytes, *rows, &nodes);
                    }
                },
            )?;
            sink.line(&format!(
                "resident trunk: {:.2} GB copied in {:.1} s",
                bytes as f64 / 1e9,
                started.elapsed().as_secs_f64()
            ));
        } else if let Some(trunk) = plan
            .trunk
            .as_ref()
            .filter(|t| !t.resident.is_empty() || !t.resident_rows.is_empty())
        {
            let started = Instant::now();
            let loaded = ResidentTrunk::load(
                &checkpoint,
                &trunk.resident,
                &trunk.resident_rows,
                &sizes.packed_cols(),
                pack.as_deref(),
                &pool,
                &pool.topology().domains[0].cpus,
            )?;
            let packed = loaded.packed_summary();
            sink.line(&format!(
                "resident trunk: {:.2} GB read with O_DIRECT in {:.1} s{}",
                loaded.bytes() as f64 / 1e9,
                started.elapsed().as_secs_f64(),
                match packed.pieces {
                    0 => String::new(),
                    n => format!(
                        "; {n} BF16 matrices (or leading rows) packed{}: {:.2} GB of BF16 in {:.2} \
                         GB ({} blocks kept as BF16; --no-pack-trunk keeps every matrix as stored)",
                        match packed.cached {
                            0 => String::new(),
                            c => format!(" ({c} read from the pack cache)"),
                        },
                        packed.bf16_bytes as f64 / 1e9,
                        packed.packed_bytes as f64 / 1e9,
                        packed.exceptions,
                    ),
                }
            ));
            overrun = (loaded.bytes() as u64).saturating_sub(plan.memory.resident_trunk);
            if overrun > 0 {
                sink.line(&format!(
                    "the packed trunk holds {} more than planned ({} wide blocks kept as BF16, \
                     over the {} per 10,000 planned for); the expert cache gives it up",
                    crate::budget::gb(overrun),
                    packed.exceptions,
                    crate::plan::PACKED_EXCEPTIONS_PER_10K,
                ));
            }
            resident = Some(Arc::new(loaded));
        }
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
                &checkpoint,
                &config,
                expert_store::io::memory_available(),
                // The store's I/O threads run on domain 0's CPUs (contract 5: every thread placed).
                &pool.topology().domains[0].cpus,
            )?
            .map(Arc::new);
        if store.is_some() && options.ranks.size() > 1 {
            // The store's batches arrive as loads finish, in an order each rank sees
            // differently; the ranks' collectives must match one for one.
            return Err(RanksError::Unsupported {
                what: "the expert store (--expert-cache, --expert-cache-gb, --preload-experts)",
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
        // Where the plan found that everything fits and reads it all through the mapping,
        // the decode's weights (all but the embedding table, of which a token reads one row)
        // are read in and mapped now, so the first steps do not fault them in from disk one
        // expert at a time (llama.cpp's loader likewise advises its whole mapping).
        if plan.budget.is_some()
            && plan.trunk.is_none()
            && !options.resident_trunk
            && store.is_none()
        {
            let embedding: std::collections::HashSet<String> =
                crate::inventory::text_tensors(&config)
                    .into_iter()
                    .filter(|spec| spec.class == crate::inventory::TensorClass::Embedding)
                    .filter_map(|spec| checkpoint.tensor(&spec.name).map(|t| t.name.to_owned()))
                    .collect();
            let started = Instant::now();
            let warmed = checkpoint.warm(|stored| !embedding.contains(stored));
            sink.line(&format!(
                "warmed the mapping: {} of weights {} in {:.1} s",
                crate::budget::gb(warmed.bytes),
                if warmed.populated {
                    "read in and mapped"
                } else {
                    "advised for read-ahead"
                },
                started.elapsed().as_secs_f64()
            ));
        }
        Ok(Self {
            usage_path: store.as_ref().and(experts.usage_path(dir)),
            resident,
            pack,
            clock: Arc::default(),
            config,
            checkpoint,
            kernels,
            pool,
            store,
            plan,
            expert_placement: options.expert_placement,
        })
    }

    /// The model over this engine: its experts from the store where there is one (else
    /// through the file mapping), its work on the pool, experts placed as the options said,
    /// the trunk the plan does not keep resident streamed from disk.
    pub fn model(&self) -> Result<Model<'_>, ModelError> {
        let model = match &self.store {
            Some(store) => Model::with_expert_store(
                &self.checkpoint,
                &self.config,
                self.kernels,
                Arc::clone(store),
            )?,
            None => Model::new(&self.checkpoint, &self.config, self.kernels)?,
        };
        let model = model
            .with_pool(Arc::clone(&self.pool))
            .with_expert_placement(self.expert_placement)
            .with_decode_clock(Arc::clone(&self.clock));
        match &self.plan.trunk {
            // What the plan does not keep resident is read from disk on an I/O thread on
            // domain 0's CPUs (contract 5), a layer ahead of compute.
            Some(trunk) if trunk.streams() || self.resident.is_some() => model.with_planned_trunk(
                &self.checkpoint,
                trunk,
                self.resident.clone(),
                self.pack.clone(),
                &self.pool.topology().domains[0].cpus,
            ),
            _ => Ok(model),
        }
    }

    /// Saves the store's expert use counts for the next start's preload order and policy:
    /// `None` without a store or with the usage cache off, else the file and the outcome (a
    /// read-only checkpoint directory only loses the next start's ordering).
    pub fn save_usage(&self) -> Option<(&Path, Result<(), UsageError>)> {
        let (store, path) = (self.store.as_ref()?, self.usage_path.as_deref()?);
        let mut usage = store.usage();
        if let Some(rates) = self.decode_rates() {
            usage.set_rates(match usage.rates() {
                Some(earlier) => rates.blended(earlier),
                None => rates,
            });
        }
        Some((path, usage.save(path)))
    }

    /// The decode rates of this run, once it decoded [`RATE_STEPS`] one-token steps and read
    /// experts from disk: the store's read rate while reading, and a step's compute time (its
    /// wall time less its waits for reads).
    pub fn decode_rates(&self) -> Option<DecodeRates> {
        let compute = self.clock.per_step(RATE_STEPS)?;
        let stats = self.store.as_ref()?.stats();
        (stats.loads > 0).then(|| DecodeRates {
            read_mbps: (stats.read_gbps() * 1e3).round() as u64,
            compute_us: compute.as_micros() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fingerprint;
    use crate::synth::{Preset, SynthOptions, generate};

    /// A fresh `tiny` checkpoint in its own directory (removed on drop) and its config.
    struct Tiny(PathBuf, K3Config);

    impl Tiny {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("k3-builder-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            generate(&dir, &SynthOptions::new(Preset::Tiny)).unwrap();
            let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
            Self(dir, K3Config::from_json(&text).unwrap())
        }

        fn build(&self, options: &EngineOptions) -> (Engine, Vec<String>) {
            let mut lines = Vec::new();
            let engine =
                Engine::build_within(&self.0, self.1.clone(), options, None, &mut |line: &str| {
                    lines.push(line.to_owned())
                })
                .unwrap();
            (engine, lines)
        }
    }

    impl Drop for Tiny {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The fingerprints of the logits after each of a few teacher-forced tokens.
    fn fingerprints(engine: &Engine) -> Vec<u64> {
        let model = engine.model().unwrap();
        let mut session = model.session();
        let tokens = [5, 17, 42, 7, 300, 2];
        model
            .score(&mut session, &tokens, 1)
            .unwrap()
            .iter()
            .map(|logits| fingerprint(logits))
            .collect()
    }

    fn options(threads: usize) -> EngineOptions {
        let mut options = EngineOptions::default();
        options.pool.threads = Some(threads);
        options.experts.usage_cache = false;
        options
    }

    /// Bytes a packed trunk holds beyond its plan come out of the plan-sized expert cache, or
    /// the build is refused with the numbers.
    #[test]
    fn a_packed_trunk_over_its_plan_takes_from_the_expert_cache() {
        assert_eq!(take_overrun(Some(500), 0, 1000).unwrap(), Some(500));
        assert_eq!(take_overrun(None, 0, 1000).unwrap(), None);
        assert_eq!(take_overrun(Some(500), 200, 1000).unwrap(), Some(300));
        assert_eq!(take_overrun(Some(500), 500, 1000).unwrap(), Some(0));
        for cache in [Some(499), None] {
            let error = take_overrun(cache, 500, 1000).unwrap_err();
            assert!(error.contains("--no-pack-trunk"), "{error}");
        }
    }

    /// Under a budget that everything fits, the mapped weights are read in at startup (all but
    /// the embedding), and the logits are the unbudgeted run's; without a budget nothing is
    /// warmed.
    #[test]
    fn a_budget_that_everything_fits_warms_the_mapping() {
        let tiny = Tiny::new("warm");
        let (plain, lines) = tiny.build(&options(1));
        assert!(!lines.iter().any(|l| l.starts_with("warmed")), "{lines:?}");
        let expected = fingerprints(&plain);
        drop(plain);
        let budget = MemoryBudget {
            bytes: 64 << 30,
            source: "a test budget".into(),
            limit: false,
        };
        let mut lines = Vec::new();
        let engine = Engine::build_within(
            &tiny.0,
            tiny.1.clone(),
            &options(1),
            Some(budget),
            &mut |line: &str| lines.push(line.to_owned()),
        )
        .unwrap();
        assert!(engine.plan.trunk.is_none() && engine.store.is_none());
        let warmed = lines
            .iter()
            .find(|l| l.starts_with("warmed the mapping: "))
            .unwrap_or_else(|| panic!("{lines:?}"));
        // The tiny checkpoint's decode weights: more than nothing, less than the whole file.
        let gb: f64 = warmed["warmed the mapping: ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let file = engine.checkpoint.data_bytes() as f64 / 1e9;
        assert!(gb > 0.0 && gb < file + 0.01, "{warmed} of {file} GB");
        assert!(warmed.contains("read in and mapped"), "{warmed}");
        assert_eq!(fingerprints(&engine), expected);
    }

    /// Under a limit that everything fits, a tier whose packed GEMV runs at the memory's rate
    /// (`avx512`) holds the whole trunk resident and packed and every expert cached, with the
    /// mapped run's logits; the other tiers read through the mapping as without a limit.
    #[test]
    fn a_limit_that_everything_fits_holds_the_trunk_packed() {
        let tiny = Tiny::new("limit");
        let limit = MemoryBudget {
            bytes: 64 << 30,
            source: "a test limit".into(),
            limit: true,
        };
        for kernels in Kernels::available() {
            let mut options = options(1);
            options.kernel_tier = Some(kernels.tier());
            let (plain, _) = tiny.build(&options);
            let expected = fingerprints(&plain);
            drop(plain);
            let mut lines = Vec::new();
            let engine = Engine::build_within_limit(
                &tiny.0,
                tiny.1.clone(),
                &options,
                limit.clone(),
                &mut |line: &str| lines.push(line.to_owned()),
            )
            .unwrap();
            if kernels.packed_at_memory_rate() {
                let trunk = engine.plan.trunk.as_ref().expect("planned");
                assert!(!trunk.streams(), "{lines:?}");
                assert_eq!(engine.plan.expert_fraction, 1.0);
                let packed = engine.resident.as_ref().expect("resident").packed_summary();
                assert!(packed.pieces > 0, "{lines:?}");
                assert!(
                    lines.iter().any(|l| l.starts_with("resident trunk: ")),
                    "{lines:?}"
                );
            } else {
                assert!(engine.plan.trunk.is_none(), "{lines:?}");
                assert!(engine.resident.is_none());
            }
            assert_eq!(fingerprints(&engine), expected, "{}", kernels.tier());
        }
    }

    /// A resident trunk (bound per domain, two synthetic domains) and a preloaded expert store
    /// change where the weights live, never the logits' bits; the sink hears each step.
    #[test]
    fn residency_and_placement_keep_the_logits_bits() {
        let tiny = Tiny::new("bits");
        let (mapped, lines) = tiny.build(&options(1));
        assert!(mapped.store.is_none() && mapped.plan.memory.resident_trunk == 0);
        assert!(
            lines.iter().any(|l| l.starts_with("memory plan: ")),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.contains("1 compute threads")),
            "{lines:?}"
        );
        assert!(
            !lines.iter().any(|l| l.starts_with("resident trunk")),
            "{lines:?}"
        );
        let expected = fingerprints(&mapped);
        drop(mapped);

        let mut resident = options(2);
        resident.pool.fake_domains = Some(2);
        resident.resident_trunk = true;
        resident.experts.preload = true;
        let (engine, lines) = tiny.build(&resident);
        assert!(engine.plan.memory.resident_trunk > 0, "{:?}", engine.plan);
        assert!(engine.store.is_some());
        for start in ["resident trunk: ", "expert store: ", "preloaded "] {
            assert!(
                lines.iter().any(|l| l.starts_with(start)),
                "{start} in {lines:?}"
            );
        }
        assert_eq!(fingerprints(&engine), expected);
        // The usage cache is off: nothing to save.
        assert!(engine.save_usage().is_none());
    }

    /// A budget one byte below the plan's minimum is refused with the numbers and the
    /// budget's source; at the minimum the engine is built with the trunk streamed and the
    /// experts read on every use, and the logits keep their bits.
    #[test]
    fn a_budget_too_small_is_refused_with_numbers() {
        let tiny = Tiny::new("budget");
        let options = options(1);
        let (mapped, _) = tiny.build(&options);
        let expected = fingerprints(&mapped);
        drop(mapped);
        let budget = |bytes| {
            Some(MemoryBudget {
                bytes,
                source: "a test budget".into(),
                limit: false,
            })
        };
        let build = |bytes, lines: &mut Vec<String>| {
            Engine::build_within(
                &tiny.0,
                tiny.1.clone(),
                &options,
                budget(bytes),
                &mut |line: &str| lines.push(line.to_owned()),
            )
        };
        let error = build(1, &mut Vec::new()).unwrap_err();
        let BuildError::Plan(PlanError::BelowMinimum { minimum, .. }) = &error else {
            panic!("{error}")
        };
        let minimum = minimum.total();
        let error = build(minimum - 1, &mut Vec::new()).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("is below this run's minimum"), "{message}");
        assert!(message.contains("a test budget"), "{message}");
        let mut lines = Vec::new();
        let engine = build(minimum, &mut lines).unwrap();
        assert!(engine.plan.streams(), "{}", engine.plan.describe());
        // At the stored plan's minimum the packed plan does not fit (the pack cache's exception
        // blocks and indexes are held too): the matrices stream as stored, and the line says so.
        assert!(engine.pack.is_none());
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("pack cache: not used (the plan with it: ")),
            "{lines:?}"
        );
        assert_eq!(engine.plan.memory.total(), minimum);
        let plan_line = lines.iter().find(|l| l.starts_with("memory plan: "));
        assert!(
            plan_line.is_some_and(|l| l.contains("predicted from disk")),
            "{lines:?}"
        );
        // The streamed layers came from disk: every pass read the streamed trunk (the stream
        // runs up to two layers ahead, so at least the passes made, at most two layers more).
        let model = engine.model().unwrap();
        let mut session = model.session();
        let tokens = [5, 17, 42, 7, 300, 2];
        let logits = model.score(&mut session, &tokens, 1).unwrap();
        let got: Vec<u64> = logits.iter().map(|l| fingerprint(l)).collect();
        assert_eq!(got, expected);
        let streamed = engine.plan.trunk.as_ref().unwrap().streamed_read_bytes();
        let read = model.streamed_trunk_bytes();
        assert!(
            read >= tokens.len() as u64 * streamed && read <= (tokens.len() as u64 + 1) * streamed,
            "{read} bytes read for {} passes of {streamed}",
            tokens.len()
        );
        drop(model);
        drop(engine);
        // Half the layers' trunk resident, the rest streamed, what is left to the expert
        // cache (preloaded): the same bits.
        let sizes = {
            let ckpt = Checkpoint::open(&tiny.0).unwrap();
            WeightSizes::new(&ckpt, &tiny.1).unwrap()
        };
        let layers: u64 = sizes
            .layers
            .iter()
            .flatten()
            .map(crate::plan::StoredTensor::resident_bytes)
            .sum();
        let mut lines = Vec::new();
        let engine = build(minimum + layers / 2, &mut lines).unwrap();
        // The streamed BF16 matrices are read packed from the pack cache, written beside the
        // checkpoint on this first run that streams them.
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("pack cache: ") && l.contains("read packed")),
            "{lines:?}"
        );
        assert!(engine.pack.is_some());
        let trunk = engine.plan.trunk.as_ref().unwrap();
        assert!(trunk.streams() && !trunk.resident.is_empty(), "{trunk:?}");
        assert!(engine.store.is_some());
        // The resident share was read in within the planned size: its BF16 matrices packed
        // (the plan gives them room for 2% of blocks kept as BF16; these need fewer).
        let resident = engine.resident.as_ref().expect("a resident share");
        assert!(resident.bytes() as u64 <= engine.plan.memory.resident_trunk);
        assert!(resident.packed_summary().pieces > 0);
        assert!(
            lines.iter().any(|l| l.starts_with("resident trunk: ")),
            "{lines:?}"
        );
        assert_eq!(fingerprints(&engine), expected);
    }

    /// With the store and the usage cache on, the counts go to the usage file at the path
    /// the options give.
    #[test]
    fn usage_is_saved_to_the_options_path() {
        let tiny = Tiny::new("usage");
        let mut options = options(1);
        options.experts.usage_cache = true;
        options.experts.cache_experts = Some(2);
        let path = tiny.0.join("usage-here.json");
        options.experts.usage_file = Some(path.clone());
        let (engine, _) = tiny.build(&options);
        fingerprints(&engine);
        let (saved, outcome) = engine.save_usage().expect("a store with the usage cache");
        assert_eq!(saved, path);
        outcome.unwrap();
        assert!(path.exists());
        // Six one-token steps read experts: the rates of the five after the first are saved.
        let rates = engine.decode_rates().expect("measured");
        assert!(rates.read_mbps > 0 && rates.compute_us > 0, "{rates:?}");
        let saved = UsageHistory::load(&path).unwrap().unwrap();
        assert_eq!(saved.rates(), Some(rates));
    }

    /// A start whose usage file holds an earlier run's rates, under a budget that streams,
    /// plans the stream to what they hide, with the same logits.
    #[test]
    fn an_earlier_runs_rates_size_the_stream() {
        let tiny = Tiny::new("rates");
        let mut options = options(1);
        let unplanned = fingerprints(&tiny.build(&options).0);
        let path = tiny.0.join("usage-rates.json");
        options.experts.usage_cache = true;
        options.experts.usage_file = Some(path.clone());
        let sizes = WeightSizes::new(&Checkpoint::open(&tiny.0).unwrap(), &tiny.1).unwrap();
        // About half the trunk resident: the trunk-first plan streams the rest.
        options.memory_bytes = Some(sizes.trunk_resident_bytes() / 2 + 2_000_000);
        let first = Engine::build(&tiny.0, tiny.1.clone(), &options, &mut |_: &str| {}).unwrap();
        assert_eq!(first.plan.hidden, None);
        let streamed = first
            .plan
            .trunk
            .as_ref()
            .map_or(0, |t| t.streamed_read_bytes());
        assert!(streamed > 0, "{}", first.plan.describe());
        // Rates that hide more than that: 1 MB/s for as many microseconds as bytes.
        let hidden = streamed + sizes.expert_total / 4;
        let mut history = UsageHistory::default();
        history.set_rates(DecodeRates {
            read_mbps: 1,
            compute_us: hidden,
        });
        history.save(&path).unwrap();
        let second = Engine::build(&tiny.0, tiny.1.clone(), &options, &mut |_: &str| {}).unwrap();
        assert_eq!(second.plan.hidden, Some(hidden));
        assert!(
            second.plan.memory.expert_cache > first.plan.memory.expert_cache,
            "{} / {}",
            first.plan.describe(),
            second.plan.describe()
        );
        assert_eq!(fingerprints(&first), unplanned);
        assert_eq!(fingerprints(&second), unplanned);
    }
}
