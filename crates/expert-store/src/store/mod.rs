//! The routed-expert residency cache: experts read from their shards into owned buffers on a
//! pool of I/O threads, kept up to a capacity (experts per layer, or bytes) under an eviction
//! policy, preloaded on request, with usage statistics.
//!
//! Policy. LRU by default: the expert whose last use is oldest goes first. `UsageWeighted`
//! evicts the expert with the fewest uses (this run's plus an earlier run's, from the usage
//! file), the oldest last use breaking ties. A capacity in experts per layer evicts within the
//! layer that needs room; a capacity in bytes evicts across layers. At full residency (the
//! capacity holds every expert) nothing is ever evicted, so no order is kept at all.
//!
//! Guards. A request hands out [`Expert`]s, each an `Arc` to the buffer: eviction only drops
//! the cache's reference, so an expert stays in memory while a task uses it (the cache can
//! briefly hold more than its capacity by the experts of requests in flight).
//!
//! Loads. A request names all of a layer's selected experts at once; hits come back at once,
//! misses are sent to the I/O threads in file-offset order and come back as they land. Each
//! miss is one `pread` per run of its tensors stored back to back in one file: one when an
//! expert's tensors are contiguous (as in K3's release), several when a re-sharded checkpoint
//! splits them over shards; with `O_DIRECT` where the filesystem allows it. A failed read fails
//! the requests that wanted that expert, naming the file and the expert; nothing else is
//! affected.
//!
//! Layout. Which tensors make up an expert and each matrix's shape come from the caller's
//! [`ExpertLayout`]: the store finds experts by its names and validates every landed expert
//! against its shapes.
//!
//! Determinism. The store decides only when bytes arrive, never what they are: the forward
//! pass writes each expert's output to a slot fixed by the router and sums in a fixed order.
//!
//! Files. `config` (capacity, policy, errors), `cache` (the residency cache: a pure type, no
//! I/O or threads, with the eviction order's unit tests), `buffer` (expert buffers, guards, the
//! free list), `loader` (reads on the I/O threads),
//! `placement` (NUMA homes and binding), `preload`, `request`, `stats`; this file opens the
//! store and holds the state the I/O threads share.

mod buffer;
mod cache;
mod config;
mod loader;
mod placement;
mod preload;
mod request;
mod stats;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use buffer::{ExpertData, FREE_BUFFERS_PER_THREAD, FreeBuffers};
use cache::Cache;
use loader::{Job, Located, locate};
use placement::Placement;
use request::Landed;
use stats::Busy;

use crate::checkpoint::Checkpoint;
use crate::io::ShardReader;
use crate::layout::ExpertLayout;
use crate::usage::UsageHistory;

pub use buffer::{Expert, buffer_bytes, io_buffers, request_buffers};
pub use config::{Capacity, Policy, Result, StoreConfig, StoreError};
pub use preload::{PreloadProgress, PreloadReport};
pub use request::Request;
pub use stats::StoreStats;

/// The store's cache: resident experts as shared buffers, loads waited on by request channels.
type ExpertCache = Cache<Arc<ExpertData>, (Sender<Landed>, usize)>;

struct Shared {
    layout: ExpertLayout,
    /// Checkpoint layer index -> position in `order`/`uses`.
    layer_pos: BTreeMap<usize, usize>,
    experts_per_layer: Vec<usize>,
    table: HashMap<(usize, usize), Located>,
    readers: Vec<ShardReader>,
    capacity: Capacity,
    full: bool,
    policy: Policy,
    history: UsageHistory,
    mlock: AtomicBool,
    buffered_said: AtomicBool,
    cache: Mutex<ExpertCache>,
    uses: Vec<Vec<AtomicU64>>,
    hits: AtomicU64,
    misses: AtomicU64,
    loads: AtomicU64,
    bytes_read: AtomicU64,
    wait_ns: AtomicU64,
    requests: AtomicU64,
    busy: Mutex<Busy>,
    placement: std::sync::OnceLock<Placement>,
    free: Arc<FreeBuffers>,
    /// Reads one request keeps outstanding at most ([`ExpertStore::window`]).
    window: usize,
}

/// The routed experts of a checkpoint, behind a residency cache.
pub struct ExpertStore {
    shared: Arc<Shared>,
    jobs: Option<Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ExpertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("layers", &self.shared.layer_pos.len())
            .field("capacity", &self.shared.capacity)
            .field("full", &self.shared.full)
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}

