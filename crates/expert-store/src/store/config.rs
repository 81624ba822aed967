//! How the store is set up (capacity, eviction policy, I/O threads) and its errors.

use std::path::PathBuf;

use crate::usage::UsageHistory;

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
    /// The expert whose last use is oldest goes first.
    #[default]
    Lru,
    /// The expert with the fewest uses (this run's plus an earlier run's) goes first, the
    /// oldest last use breaking ties.
    UsageWeighted,
}

/// How the store is set up; the binaries fill it from their flags.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// How much the cache may hold (default: every expert).
    pub capacity: Capacity,
    /// Which expert makes room (default: LRU).
    pub policy: Policy,
    /// Threads issuing reads (the queue depth the disk sees; default 16, a K3 layer's top-k, so
    /// every miss of a layer is in flight at once).
    pub io_threads: usize,
    /// The CPUs the I/O threads run on, from before their first read (so the buffers they
    /// first touch are local to them): an engine passes its pool's domain 0 CPUs. Empty (the
    /// default): the threads are not placed, for tools and tests without a pool.
    pub io_cpus: Vec<usize>,
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
            io_cpus: Vec::new(),
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
    /// A request named an expert the checkpoint does not have.
    #[error("layer {layer} has no routed expert {expert} in the checkpoint")]
    NoExpert {
        /// The checkpoint layer.
        layer: usize,
        /// The expert id.
        expert: usize,
    },
    /// An expert's read failed, or its bytes do not make the layout's matrices.
    #[error("{path}: layer {layer} expert {expert}: {reason}")]
    Read {
        /// The file (of the expert's first piece, for a bad view).
        path: PathBuf,
        /// The checkpoint layer.
        layer: usize,
        /// The expert id.
        expert: usize,
        /// What went wrong.
        reason: String,
    },
    /// The expert table could not be built, a shard could not be opened, or an I/O thread
    /// could not start.
    #[error("{path}: opening for expert reads: {reason}")]
    Open {
        /// The checkpoint directory or the shard.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The capacity asked for does not fit [`StoreConfig::memory_limit`].
    #[error(
        "an expert cache of {requested} bytes ({what}) does not fit the {available} bytes of memory available; ask for at most {fits}"
    )]
    TooLarge {
        /// Bytes the capacity would take.
        requested: u64,
        /// The limit.
        available: u64,
        /// The capacity as asked for.
        what: String,
        /// The largest per-layer capacity that fits, in words.
        fits: String,
    },
    /// [`StoreConfig::io_threads`] is 0.
    #[error("the expert store needs at least one I/O thread")]
    NoIoThreads,
    /// A consumer computes experts of another number of matrices than the store's layout has
    /// (the store as an [`ExpertSource`](crate::source::ExpertSource)).
    #[error(
        "the expert store's experts are {layout}, not the {expected} MXFP4 matrices its consumer computes"
    )]
    Matrices {
        /// The store's layout, in words.
        layout: String,
        /// The consumer's matrix count.
        expected: usize,
    },
}

/// The store's result.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
