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
//! miss is one `pread` per run of its tensors stored back to back in one file: one when the
//! six tensors are contiguous (the release's layout), several when a re-sharded checkpoint
//! splits them over shards; with `O_DIRECT` where the filesystem allows it. A failed read fails the requests that
//! wanted that expert, naming the file and the expert; nothing else is affected.
//!
//! Determinism. The store decides only when bytes arrive, never what they are: the forward
//! pass writes each expert's output to a slot fixed by the router and sums in a fixed order.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use mxfp4_kernels::MxFp4Matrix;

use crate::checkpoint::{Checkpoint, ExpertLocation};
use crate::io::{AlignedBuf, ShardReader, memlock_limit, read_pieces};
use crate::usage::UsageHistory;

/// The shapes of a routed expert: gate and up are `[intermediate, io]`, down `[io, intermediate]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    pub intermediate: usize,
    pub io: usize,
}

/// How much the cache may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// At most this many experts of each layer (0: every expert is read on use and dropped
    /// after; the layer's expert count or more: full residency).
    PerLayer(usize),
    /// At most this many bytes of expert buffers, over all layers.
    Bytes(u64),
}

/// Which resident expert makes room for a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    Lru,
    UsageWeighted,
}

/// How the store is set up; the binaries fill it from their flags.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub capacity: Capacity,
    pub policy: Policy,
    /// Threads issuing reads (the queue depth the disk sees; default 16, a K3 layer's top-k, so
    /// every miss of a layer is in flight at once).
    pub io_threads: usize,
    /// Read with `O_DIRECT` where the filesystem allows it.
    pub direct_io: bool,
    /// `mlock` every resident buffer (a failure is logged once and pinning stops).
    pub mlock: bool,
    /// Use counts of an earlier run: preload order and the usage-weighted policy's seed.
    pub history: Option<UsageHistory>,
    /// Memory the capacity must fit in (e.g. [`crate::io::memory_available`]); checked at open.
    pub memory_limit: Option<u64>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            capacity: Capacity::PerLayer(usize::MAX),
            policy: Policy::Lru,
            io_threads: 16,
            direct_io: true,
            mlock: false,
            history: None,
            memory_limit: None,
        }
    }
}

/// Errors of the store. Cloned to every request that waited on the same failed read.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("layer {layer} has no routed expert {expert} in the checkpoint")]
    NoExpert { layer: usize, expert: usize },
    #[error("{path}: layer {layer} expert {expert}: {reason}")]
    Read {
        path: PathBuf,
        layer: usize,
        expert: usize,
        reason: String,
    },
    #[error("{path}: opening for expert reads: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error(
        "an expert cache of {requested} bytes ({what}) does not fit the {available} bytes of memory available; ask for at most {fits}"
    )]
    TooLarge {
        requested: u64,
        available: u64,
        what: String,
        fits: String,
    },
    #[error("the expert store needs at least one I/O thread")]
    NoIoThreads,
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An expert's bytes in memory, validated once when it landed.
#[derive(Debug)]
struct ExpertData {
    /// gate, up, down over `buf`.
    views: [MxFp4Matrix<'static>; 3],
    /// Owns the bytes `views` borrow; never moved or mutated while they live, and handed
    /// back to `free` only when this drops (no view can outlive it: see `Expert`).
    buf: Option<AlignedBuf>,
    /// Buffer bytes the cache counts for this expert.
    size: u64,
    free: Arc<FreeBuffers>,
}

impl ExpertData {
    fn bytes(&self) -> u64 {
        self.size
    }
}

impl Drop for ExpertData {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.free.give(buf);
        }
    }
}

/// Buffers of dropped experts the store keeps for the next loads, per I/O thread: enough that
/// every load in flight finds one in steady state.
const FREE_BUFFERS_PER_THREAD: usize = 2;

