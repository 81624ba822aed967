//! The engine assembled: its entry points take the budget, then the phases run in order
//! (`plan`, `trunk`, `experts`, `warm`); the engine makes the models and keeps their decode
//! clock and the store's use counts for the next start.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::io::MemoryBudget;
use expert_store::usage::{DecodeRates, UsageError};
use expert_store::{Checkpoint, ExpertStore};
use mxfp4_kernels::Kernels;
use numa_sched::Pool;

use super::experts::open_store;
use super::options::{BuildError, BuildSink, EngineOptions};
use super::plan::{Planned, plan};
use super::trunk::load_trunk;
use super::warm::warm_mapping;
use crate::config::K3Config;
use crate::knob::Knob;
use crate::model::{DecodeClock, ExpertPlacement, Model, ModelError, ResidentTrunk};
use crate::packcache::place::PackCachePlace;
use crate::packcache::types::{PackCache, PackCacheError};
use crate::plan::{Plan, safety_margin};

/// One-token steps a run decodes (after its first) before [`Engine::decode_rates`] trusts
/// the mean.
pub const RATE_STEPS: u64 = 3;

/// An assembled engine: what a [`Model`] is made from, and what the binaries report on.
#[derive(Debug)]
pub struct Engine {
    /// The validated config.
    pub(super) config: K3Config,
    /// The opened checkpoint (validated against the config; its mapping backs the weights that are
    /// not copied).
    pub(super) checkpoint: Checkpoint,
    /// The kernel tier every model built here computes with.
    pub(super) kernels: Kernels,
    /// The compute threads, by NUMA domain, shared by every model built here.
    pub(super) pool: Arc<Pool>,
    /// The expert store, where the options ask for one (placed, and preloaded if asked).
    pub(super) store: Option<Arc<ExpertStore>>,
    /// The memory plan: the budget split over the run's memory.
    pub(super) plan: Plan,
    pub(super) expert_placement: ExpertPlacement,
    /// Where the store's usage counts are saved ([`Engine::save_usage`]).
    pub(super) usage_path: Option<PathBuf>,
    /// The trunk tensors the plan keeps resident (models built here share them).
    pub(super) resident: Option<Arc<ResidentTrunk>>,
    /// The pack cache the plan reads streamed BF16 matrices from (exception blocks and row
    /// indexes in memory).
    pub(super) pack: Option<Arc<PackCache>>,
    /// The compute time of the one-token passes of every model built here, saved with the
    /// usage counts for the next start's plan.
    pub(super) clock: Arc<DecodeClock>,
    /// The bytes of the matrices a lossy `--trunk-format` requantised, as stored and as held.
    pub(super) requantised: (u64, u64),
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
                    source: "the memory limit given".into(),
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
        let mut planned = plan(dir, &config, options, budget.clone(), margin, sink)?;
        let memory_plan = format!("memory plan: {}", planned.plan.describe());
        match options.memory_bytes {
            // The budget is the caller's: the binary names the option that gave it.
            Some(_) => sink.line_about(&memory_plan, Knob::MemoryLimit),
            None => sink.line(&memory_plan),
        }
        sink.line(&planned.pool.topology().describe());
        sink.line(&format!(
            "kernel tier {}, {} compute threads ({} per domain)",
            planned.kernels.tier(),
            planned.pool.threads(),
            (0..planned.pool.domains())
                .map(|d| planned.pool.domain_threads(d).to_string())
                .collect::<Vec<_>>()
                .join("/")
        ));
        let nodes: Vec<Option<usize>> = planned
            .pool
            .topology()
            .domains
            .iter()
            .map(|d| d.node)
            .collect();
        let (resident, overrun) = match load_trunk(&mut planned, &config, options, &nodes, sink) {
            // A damaged body shows only as the trunk is first read: the file is stale, removed
            // and written again by a second plan (without the cache where it cannot be
            // removed); a second damage is an error.
            Err(BuildError::Model(ModelError::PackCache(PackCacheError::Damaged {
                path,
                tensor,
            }))) => {
                let mut again = options.clone();
                let removed = std::fs::remove_file(&path);
                sink.line(&format!(
                    "pack cache: {} is damaged (the body of {tensor} does not match its \
                     checksum); {}",
                    path.display(),
                    match &removed {
                        Ok(()) => "written again".to_owned(),
                        Err(e) => format!("not used (it cannot be removed: {e})"),
                    }
                ));
                if removed.is_err() {
                    again.pack_cache = PackCachePlace::Off;
                }
                planned = plan(dir, &config, &again, budget, margin, sink)?;
                load_trunk(&mut planned, &config, &again, &nodes, sink)?
            }
            loaded => loaded?,
        };
        let (store, experts) = open_store(&planned, &config, options, overrun, nodes, sink)?;
        warm_mapping(&planned, &config, options, store.as_deref(), sink);
        let requantised = planned.sizes.requantised_bytes();
        let Planned {
            checkpoint,
            plan,
            pack,
            kernels,
            pool,
            ..
        } = planned;
        Ok(Self {
            requantised,
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

    /// The validated config.
    pub fn config(&self) -> &K3Config {
        &self.config
    }

    /// The opened checkpoint (validated against the config).
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The kernel tier every model built here computes with.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The compute threads, by NUMA domain.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The expert store, where the options asked for one.
    pub fn store(&self) -> Option<&Arc<ExpertStore>> {
        self.store.as_ref()
    }

    /// The memory plan: the budget split over the run's memory.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The bytes of the matrices a lossy `--trunk-format` requantised, as stored and as held
    /// (`(0, 0)` for the exact trunk): a token reads the second instead of the first.
    pub fn requantised_bytes(&self) -> (u64, u64) {
        self.requantised
    }

    /// This process's share of the checkpoint among the ranks it runs with (all of it alone).
    pub fn rank_share(&self, ranks: &numa_sched::Ranks) -> crate::shares::RankShare {
        crate::shares::RankShare::of(&self.checkpoint, ranks)
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
