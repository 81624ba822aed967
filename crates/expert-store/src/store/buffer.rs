//! Expert buffers: the bytes of a landed expert with its validated views, the guard that
//! keeps them alive, and the free list that recycles dropped buffers for the next reads.

use std::sync::{Arc, Mutex};

use mxfp4_kernels::MxFp4Matrix;

use crate::checkpoint::experts::ExpertLocation;
use crate::io::AlignedBuf;

/// An expert's bytes in memory, validated once when it landed.
#[derive(Debug)]
pub(super) struct ExpertData {
    /// The layout's matrices over `buf`, in its order.
    pub(super) views: Vec<MxFp4Matrix<'static>>,
    /// Owns the bytes `views` borrow; never moved or mutated while they live, and handed
    /// back to `free` only when this drops (no view can outlive it: see `Expert`).
    pub(super) buf: Option<AlignedBuf>,
    /// Buffer bytes the cache counts for this expert.
    pub(super) size: u64,
    pub(super) free: Arc<FreeBuffers>,
}

impl ExpertData {
    pub(super) fn bytes(&self) -> u64 {
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
pub(super) const FREE_BUFFERS_PER_THREAD: usize = 2;

/// Expert-sized buffers the store may hold beyond its capacity: the free list and one read in
/// flight per I/O thread (the memory budget counts them).
pub fn io_buffers(io_threads: usize) -> usize {
    (FREE_BUFFERS_PER_THREAD + 1) * io_threads
}

/// Expert-sized buffers a request's caller may hold beyond [`io_buffers`] and the cache: the
/// batch of landed experts it runs while the next reads are out. A request keeps at most one
/// read per I/O thread outstanding (`ExpertStore::window`), so a batch holds at most that
/// many; the outstanding reads themselves are [`io_buffers`]' reads in flight.
pub fn request_buffers(io_threads: usize) -> usize {
    io_threads
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
pub(super) struct FreeBuffers {
    pub(super) list: Mutex<Vec<AlignedBuf>>,
    pub(super) max: usize,
}

impl FreeBuffers {
    pub(super) fn give(&self, buf: AlignedBuf) {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        if list.len() < self.max {
            list.push(buf);
        }
    }

    pub(super) fn take(&self) -> Option<AlignedBuf> {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }
}

/// A resident expert, held for as long as this guard lives (eviction cannot free it).
#[derive(Debug, Clone)]
pub struct Expert(pub(super) Arc<ExpertData>);

impl Expert {
    /// The expert's matrices, in the order of the layout the store was opened with.
    pub fn matrices(&self) -> &[MxFp4Matrix<'_>] {
        // 'static shortens to the guard's borrow: the buffer outlives it.
        &self.0.views
    }
}