/// Expert-sized buffers the store may hold beyond its capacity: the free list and one read in
/// flight per I/O thread (the memory budget counts them).
pub fn io_buffers(io_threads: usize) -> usize {
    (FREE_BUFFERS_PER_THREAD + 1) * io_threads
}

/// Bytes of the buffer one expert at `loc` is read into (each piece rounded out to 4 KiB).
pub fn buffer_bytes(loc: &ExpertLocation) -> u64 {
    loc.pieces
        .iter()
        .map(|piece| crate::io::aligned_span(&piece.range).1 as u64)
        .sum()
}

/// Buffers of dropped experts, kept for the next loads (at most `max`).
#[derive(Debug)]
struct FreeBuffers {
    list: Mutex<Vec<AlignedBuf>>,
    max: usize,
}

impl FreeBuffers {
    fn give(&self, buf: AlignedBuf) {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        if list.len() < self.max {
            list.push(buf);
        }
    }

    fn take(&self) -> Option<AlignedBuf> {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }
}

/// A resident expert, held for as long as this guard lives (eviction cannot free it).
#[derive(Debug, Clone)]
pub struct Expert(Arc<ExpertData>);

impl Expert {
    /// gate (`w1`), up (`w3`) and down (`w2`).
    pub fn matrices(&self) -> [MxFp4Matrix<'_>; 3] {
        // 'static shortens to the guard's borrow: the buffer outlives it.
        self.0.views
    }
}

/// Totals since the store opened (or since [`ExpertStore::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StoreStats {
    /// Expert uses served from memory.
    pub hits: u64,
    /// Expert uses that needed a read (or joined one in flight).
    pub misses: u64,
    /// Experts read from disk, and their bytes (aligned reads included).
    pub loads: u64,
    pub bytes_read: u64,
    /// Wall time during which at least one read was in flight.
    pub read_busy: Duration,
    /// Time the forward pass spent blocked waiting for a load.
    pub wait: Duration,
    /// Experts resident now, and their bytes.
    pub resident: u64,
    pub resident_bytes: u64,
    /// Requests (one per layer per forward step).
    pub requests: u64,
}

impl StoreStats {
    /// Bytes read per second of read-busy time.
    pub fn read_gbps(&self) -> f64 {
        let secs = self.read_busy.as_secs_f64();
        if secs > 0.0 {
            self.bytes_read as f64 / secs / 1e9
        } else {
            0.0
        }
    }

    /// Hits over uses.
    pub fn hit_rate(&self) -> f64 {
        let uses = self.hits + self.misses;
        if uses == 0 {
            0.0
        } else {
            self.hits as f64 / uses as f64
        }
    }
}

/// Progress of [`ExpertStore::preload`], reported after each expert lands.
#[derive(Debug, Clone, Copy)]
pub struct PreloadProgress {
    pub experts_done: usize,
    pub experts_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// What [`ExpertStore::preload`] did.
#[derive(Debug, Clone, Copy)]
pub struct PreloadReport {
    pub experts: usize,
    pub bytes: u64,
    pub elapsed: Duration,
}

impl PreloadReport {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// A table entry: where the expert is and how to read it.
#[derive(Debug)]
struct Located {
    /// The file ranges read, in file order, as (reader, range): one per run of tensors stored
    /// back to back in one file (one in the release's layout).
    segments: Vec<(usize, Range<usize>)>,
    /// Each tensor's position as (segment, offset from the segment's start, length).
    tensors: [(usize, usize, usize); 6],
    /// Buffer bytes a resident copy takes (segments rounded out to 4 KiB).
    bytes: u64,
}

impl Located {
    /// Where the first read goes: the key that sorts loads into file order.
    fn file_order(&self) -> (usize, usize) {
        self.segments
            .first()
            .map_or((0, 0), |(reader, range)| (*reader, range.start))
    }

