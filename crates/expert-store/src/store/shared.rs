//! The state the store's I/O threads share with its callers ([`Shared`]), and the plain types
//! it holds: where each expert lies (`Located`), a read job, a landed expert, the read-busy
//! clock and the NUMA placement. The files above add their methods.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::buffer::{Expert, ExpertData, FreeBuffers};
use super::cache::Cache;
use super::config::{Capacity, Policy, Result};
use crate::io::ShardReader;
use crate::layout::ExpertLayout;
use crate::usage::UsageHistory;

/// The store's cache: resident experts as shared buffers, loads waited on by request channels.
pub(super) type ExpertCache = Cache<Arc<ExpertData>, (Sender<Landed>, usize)>;

/// What the I/O threads and the callers share: the expert table, the readers, the cache and
/// the counters.
pub(super) struct Shared {
    pub(super) layout: ExpertLayout,
    /// Checkpoint layer index -> position in `order`/`uses`.
    pub(super) layer_pos: BTreeMap<usize, usize>,
    pub(super) experts_per_layer: Vec<usize>,
    pub(super) table: HashMap<(usize, usize), Located>,
    pub(super) readers: Vec<ShardReader>,
    pub(super) capacity: Capacity,
    pub(super) full: bool,
    pub(super) policy: Policy,
    pub(super) history: UsageHistory,
    pub(super) mlock: AtomicBool,
    pub(super) buffered_said: AtomicBool,
    pub(super) cache: Mutex<ExpertCache>,
    pub(super) uses: Vec<Vec<AtomicU64>>,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) loads: AtomicU64,
    pub(super) bytes_read: AtomicU64,
    pub(super) wait_ns: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) busy: Mutex<Busy>,
    pub(super) placement: OnceLock<Placement>,
    pub(super) free: Arc<FreeBuffers>,
    /// Reads one request keeps outstanding at most ([`ExpertStore::window`]).
    pub(super) window: usize,
}

/// A table entry: where the expert is and how to read it.
#[derive(Debug)]
pub(super) struct Located {
    /// The file ranges read, in file order, as (reader, range): one per run of tensors stored
    /// back to back in one file (one in the release's layout).
    pub(super) segments: Vec<(usize, Range<usize>)>,
    /// Each tensor's position as (segment, offset from the segment's start, length), in the
    /// layout's tensor order.
    pub(super) tensors: Vec<(usize, usize, usize)>,
    /// Buffer bytes a resident copy takes (segments rounded out to 4 KiB).
    pub(super) bytes: u64,
}

impl Located {
    /// Where the first read goes: the key that sorts loads into file order.
    pub(super) fn file_order(&self) -> (usize, usize) {
        self.segments
            .first()
            .map_or((0, 0), |(reader, range)| (*reader, range.start))
    }

    /// The file of the first segment, naming the expert in errors.
    pub(super) fn first_reader(&self) -> usize {
        self.file_order().0
    }
}

/// A job for the I/O threads.
pub(super) struct Job {
    pub(super) key: (usize, usize),
}

/// One expert handed back by a request: its position in the request, and it or the error.
pub(super) type Landed = (usize, Result<Expert>);

/// The read-busy clock: reads in flight, since when, and the busy time before.
pub(super) struct Busy {
    pub(super) in_flight: usize,
    pub(super) since: Instant,
    pub(super) total: Duration,
}

/// Each expert's home domain, and the NUMA nodes (if any) its buffer is bound to.
#[derive(Debug)]
pub(super) struct Placement {
    /// Per layer position, per expert id.
    pub(super) homes: Vec<Vec<u16>>,
    /// Per domain: the node to bind buffers to (`None`: first touch).
    pub(super) nodes: Vec<Option<usize>>,
    /// Every expert's rows spread over the domains (else whole on its home).
    pub(super) split_rows: bool,
}

impl Shared {
    /// The cache, locked.
    pub(super) fn lock(&self) -> MutexGuard<'_, ExpertCache> {
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
