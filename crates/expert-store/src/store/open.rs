//! Opening the store: the expert table from the checkpoint's headers, a reader per shard, the
//! capacity checked against the memory limit, and the I/O threads started; the store's handle
//! ([`ExpertStore`]) and what it tells about itself.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::buffer::{FREE_BUFFERS_PER_THREAD, FreeBuffers, buffer_bytes};
use super::cache::Cache;
use super::config::{Capacity, Result, StoreConfig, StoreError};
use super::shared::{Busy, Job, Located, Shared};
use crate::checkpoint::experts::ExpertLocation;
use crate::checkpoint::open::Checkpoint;
use crate::io::ShardReader;
use crate::layout::ExpertLayout;

/// The routed experts of a checkpoint, behind a residency cache.
pub struct ExpertStore {
    pub(super) shared: Arc<Shared>,
    /// The I/O threads' queue (`None` once the store is dropping).
    pub(super) jobs: Option<Sender<Job>>,
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

/// Where an expert's tensors are and how to read them: one segment per piece, `readers[i]`
/// being the reader of piece `i`'s file.
pub(super) fn locate(readers: &[usize], loc: &ExpertLocation) -> Located {
    let segments: Vec<(usize, Range<usize>)> = loc
        .pieces
        .iter()
        .zip(readers)
        .map(|(piece, &reader)| (reader, piece.range.clone()))
        .collect();
    Located {
        bytes: buffer_bytes(loc),
        tensors: loc
            .tensors
            .iter()
            .zip(&loc.tensor_piece)
            .map(|(t, &piece)| (piece, t.start - loc.pieces[piece].range.start, t.len()))
            .collect(),
        segments,
    }
}