impl ExpertStore {
    /// Builds the store over `checkpoint`'s routed experts, found by `layout`'s tensor names
    /// (from the headers; no expert byte is read here). Refuses a capacity larger than
    /// `config.memory_limit`.
    pub fn open(
        checkpoint: &Checkpoint,
        layout: ExpertLayout,
        config: StoreConfig,
    ) -> Result<Self> {
        if config.io_threads == 0 {
            return Err(StoreError::NoIoThreads);
        }
        let table = checkpoint
            .expert_table(&layout)
            .map_err(|e| StoreError::Open {
                path: checkpoint.dir().to_owned(),
                reason: e.to_string(),
            })?;
        let mut paths: Vec<PathBuf> = Vec::new();
        let mut located = HashMap::new();
        let mut experts_per_layer: BTreeMap<usize, usize> = BTreeMap::new();
        for ((layer, expert), loc) in &table {
            let readers: Vec<usize> = loc
                .pieces
                .iter()
                .map(|piece| match paths.iter().position(|p| *p == piece.path) {
                    Some(i) => i,
                    None => {
                        paths.push(piece.path.clone());
                        paths.len() - 1
                    }
                })
                .collect();
            located.insert((*layer, *expert), locate(&readers, loc));
            let n = experts_per_layer.entry(*layer).or_default();
            *n = (*n).max(expert + 1);
        }
        let readers = paths
            .iter()
            .map(|p| {
                ShardReader::open(p, config.direct_io).map_err(|e| StoreError::Open {
                    path: p.clone(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let layer_pos: BTreeMap<usize, usize> = experts_per_layer
            .keys()
            .enumerate()
            .map(|(i, &l)| (l, i))
            .collect();
        let counts: Vec<usize> = experts_per_layer.values().copied().collect();
        let total_bytes: u64 = located.values().map(|l: &Located| l.bytes).sum();
        let largest_layer = counts.iter().copied().max().unwrap_or(0);
        let expert_bytes = located.values().map(|l| l.bytes).max().unwrap_or(0);
        let (full, capacity_bytes, what) = match config.capacity {
            Capacity::PerLayer(n) => (
                n >= largest_layer,
                counts.iter().map(|&c| c.min(n) as u64).sum::<u64>() * expert_bytes,
                format!("{n} experts per layer x {} layers", counts.len()),
            ),
            Capacity::Bytes(b) => (b >= total_bytes, b.min(total_bytes), format!("{b} bytes")),
        };
        if let Some(available) = config.memory_limit
            && capacity_bytes > available
        {
            let per_layer = available / expert_bytes.max(1) / counts.len().max(1) as u64;
            return Err(StoreError::TooLarge {
                requested: capacity_bytes,
                available,
                what,
                fits: format!(
                    "{per_layer} experts per layer ({:.1} GB of {:.0} MB experts)",
                    (per_layer * expert_bytes * counts.len() as u64) as f64 / 1e9,
                    expert_bytes as f64 / 1e6
                ),
            });
        }
        let shared = Arc::new(Shared {
            layout,
            uses: counts
                .iter()
                .map(|&n| (0..n).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            cache: Mutex::new(Cache::new(
                layer_pos.keys().copied().collect(),
                config.capacity,
                full,
                config.policy,
            )),
            layer_pos,
            experts_per_layer: counts,
            table: located,
            readers,
            capacity: config.capacity,
            full,
            policy: config.policy,
            history: config.history.unwrap_or_default(),
            mlock: AtomicBool::new(config.mlock),
            buffered_said: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            busy: Mutex::new(Busy {
                in_flight: 0,
                since: Instant::now(),
                total: Duration::ZERO,
            }),
            placement: std::sync::OnceLock::new(),
            free: Arc::new(FreeBuffers {
                list: Mutex::new(Vec::new()),
                max: FREE_BUFFERS_PER_THREAD * config.io_threads,
            }),
            window: config.io_threads,
        });
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let threads = (0..config.io_threads)
            .map(|i| {
                let queue = queue.clone();
                let shared = Arc::clone(&shared);
                numa_sched::spawn_io_thread(i, &config.io_cpus, move || {
                    for job in queue {
                        shared.load(job.key);
                    }
                })
                .map_err(|e| StoreError::Open {
                    path: checkpoint.dir().to_owned(),
                    reason: format!("starting I/O thread {i}: {e}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let store = Self {
            shared,
            jobs: Some(jobs),
            threads,
        };
        store.shared.say_if_buffered();
        Ok(store)
    }

    /// Expert `expert`'s home domain in checkpoint layer `layer` (0 before [`Self::place`]).
    pub fn home(&self, layer: usize, expert: usize) -> usize {
        self.shared.home(layer, expert)
    }

    /// The layout the store finds experts by and validates each landed expert against.
    pub fn layout(&self) -> &ExpertLayout {
        &self.shared.layout
    }

    /// Whether the capacity holds every expert (nothing is ever evicted).
    pub fn is_full_residency(&self) -> bool {
        self.shared.full
    }

    /// The checkpoint layers that have routed experts, with each one's expert count.
    pub fn layers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.shared
            .layer_pos
            .iter()
            .map(|(&l, &i)| (l, self.shared.experts_per_layer[i]))
    }

    /// Whether every shard is read with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.shared.readers.iter().all(ShardReader::is_direct)
    }

    /// The shard files expert reads go to.
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shared
            .readers
            .iter()
            .map(|r| r.path.as_path())
            .collect()
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        // Closing the queue ends the I/O threads once the reads in it are done.
        self.jobs = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ExpertCache> {
        // A panic elsewhere cannot leave the cache half-updated in a way that matters here:
        // every update is a few map operations; keep serving.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}
