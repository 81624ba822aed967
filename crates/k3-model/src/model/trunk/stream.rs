//! The stream of the planned trunk: its steps' reads, the I/O thread that reads them a step
//! ahead into two buffers, and a pass's hold on the buffer of the step it computes.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};

use expert_store::io::{AlignedBuf, PieceError, ShardReader, read_pieces};
use mxfp4_kernels::{PackedBf16Matrix, WeightMatrix};

use super::resident::ResidentTrunk;
use crate::model::error::{ModelError, Result};
use crate::packcache::types::PackCache;
use crate::plan::Part;

/// The streamed part of the trunk and the I/O thread that reads it.
pub(in crate::model) struct TrunkStream {
    /// The tensors kept resident (`None`: none).
    pub(super) resident: Option<Arc<ResidentTrunk>>,
    /// The pack cache the packed steps are read from: their exception blocks and row indexes.
    pub(super) pack: Option<Arc<PackCache>>,
    /// Per step of the plan: how its tensors are read.
    pub(super) steps: Vec<StepReads>,
    /// Per layer (the layer count for the head) and part: its steps, with their rows for a
    /// part read in row blocks.
    pub(super) index: HashMap<(usize, Part), Vec<StepRows>>,
    /// Buffers given back, for the I/O thread to fill.
    pub(super) free: Sender<AlignedBuf>,
    /// Filled buffers, in the order read; locked for a whole forward pass.
    pub(super) filled: Mutex<Receiver<Filled>>,
    /// Bytes of the largest step's reads (a buffer lost to a failed read is replaced).
    pub(super) buffer_bytes: usize,
    /// Bytes the I/O thread has read so far.
    pub(super) read: Arc<AtomicU64>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
}

/// A step of a part: the rows it holds (for a part read in row blocks) and its index.
pub(in crate::model) type StepRows = (Option<Range<usize>>, usize);

/// A step's reads in file order: the shard and the byte range of each.
pub(super) type Reads = Vec<(Arc<ShardReader>, Range<usize>)>;

/// One step of the stream: its reads and where each streamed tensor (or row block) lands.
pub(super) struct StepReads {
    pub(super) reads: Arc<Reads>,
    /// `(address of the tensor in the mapping, its length, read index, offset in the read)`.
    pub(super) tensors: Vec<(usize, usize, usize, usize)>,
    /// The same for the BF16 matrices (or row blocks) read packed from the pack cache:
    /// `(address, length of its BF16 bytes, read index, offset of its body in the read, its
    /// first row, its index in the cache)`.
    pub(super) packed: Vec<(usize, usize, usize, usize, usize, usize)>,
}
pub(super) struct Filled {
    pub(super) step: usize,
    pub(super) result: std::result::Result<(AlignedBuf, Vec<usize>), PieceError>,
}

/// One forward pass's hold on the stream (passes take the stream's steps in turn).
pub(in crate::model) struct Pass<'m> {
    pub(super) filled: Option<MutexGuard<'m, Receiver<Filled>>>,
}

/// A stream buffer a pass holds, given back to the I/O thread on drop.
pub(in crate::model) struct Held<'m> {
    pub(super) step: usize,
    pub(super) buffer: Option<AlignedBuf>,
    pub(super) starts: Vec<usize>,
    pub(super) free: &'m Sender<AlignedBuf>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            // The thread is gone only when the model is being dropped.
            let _ = self.free.send(buffer);
        }
    }
}

impl Drop for TrunkStream {
    fn drop(&mut self) {
        // Closing the free channel ends the thread once its read in flight lands.
        let (closed, _) = channel();
        drop(std::mem::replace(&mut self.free, closed));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
impl TrunkStream {
    /// Where `bytes` (a loaded view's) are now: in `held` if its step streamed them, in the
    /// resident buffer if resident, else where they were.
    pub(super) fn relocate<'l>(&'l self, held: Option<&'l Held<'_>>, bytes: &'l [u8]) -> &'l [u8] {
        let at = bytes.as_ptr() as usize;
        if let Some(held) = held {
            // A step's packed matrices are reached only through `packed` (their BF16 bytes are
            // not in the buffer; the mapping's would be read through the page cache).
            debug_assert!(
                !self.steps[held.step]
                    .packed
                    .iter()
                    .any(|&(start, len, ..)| at >= start && at < start + len),
                "a packed step's matrix asked for as stored"
            );
            let buffer: &[u8] = held.buffer.as_deref().expect("held until dropped");
            for &(start, len, read, within) in &self.steps[held.step].tensors {
                if at >= start && at + bytes.len() <= start + len {
                    let from = held.starts[read] + within + (at - start);
                    return &buffer[from..from + bytes.len()];
                }
            }
        }
        match &self.resident {
            Some(resident) => resident.find(bytes).unwrap_or(bytes),
            None => bytes,
        }
    }

    /// The packed form of a BF16 view's `bytes` (whole rows), where `held` holds them read
    /// packed from the pack cache or the resident copy holds them packed (or requantised, a
    /// view of any float format's); an error where a
    /// packed step holds them but not as whole rows of one matrix.
    pub(super) fn packed<'l>(
        &'l self,
        held: Option<&'l Held<'_>>,
        bytes: &[u8],
    ) -> Result<Option<WeightMatrix<'l>>> {
        let at = bytes.as_ptr() as usize;
        if let (Some(held), Some(cache)) = (held, &self.pack) {
            let buffer: &[u8] = held.buffer.as_deref().expect("held until dropped");
            for &(start, len, read, within, first_row, k) in &self.steps[held.step].packed {
                if at < start || at + bytes.len() > start + len {
                    continue;
                }
                let t = cache.at(k);
                let row = 2 * t.cols;
                if bytes.is_empty()
                    || !(at - start).is_multiple_of(row)
                    || !bytes.len().is_multiple_of(row)
                {
                    return Err(ModelError::Plan(format!(
                        "{}: {} bytes at {} of a packed step are not whole rows",
                        t.name,
                        bytes.len(),
                        at - start
                    )));
                }
                let (skip, rows) = ((at - start) / row, bytes.len() / row);
                let packed_row = mxfp4_kernels::packed::packed_body_bytes(1, t.cols);
                let from = held.starts[read] + within + skip * packed_row;
                let first = first_row + skip;
                return PackedBf16Matrix::new(
                    &buffer[from..from + rows * packed_row],
                    &t.exceptions,
                    &t.row_exceptions[first..=first + rows],
                    rows,
                    t.cols,
                )
                .map(|m| Some(m.into()))
                .map_err(ModelError::from);
            }
        }
        Ok(self.resident.as_ref().and_then(|r| r.find_packed(bytes)))
    }
}

/// The I/O thread's loop: the plan's steps in order, round and round, one per free buffer,
/// until the model is dropped.
pub(super) fn stream(
    order: &[(usize, Arc<Reads>)],
    free: &Receiver<AlignedBuf>,
    filled: &Sender<Filled>,
    counter: &AtomicU64,
) {
    for (step, reads) in order.iter().cycle() {
        let Ok(buffer) = free.recv() else { return };
        let pieces: Vec<(&ShardReader, Range<usize>)> = reads
            .iter()
            .map(|(r, range)| (&**r, range.clone()))
            .collect();
        let result = read_pieces(&pieces, Some(buffer), |_, _| {});
        if result.is_ok() {
            let bytes: usize = reads
                .iter()
                .map(|(_, r)| expert_store::io::aligned_span(r).1)
                .sum();
            counter.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        let step = *step;
        if filled.send(Filled { step, result }).is_err() {
            return;
        }
    }
}
