//! Routed-expert serving as the binaries set it up: the options behind their `--expert-cache`,
//! `--expert-cache-gb`, `--preload-experts`, `--mlock` and `--no-usage-cache` flags (parsed
//! by the binaries, `k3-cli`), opening the [`ExpertStore`] from them (the engine builder does,
//! [`crate::builder`]), and the statistics lines they print.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use expert_store::usage::USAGE_FILE;
use expert_store::{
    Capacity, Checkpoint, ExpertStore, Policy, StoreConfig, StoreError, StoreStats, UsageHistory,
};

use crate::config::K3Config;
use crate::inventory::expert_layout;

/// What the binaries' expert flags ask for. With neither capacity nor preload the model reads
/// experts through the file mapping (the page cache is then the cache).
#[derive(Debug, Clone)]
pub struct ExpertOptions {
    /// `--expert-cache N`: experts per layer kept resident (0: read on every use).
    pub cache_experts: Option<usize>,
    /// `--expert-cache-gb G`: bytes of experts kept resident, over all layers.
    pub cache_bytes: Option<u64>,
    /// `--preload-experts`: fill the cache at startup.
    pub preload: bool,
    /// `--mlock`: pin resident experts.
    pub mlock: bool,
    /// Off with `--no-usage-cache`: read the usage file at startup (preload order, the
    /// usage-weighted policy) and write it at exit. Without it the policy is LRU.
    pub usage_cache: bool,
    /// Where the usage file lives (default: `k3-expert-usage.json` in the checkpoint directory).
    pub usage_file: Option<PathBuf>,
    /// `--expert-policy lru|usage` (default: usage-weighted while the usage cache is on).
    pub policy: Option<Policy>,
    /// `--io-threads N`: reads in flight at once (default 16: all of a K3 layer's misses).
    pub io_threads: usize,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        Self {
            cache_experts: None,
            cache_bytes: None,
            preload: false,
            mlock: false,
            usage_cache: true,
            usage_file: None,
            policy: None,
            io_threads: 16,
        }
    }
}

/// Errors opening the store or its usage file.
#[derive(Debug, thiserror::Error)]
pub enum ExpertOptionsError {
    /// The store could not be opened (a capacity over the memory limit, a shard that would not
    /// open, an I/O thread that would not start).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The usage file could not be read or parsed.
    #[error(transparent)]
    Usage(#[from] expert_store::usage::UsageError),
    /// Both `cache_experts` and `cache_bytes` are set: the capacity is one or the other.
    #[error("an expert cache in experts per layer and one in bytes cannot both be given")]
    TwoCapacities,
}

impl ExpertOptions {
    /// Whether the options ask for the store at all.
    pub fn wants_store(&self) -> bool {
        self.cache_experts.is_some() || self.cache_bytes.is_some() || self.preload
    }

    /// The usage file's path for a checkpoint in `model_dir`; `None` with the usage cache off.
    pub fn usage_path(&self, model_dir: &Path) -> Option<PathBuf> {
        self.usage_cache.then(|| {
            self.usage_file
                .clone()
                .unwrap_or_else(|| model_dir.join(USAGE_FILE))
        })
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.policy.unwrap_or(if self.usage_cache {
            Policy::UsageWeighted
        } else {
            Policy::Lru
        })
    }

    /// Opens the store these options ask for (`None` when they ask for none), with the usage
    /// history read from [`Self::usage_path`] and the capacity checked against
    /// `memory_limit`; its I/O threads run on `io_cpus` (the pool's domain 0 CPUs). Does not
    /// preload: call [`ExpertStore::preload`] with a progress sink.
    pub fn open(
        &self,
        ckpt: &Checkpoint,
        config: &K3Config,
        memory_limit: Option<u64>,
        io_cpus: &[usize],
    ) -> Result<Option<ExpertStore>, ExpertOptionsError> {
        if !self.wants_store() {
            return Ok(None);
        }
        let capacity = match (self.cache_experts, self.cache_bytes) {
            (Some(_), Some(_)) => return Err(ExpertOptionsError::TwoCapacities),
            (Some(n), None) => Capacity::PerLayer(n),
            (None, Some(b)) => Capacity::Bytes(b),
            // Preload alone: everything resident.
            (None, None) => Capacity::PerLayer(usize::MAX),
        };
        let history = match self.usage_path(ckpt.dir()) {
            Some(path) => UsageHistory::load(&path)?,
            None => None,
        };
        let store = ExpertStore::open(
            ckpt,
            expert_layout(config),
            StoreConfig {
                capacity,
                policy: self.policy(),
                io_threads: self.io_threads,
                io_cpus: io_cpus.to_vec(),
                direct_io: true,
                mlock: self.mlock,
                history,
                memory_limit,
            },
        )?;
        Ok(Some(store))
    }
}

/// The statistics a binary prints after a run of `tokens` tokens: totals, then per layer the
/// experts used and the most used ones with their counts.
pub fn stats_report(store: &ExpertStore, stats: &StoreStats, tokens: usize) -> String {
    let mut out = String::new();
    let per_token = |d: std::time::Duration| d.as_secs_f64() * 1e3 / tokens.max(1) as f64;
    let _ = writeln!(
        out,
        "expert store: {} uses, {} hits, {} misses ({:.1}% hit rate); {} loads, {:.2} GB read at {:.2} GB/s while reading ({}); waited {:.1} ms/token on loads ({:.2} s in all); {} experts resident ({:.2} GB){}",
        stats.hits + stats.misses,
        stats.hits,
        stats.misses,
        100.0 * stats.hit_rate(),
        stats.loads,
        stats.bytes_read as f64 / 1e9,
        stats.read_gbps(),
        if store.is_direct() {
            "O_DIRECT"
        } else {
            "buffered"
        },
        per_token(stats.wait),
        stats.wait.as_secs_f64(),
        stats.resident,
        stats.resident_bytes as f64 / 1e9,
        if store.is_full_residency() {
            ", full residency"
        } else {
            ""
        },
    );
    for (layer, experts) in store.layers() {
        let uses = store.uses(layer);
        let mut ranked: Vec<(usize, u64)> = uses.iter().copied().enumerate().collect();
        ranked.sort_by_key(|&(e, n)| (std::cmp::Reverse(n), e));
        let used = uses.iter().filter(|&&n| n > 0).count();
        let top: Vec<String> = ranked
            .iter()
            .take(8)
            .filter(|&&(_, n)| n > 0)
            .map(|(e, n)| format!("{e}:{n}"))
            .collect();
        let _ = writeln!(
            out,
            "  layer {layer}: {used} of {experts} experts used; most used (expert:uses) {}",
            top.join(" ")
        );
    }
    out
}