    /// The file of the first segment, naming the expert in errors.
    fn first_reader(&self) -> usize {
        self.file_order().0
    }
}

/// What the cache knows of one expert.
enum Slot {
    Resident {
        data: Arc<ExpertData>,
        /// Its key in the layer's eviction order (absent at full residency).
        rank: (u64, u64),
    },
    Loading {
        waiters: Vec<(Sender<Landed>, usize)>,
    },
}

type Landed = (usize, Result<Expert>);

struct Cache {
    slots: HashMap<(usize, usize), Slot>,
    /// Per layer (index into `layers`): resident experts by (priority, last use tick).
    order: Vec<BTreeSet<(u64, u64, usize)>>,
    resident_per_layer: Vec<usize>,
    resident: u64,
    resident_bytes: u64,
    tick: u64,
}

struct Busy {
    in_flight: usize,
    since: Instant,
    total: Duration,
}

struct Shared {
    shape: ExpertShape,
    /// Checkpoint layer index -> position in `order`/`uses`.
    layer_pos: BTreeMap<usize, usize>,
    /// Position -> checkpoint layer index (the inverse of `layer_pos`).
    layer_ids: Vec<usize>,
    experts_per_layer: Vec<usize>,
    table: HashMap<(usize, usize), Located>,
    readers: Vec<ShardReader>,
    capacity: Capacity,
    full: bool,
    policy: Policy,
    history: UsageHistory,
    mlock: AtomicBool,
    buffered_said: AtomicBool,
    cache: Mutex<Cache>,
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
}

/// Each expert's home domain, and the NUMA nodes (if any) its buffer is bound to.
#[derive(Debug)]
struct Placement {
    /// Per layer position, per expert id.
    homes: Vec<Vec<u16>>,
    /// Per domain: the node to bind buffers to (`None`: first touch).
    nodes: Vec<Option<usize>>,
    /// Every expert's rows spread over the domains (else whole on its home).
    split_rows: bool,
}

/// A job for the I/O threads.
struct Job {
    key: (usize, usize),
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
    /// Builds the store over `checkpoint`'s routed experts (from its headers; no expert byte
    /// is read here). Refuses a capacity larger than `config.memory_limit`.
    pub fn open(checkpoint: &Checkpoint, shape: ExpertShape, config: StoreConfig) -> Result<Self> {
        if config.io_threads == 0 {
            return Err(StoreError::NoIoThreads);
        }
        let table = checkpoint.expert_table().map_err(|e| StoreError::Open {
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
            shape,
            uses: counts
                .iter()
                .map(|&n| (0..n).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            cache: Mutex::new(Cache {
                slots: HashMap::new(),
                order: counts.iter().map(|_| BTreeSet::new()).collect(),
                resident_per_layer: vec![0; counts.len()],
                resident: 0,
                resident_bytes: 0,
                tick: 0,
            }),
            layer_ids: layer_pos.keys().copied().collect(),
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
        });
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let threads = (0..config.io_threads)
            .map(|i| {
                let queue = queue.clone();
                let shared = Arc::clone(&shared);
                numa_sched::spawn_io_thread(i, move || {
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

    /// Gives every expert a home among `nodes.len()` domains (`nodes[d]`: the NUMA node of
    /// domain `d`, or `None` for a synthetic one) and binds the buffers of experts loaded from
    /// now on: with `split_rows`, each tensor's rows evenly over the domains' nodes (where the
    /// forward pass reads them with split placement), else the whole buffer on the home's
    /// node. Homes balance the expected load per layer: experts in
    /// order of their earlier-run use counts (most used first, ties by id) each go to the
    /// domain with the least load so far, counting a never-seen expert as one use; with no
    /// counts that is round-robin by id. Call once, before the first request or preload;
    /// later calls change nothing (returns false).
    pub fn place(&self, nodes: Vec<Option<usize>>, split_rows: bool) -> bool {
        let shared = &self.shared;
        let domains = nodes.len().max(1);
        let homes = shared
            .layer_pos
            .iter()
            .map(|(&layer, &pos)| {
                let n = shared.experts_per_layer[pos];
                let weight = |e: usize| shared.history.count(layer, e).max(1);
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by_key(|&e| (std::cmp::Reverse(weight(e)), e));
                let mut load = vec![0u64; domains];
                let mut homes = vec![0u16; n];
                for e in order {
                    let d = (0..domains)
                        .min_by_key(|&d| (load[d], d))
                        .expect("at least one domain");
                    load[d] += weight(e);
                    homes[e] = d as u16;
                }
                homes
            })
            .collect();
        shared
            .placement
            .set(Placement {
                homes,
                nodes,
                split_rows,
            })
            .is_ok()
    }

    /// Expert `expert`'s home domain in checkpoint layer `layer` (0 before [`Self::place`]).
    pub fn home(&self, layer: usize, expert: usize) -> usize {
        self.shared.home(layer, expert)
    }

    /// The expert shapes the store validates each landed expert against.
    pub fn shape(&self) -> ExpertShape {
        self.shared.shape
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

    /// Asks for `experts` of checkpoint layer `layer`: resident ones are ready at once, the
    /// others are read in file-offset order on the I/O threads. Results are indexed by the
    /// position in `experts`.
    pub fn request(&self, layer: usize, experts: &[usize]) -> Request {
        let shared = &self.shared;
        shared.requests.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut ready = VecDeque::new();
        let mut to_load = Vec::new();
        let mut pending = 0;
        let Some(&pos) = shared.layer_pos.get(&layer) else {
            for (i, &expert) in experts.iter().enumerate() {
                ready.push_back((i, Err(StoreError::NoExpert { layer, expert })));
            }
            return Request::new(ready, rx, 0, Arc::clone(shared));
        };
        {
            let mut guard = shared.lock();
            let cache = &mut *guard;
            for (i, &expert) in experts.iter().enumerate() {
                if !shared.table.contains_key(&(layer, expert)) {
                    ready.push_back((i, Err(StoreError::NoExpert { layer, expert })));
                    continue;
                }
                if let Some(uses) = shared.uses[pos].get(expert) {
                    uses.fetch_add(1, Ordering::Relaxed);
                }
                let tick = cache.next_tick();
                match cache.slots.get_mut(&(layer, expert)) {
                    Some(Slot::Resident { data, rank }) => {
                        shared.hits.fetch_add(1, Ordering::Relaxed);
                        let data = Arc::clone(data);
                        if !shared.full {
                            let old = *rank;
                            *rank = (shared.priority(layer, expert), tick);
                            let new = *rank;
                            cache.order[pos].remove(&(old.0, old.1, expert));
                            cache.order[pos].insert((new.0, new.1, expert));
                        }
                        ready.push_back((i, Ok(Expert(data))));
                    }
                    Some(Slot::Loading { waiters }) => {
                        shared.misses.fetch_add(1, Ordering::Relaxed);
                        waiters.push((tx.clone(), i));
                        pending += 1;
                    }
                    None => {
                        shared.misses.fetch_add(1, Ordering::Relaxed);
                        cache.slots.insert(
                            (layer, expert),
                            Slot::Loading {
                                waiters: vec![(tx.clone(), i)],
                            },
                        );
                        to_load.push((layer, expert));
                        pending += 1;
                    }
                }
            }
        }
        self.send_in_file_order(to_load);
        Request::new(ready, rx, pending, Arc::clone(shared))
    }

    /// Reads experts into the cache before any request: every expert at full residency, else
    /// the ones an earlier run used most (per layer for a per-layer capacity, over all layers
    /// for a byte capacity) up to the capacity, issued in file order. `progress` is called
    /// after each expert lands. An expert already resident is skipped.
    pub fn preload(&self, mut progress: impl FnMut(PreloadProgress)) -> Result<PreloadReport> {
        let shared = &self.shared;
        let chosen = shared.preload_choice();
        let start = Instant::now();
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut to_load = Vec::new();
        {
            let mut cache = shared.lock();
            for (n, &key) in chosen.iter().enumerate() {
                if cache.slots.contains_key(&key) {
                    continue;
                }
                cache.slots.insert(
                    key,
                    Slot::Loading {
                        waiters: vec![(tx.clone(), n)],
                    },
                );
                to_load.push(key);
            }
        }
        drop(tx);
        let bytes_total: u64 = to_load.iter().map(|k| shared.table[k].bytes).sum();
        let experts_total = to_load.len();
        self.send_in_file_order(to_load);
        let mut done = PreloadProgress {
            experts_done: 0,
            experts_total,
            bytes_done: 0,
            bytes_total,
        };
        let mut first_error = None;
        for (n, landed) in rx.iter() {
            match landed {
                Ok(_) => {
                    done.experts_done += 1;
                    done.bytes_done += shared.table[&chosen[n]].bytes;
                    progress(done);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(PreloadReport {
            experts: done.experts_done,
            bytes: done.bytes_done,
            elapsed: start.elapsed(),
        })
    }

    /// Totals so far.
    pub fn stats(&self) -> StoreStats {
        let s = &self.shared;
        let busy = {
            let busy = s.busy.lock().unwrap_or_else(|p| p.into_inner());
            busy.total
                + if busy.in_flight > 0 {
                    busy.since.elapsed()
                } else {
                    Duration::ZERO
                }
        };
        let cache = s.lock();
        StoreStats {
            hits: s.hits.load(Ordering::Relaxed),
            misses: s.misses.load(Ordering::Relaxed),
            loads: s.loads.load(Ordering::Relaxed),
            bytes_read: s.bytes_read.load(Ordering::Relaxed),
            read_busy: busy,
            wait: Duration::from_nanos(s.wait_ns.load(Ordering::Relaxed)),
            resident: cache.resident,
            resident_bytes: cache.resident_bytes,
            requests: s.requests.load(Ordering::Relaxed),
        }
    }

    /// Zeroes the counters (not the residency or the use counts): for timing a phase.
    pub fn reset_stats(&self) {
        let s = &self.shared;
        for counter in [
            &s.hits,
            &s.misses,
            &s.loads,
            &s.bytes_read,
            &s.wait_ns,
            &s.requests,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        s.busy.lock().unwrap_or_else(|p| p.into_inner()).total = Duration::ZERO;
    }

    /// Uses of each expert this run, per checkpoint layer.
    pub fn uses(&self, layer: usize) -> Vec<u64> {
        self.shared
            .layer_pos
            .get(&layer)
            .map(|&pos| {
                self.shared.uses[pos]
                    .iter()
                    .map(|u| u.load(Ordering::Relaxed))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The earlier run's counts plus this run's: what to save for the next start.
    pub fn usage(&self) -> UsageHistory {
        let mut history = self.shared.history.clone();
        for (&layer, &pos) in &self.shared.layer_pos {
            for (expert, uses) in self.shared.uses[pos].iter().enumerate() {
                let n = uses.load(Ordering::Relaxed);
                if n > 0 {
                    history.add(layer, expert, n);
                }
            }
        }
        history
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

    fn send_in_file_order(&self, mut keys: Vec<(usize, usize)>) {
        let table = &self.shared.table;
        keys.sort_by_key(|k| table[k].file_order());
        let jobs = self
            .jobs
            .as_ref()
            .expect("the job queue lives as long as the store");
        for key in keys {
            // The I/O threads only stop when the store drops, after this.
            let _ = jobs.send(Job { key });
        }
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

impl Cache {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

impl Shared {
    /// Says once that some expert reads go through the page cache: at open (O_DIRECT refused
    /// or not asked for) or when a read first falls back (O_DIRECT refused at read time).
    fn say_if_buffered(&self) {
        if self.buffered_said.load(Ordering::Relaxed) {
            return;
        }
        let buffered: Vec<String> = self
            .readers
            .iter()
            .filter(|r| !r.is_direct())
            .map(|r| r.path.display().to_string())
            .collect();
        if !buffered.is_empty() && !self.buffered_said.swap(true, Ordering::Relaxed) {
            log::warn!(
                "expert reads go through the page cache (O_DIRECT not available or not asked for) for {}; pages are dropped after each read",
                buffered.join(", ")
            );
        }
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        // A panic elsewhere cannot leave the cache half-updated in a way that matters here:
        // every update is a few map operations; keep serving.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn home(&self, layer: usize, expert: usize) -> usize {
        let (Some(placement), Some(&pos)) = (self.placement.get(), self.layer_pos.get(&layer))
        else {
            return 0;
        };
        placement.homes[pos]
            .get(expert)
            .map_or(0, |&d| usize::from(d))
    }

    /// Binds a new buffer of `key` (segments starting at `starts`) to its nodes, before the
    /// read faults its pages in. A refusal (no NUMA support) leaves first touch to place them.
    fn bind(&self, key: (usize, usize), located: &Located, buf: &mut [u8], starts: &[usize]) {
        let Some(placement) = self.placement.get() else {
            return;
        };
        if placement.nodes.iter().all(Option::is_none) {
            return;
        }
        if !placement.split_rows {
            if let Some(node) = placement
                .nodes
                .get(self.home(key.0, key.1))
                .copied()
                .flatten()
            {
                numa_sched::memory::bind_whole_pages(buf, node);
            }
            return;
        }
        let ExpertShape { intermediate, io } = self.shape;
        for (i, &(segment, offset, len)) in located.tensors.iter().enumerate() {
            // gate and up are [intermediate, io]; down is [io, intermediate].
            let rows = if i < 4 { intermediate } else { io };
            let at = starts[segment] + offset;
            numa_sched::memory::bind_row_split(&mut buf[at..at + len], rows, &placement.nodes);
        }
    }

    fn priority(&self, layer: usize, expert: usize) -> u64 {
        match self.policy {
            Policy::Lru => 0,
            Policy::UsageWeighted => {
                let pos = self.layer_pos[&layer];
                self.history.count(layer, expert)
                    + self.uses[pos]
                        .get(expert)
                        .map_or(0, |u| u.load(Ordering::Relaxed))
            }
        }
    }

    /// The experts preload reads: all at full residency, else the most used first.
    fn preload_choice(&self) -> Vec<(usize, usize)> {
        let mut all: Vec<(usize, usize)> = self.table.keys().copied().collect();
        all.sort_unstable();
        if self.full {
            return all;
        }
        // Hottest first by the earlier run's counts; ties in (layer, id) order.
        all.sort_by_key(|&(l, e)| (std::cmp::Reverse(self.history.count(l, e)), l, e));
        match self.capacity {
            Capacity::PerLayer(n) => {
                let mut taken = vec![0usize; self.layer_pos.len()];
                all.into_iter()
                    .filter(|(l, _)| {
                        let t = &mut taken[self.layer_pos[l]];
                        *t += 1;
                        *t <= n
                    })
                    .collect()
            }
            Capacity::Bytes(budget) => {
                let mut used = 0u64;
                all.into_iter()
                    .filter(|k| {
                        let bytes = self.table[k].bytes;
                        let fits = used + bytes <= budget;
                        if fits {
                            used += bytes;
                        }
                        fits
                    })
                    .collect()
            }
        }
    }

    /// Runs on an I/O thread: reads `key`, makes it resident if the capacity allows, and
    /// answers everyone waiting for it.
    fn load(&self, key: (usize, usize)) {
        let (layer, expert) = key;
        let located = &self.table[&key];
        let pieces: Vec<(&ShardReader, Range<usize>)> = located
            .segments
            .iter()
            .map(|(reader, range)| (&self.readers[*reader], range.clone()))
            .collect();
        self.busy_change(true);
        let read = read_pieces(&pieces, self.free.take(), |buf, starts| {
            self.bind(key, located, buf, starts)
        });
        self.busy_change(false);
        if pieces.iter().any(|(reader, _)| !reader.is_direct()) {
            self.say_if_buffered();
        }
        let result = read
            .map_err(|e| StoreError::Read {
                path: e.path,
                layer,
                expert,
                reason: e.source.to_string(),
            })
            .and_then(|(buf, starts)| {
                self.loads.fetch_add(1, Ordering::Relaxed);
                self.bytes_read.fetch_add(located.bytes, Ordering::Relaxed);
                self.build(key, located, buf, &starts)
            });
        let mut cache = self.lock();
        let waiters = match cache.slots.remove(&key) {
            Some(Slot::Loading { waiters }) => waiters,
            Some(resident) => {
                // Cannot happen (only one load per key is in flight); keep what is there.
                cache.slots.insert(key, resident);
                Vec::new()
            }
            None => Vec::new(),
        };
        if let Ok(data) = &result {
            self.admit(&mut cache, key, data);
        }
        drop(cache);
        for (tx, index) in waiters {
            let landed = result.clone().map(Expert);
            // A request dropped before its experts landed no longer listens: nothing to do.
            let _ = tx.send((index, landed));
        }
    }

    fn build(
        &self,
        key: (usize, usize),
        located: &Located,
        buf: AlignedBuf,
        starts: &[usize],
    ) -> Result<Arc<ExpertData>> {
        let (layer, expert) = key;
        let ExpertShape { intermediate, io } = self.shape;
        let part = |i: usize| -> &'static [u8] {
            let (segment, offset, len) = located.tensors[i];
            let at = starts[segment] + offset;
            // SAFETY: `buf` is moved into the ExpertData below, next to these views, and is
            // never mutated or freed while they live: an `Expert` hands them out only for
            // the duration of a borrow of itself, which keeps the buffer alive.
            unsafe { std::slice::from_raw_parts(buf[at..at + len].as_ptr(), len) }
        };
        let view = |what: &'static str, base: usize, rows: usize, cols: usize| {
            MxFp4Matrix::with_name(what, part(base), part(base + 1), rows, cols).map_err(|e| {
                StoreError::Read {
                    path: self.readers[located.first_reader()].path.clone(),
                    layer,
                    expert,
                    reason: e.to_string(),
                }
            })
        };
        let views = [
            view("expert w1 (gate)", 0, intermediate, io)?,
            view("expert w3 (up)", 2, intermediate, io)?,
            view("expert w2 (down)", 4, io, intermediate)?,
        ];
        Ok(Arc::new(ExpertData {
            views,
            buf: Some(buf),
            size: located.bytes,
            free: Arc::clone(&self.free),
        }))
    }

    /// Makes a landed expert resident when the capacity allows, evicting by the policy.
    fn admit(&self, cache: &mut Cache, key: (usize, usize), data: &Arc<ExpertData>) {
        let (layer, expert) = key;
        let pos = self.layer_pos[&layer];
        let bytes = data.bytes();
        if !self.full {
            match self.capacity {
                Capacity::PerLayer(0) => return,
                Capacity::PerLayer(n) => {
                    while cache.resident_per_layer[pos] >= n {
                        if !self.evict_from(cache, pos) {
                            return;
                        }
                    }
                }
                Capacity::Bytes(budget) => {
                    if bytes > budget {
                        return;
                    }
                    while cache.resident_bytes + bytes > budget {
                        // The globally lowest (priority, tick) among every layer's first.
                        let victim = cache
                            .order
                            .iter()
                            .enumerate()
                            .filter_map(|(p, set)| set.first().map(|&(a, b, _)| ((a, b), p)))
                            .min();
                        match victim {
                            Some((_, p)) => {
                                self.evict_from(cache, p);
                            }
                            None => return,
                        }
                    }
                }
            }
        }
        let rank = if self.full {
            (0, 0)
        } else {
            let tick = cache.next_tick();
            let rank = (self.priority(layer, expert), tick);
            cache.order[pos].insert((rank.0, rank.1, expert));
            rank
        };
        if self.mlock.load(Ordering::Relaxed)
            && let Some(Err(e)) = data.buf.as_ref().map(AlignedBuf::lock)
            && self.mlock.swap(false, Ordering::Relaxed)
        {
            let limit = memlock_limit().map_or("unknown".to_string(), |l| {
                if l == libc::RLIM_INFINITY {
                    "unlimited".to_string()
                } else {
                    format!("{l} bytes")
                }
            });
            log::warn!(
                "mlock of expert buffers failed ({e}); RLIMIT_MEMLOCK is {limit}. Experts stay resident but may be swapped; to pin them raise the limit (ulimit -l unlimited, or LimitMEMLOCK=infinity in a systemd unit, or run with CAP_IPC_LOCK). Not trying again."
            );
        }
        cache.resident += 1;
        cache.resident_bytes += bytes;
        cache.resident_per_layer[pos] += 1;
        cache.slots.insert(
            key,
            Slot::Resident {
                data: Arc::clone(data),
                rank,
            },
        );
    }

    /// Drops the layer's lowest-ranked resident expert; false when it has none.
    fn evict_from(&self, cache: &mut Cache, pos: usize) -> bool {
        let Some((_, _, expert)) = cache.order[pos].pop_first() else {
            return false;
        };
        let layer = self.layer_ids[pos];
        if let Some(Slot::Resident { data, .. }) = cache.slots.remove(&(layer, expert)) {
            cache.resident -= 1;
            cache.resident_bytes -= data.bytes();
            cache.resident_per_layer[pos] -= 1;
        }
        true
    }

    fn busy_change(&self, start: bool) {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if start {
            if busy.in_flight == 0 {
                busy.since = Instant::now();
            }
            busy.in_flight += 1;
        } else {
            busy.in_flight -= 1;
            if busy.in_flight == 0 {
                let elapsed = busy.since.elapsed();
                busy.total += elapsed;
            }
        }
    }
}

/// Where an expert's tensors are and how to read them: one segment per piece, `readers[i]`
/// being the reader of piece `i`'s file.
fn locate(readers: &[usize], loc: &ExpertLocation) -> Located {
    let segments: Vec<(usize, Range<usize>)> = loc
        .pieces
        .iter()
        .zip(readers)
        .map(|(piece, &reader)| (reader, piece.range.clone()))
        .collect();
    Located {
        bytes: buffer_bytes(loc),
        tensors: std::array::from_fn(|i| {
            let piece = loc.tensor_piece[i];
            let t = &loc.tensors[i];
            (piece, t.start - loc.pieces[piece].range.start, t.len())
        }),
        segments,
    }
}

/// A pending request: the experts of one layer, handed back as they become available.
#[derive(Debug)]
pub struct Request {
    ready: VecDeque<Landed>,
    rx: Receiver<Landed>,
    pending: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Request {
    fn new(
        ready: VecDeque<Landed>,
        rx: Receiver<Landed>,
        pending: usize,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            ready,
            rx,
            pending,
            shared,
        }
    }

    /// Experts still to come (in flight).
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Everything available now — the hits first, then loads that have landed; when nothing
    /// is available but loads are in flight, waits for the next to land (the wait is counted
    /// in the store's statistics). Empty once every expert has been handed out.
    pub fn next_batch(&mut self) -> Vec<(usize, Result<Expert>)> {
        let mut batch: Vec<Landed> = self.ready.drain(..).collect();
        while self.pending > 0 {
            match self.rx.try_recv() {
                Ok(landed) => {
                    self.pending -= 1;
                    batch.push(landed);
                }
                Err(_) => break,
            }
        }
        if batch.is_empty() && self.pending > 0 {
            let start = Instant::now();
            let landed = self
                .rx
                .recv()
                .expect("every waiter is answered before its loader drops the sender");
            self.shared
                .wait_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.pending -= 1;
            batch.push(landed);
        }
        batch
    }
}
