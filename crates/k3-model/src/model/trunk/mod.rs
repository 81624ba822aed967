//! Where the forward pass gets each trunk weight: as loaded (views over the file mapping or
//! the resident copy), or, for what the memory plan streams ([`crate::plan::TrunkPlan`]:
//! per layer the attention, the dense MLP's gate, up and down or the MoE block, then the
//! lm_head; the dense matrices and the lm_head in row blocks), the same views relocated into
//! a buffer read from disk with `O_DIRECT` a step ahead of compute.
//!
//! The stream is two buffers (one where the budget is tight) cycling between one I/O thread
//! and the forward pass: the thread reads the plan's steps in forward order (each step's
//! tensors in file order, adjacent ones in one read, each read one `pread` that the kernel
//! splits into many requests in flight), round and round, into whichever buffer is free; the
//! pass takes the buffer of the step it needs and gives it back when that step is done. So
//! the next step's read overlaps this step's compute, and no weight byte passes through the
//! page cache. The bytes are the file's, and a row block's rows are computed as in the whole
//! matrix, so the logits are the same bits as the mapped run's.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};

use expert_store::io::{AlignedBuf, PieceError, ShardReader, read_pieces};
use expert_store::{Checkpoint, CheckpointError};
use mxfp4_kernels::PackedBf16Matrix;
use numa_sched::Pool;

use super::{Model, ModelError, Result};
use crate::packcache::PackCache;
use crate::plan::{Part, StoredTensor, TrunkPlan, merged_reads};

mod relocate;

/// The index in the stream's I/O thread's name.
const TRUNK_IO_THREAD: usize = 999;

/// The streamed part of the trunk and the I/O thread that reads it.
pub(super) struct TrunkStream {
    /// The tensors kept resident (`None`: none).
    resident: Option<Arc<ResidentTrunk>>,
    /// The pack cache the packed steps are read from: their exception blocks and row indexes.
    pack: Option<Arc<PackCache>>,
    /// Per step of the plan: how its tensors are read.
    steps: Vec<StepReads>,
    /// Per layer (the layer count for the head) and part: its steps, with their rows for a
    /// part read in row blocks.
    index: HashMap<(usize, Part), Vec<StepRows>>,
    /// Buffers given back, for the I/O thread to fill.
    free: Sender<AlignedBuf>,
    /// Filled buffers, in the order read; locked for a whole forward pass.
    filled: Mutex<Receiver<Filled>>,
    /// Bytes of the largest step's reads (a buffer lost to a failed read is replaced).
    buffer_bytes: usize,
    /// Bytes the I/O thread has read so far.
    read: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A step of a part: the rows it holds (for a part read in row blocks) and its index.
pub(super) type StepRows = (Option<Range<usize>>, usize);

/// A step's reads in file order: the shard and the byte range of each.
type Reads = Vec<(Arc<ShardReader>, Range<usize>)>;

/// One step of the stream: its reads and where each streamed tensor (or row block) lands.
struct StepReads {
    reads: Arc<Reads>,
    /// `(address of the tensor in the mapping, its length, read index, offset in the read)`.
    tensors: Vec<(usize, usize, usize, usize)>,
    /// The same for the BF16 matrices (or row blocks) read packed from the pack cache:
    /// `(address, length of its BF16 bytes, read index, offset of its body in the read, its
    /// first row, its index in the cache)`.
    packed: Vec<(usize, usize, usize, usize, usize, usize)>,
}

/// The trunk tensors the plan keeps resident, read once with `O_DIRECT` (no copy of them
/// stays in the page cache), shared by every model built over the engine: BF16 matrices the
/// plan packs (`StoredTensor::pack_cols`) in their packed form (`mxfp4_kernels::packed`,
/// lossless), the rest as stored in one buffer.
#[derive(Debug)]
pub struct ResidentTrunk {
    buffer: AlignedBuf,
    /// `(address of the tensor in the mapping, its length, its offset in the buffer)`, by
    /// address.
    tensors: Vec<(usize, usize, usize)>,
    /// The packed matrices' bodies, back to back.
    bodies: AlignedBuf,
    /// The packed matrices (or leading row blocks), by address.
    packed: Vec<PackedPiece>,
}

/// A resident BF16 matrix (or row block) in packed form.
#[derive(Debug)]
struct PackedPiece {
    /// Address and length of its BF16 bytes in the mapping.
    address: usize,
    len: usize,
    /// Where its body starts in `ResidentTrunk::bodies`.
    body_at: usize,
    cols: usize,
    exceptions: Vec<u8>,
    row_exceptions: Vec<u32>,
    /// Read packed from the pack cache (else packed at load).
    cached: bool,
}

/// The packed part of a [`ResidentTrunk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSummary {
    /// Matrices (or leading row blocks) held packed.
    pub pieces: usize,
    /// Of them, those read packed from the pack cache.
    pub cached: usize,
    /// Their blocks kept as BF16 (exponents too far apart for the codes).
    pub exceptions: usize,
    /// The BF16 bytes they stand for.
    pub bf16_bytes: usize,
    /// Bytes they take: bodies, exception blocks, row indexes.
    pub packed_bytes: usize,
}

/// BF16 rows read at a time for packing: the staging buffer's size.
const PACK_STAGING: usize = 32 << 20;

impl ResidentTrunk {
    /// Reads the tensors of `ckpt` whose stored names are `names`, and the row blocks `rows`
    /// (a [`TrunkPlan`]'s `resident` and `resident_rows`), in file order: those named in
    /// `packed` (stored name to columns) a few MB at a time, packed as they land; the others
    /// each from a 4 KiB boundary of one new buffer.
    ///
    /// Packing runs on `pool`'s workers, the reads on an I/O thread on `io_cpus`, a chunk
    /// ahead. The packed matrices `cache` holds are read packed from it instead (0.77x the
    /// bytes, nothing to pack), with its exception blocks and row index.
    pub fn load(
        ckpt: &Checkpoint,
        names: &HashSet<String>,
        rows: &[StoredTensor],
        packed: &HashMap<String, usize>,
        cache: Option<&PackCache>,
        pool: &Pool,
        io_cpus: &[usize],
    ) -> Result<Self> {
        // (file, offset in it, address in the mapping, length, columns if packed, stored
        // name, offset in the tensor) of each.
        let mut found = Vec::with_capacity(names.len() + rows.len());
        for name in names {
            let t = ckpt.require(name)?;
            let cols = packed.get(name).copied();
            found.push((
                t.path,
                t.offset,
                t.bytes.as_ptr() as usize,
                t.bytes.len(),
                cols,
                t.name,
                0,
            ));
        }
        for block in rows {
            // A row block is a range of its tensor's bytes.
            let t = ckpt.require(&block.name)?;
            let within = block
                .offset
                .checked_sub(t.offset)
                .filter(|&w| w + block.bytes as usize <= t.bytes.len());
            let Some(within) = within else {
                return Err(ModelError::Plan(format!(
                    "the resident rows of {} (bytes {}..{}) lie outside it (bytes {}..{})",
                    block.name,
                    block.offset,
                    block.offset + block.bytes as usize,
                    t.offset,
                    t.offset + t.bytes.len()
                )));
            };
            found.push((
                t.path,
                block.offset,
                t.bytes.as_ptr() as usize + within,
                block.bytes as usize,
                packed.get(&block.name).copied(),
                t.name,
                within,
            ));
        }
        found.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let (to_pack, plain): (Vec<_>, Vec<_>) = found.into_iter().partition(|f| f.4.is_some());
        let mut readers = Vec::new();
        let mut pieces = Vec::with_capacity(plain.len());
        for &(path, offset, _, len, ..) in &plain {
            pieces.push((reader(&mut readers, path)?, offset..offset + len));
        }
        let borrowed: Vec<(&ShardReader, Range<usize>)> = pieces
            .iter()
            .map(|(r, range)| (&**r, range.clone()))
            .collect();
        let (buffer, starts) =
            read_pieces(&borrowed, None, |_, _| {}).map_err(|e| checkpoint_io(e.path, e.source))?;
        let mut tensors: Vec<(usize, usize, usize)> = plain
            .iter()
            .zip(&starts)
            .map(|(&(_, _, address, len, ..), &at)| (address, len, at))
            .collect();
        tensors.sort_unstable();
        // The packed ones: whole rows a staging buffer at a time, packed into their body.
        let body_bytes = |len: usize, cols: usize| {
            mxfp4_kernels::packed::packed_body_bytes(len / (2 * cols), cols)
        };
        let mut packed = Vec::with_capacity(to_pack.len());
        // Per piece: its shard, offset and row bytes; then every piece's chunks of whole rows.
        let mut sources = Vec::with_capacity(to_pack.len());
        let mut chunks = Vec::new();
        let mut at = 0;
        for &(path, offset, address, len, cols, name, within) in &to_pack {
            let cols = cols.expect("partitioned on it");
            let row = 2 * cols;
            if !len.is_multiple_of(row) || !within.is_multiple_of(row) {
                return Err(ModelError::Plan(format!(
                    "packed resident bytes {offset}..{} of {} are not whole rows of {cols} BF16 values",
                    offset + len,
                    path.display()
                )));
            }
            let (rows, first_row) = (len / row, within / row);
            let packed_row = body_bytes(row, cols);
            let held = cache.and_then(|c| {
                let t = c.at(c.position(name)?);
                (t.cols == cols && first_row + rows <= t.rows).then_some((c, t))
            });
            let (unit, exceptions, row_exceptions) = match held {
                Some((c, t)) => {
                    sources.push((
                        reader(&mut readers, c.path())?,
                        t.body + first_row * packed_row,
                        packed_row,
                    ));
                    // Those rows' exception blocks and index, counted from their first.
                    let index = &t.row_exceptions[first_row..=first_row + rows];
                    let bytes = mxfp4_kernels::packed::EXCEPTION_BYTES;
                    (
                        packed_row,
                        t.exceptions[index[0] as usize * bytes..index[rows] as usize * bytes]
                            .to_vec(),
                        index.iter().map(|&i| i - index[0]).collect(),
                    )
                }
                None => {
                    sources.push((reader(&mut readers, path)?, offset, row));
                    (row, Vec::new(), Vec::with_capacity(rows + 1))
                }
            };
            let step = (PACK_STAGING / unit).max(1);
            for first in (0..rows).step_by(step) {
                chunks.push((packed.len(), first, (first + step).min(rows)));
            }
            packed.push(PackedPiece {
                address,
                len,
                body_at: at,
                cols,
                exceptions,
                row_exceptions,
                cached: held.is_some(),
            });
            at += body_bytes(len, cols);
        }
        let mut bodies = AlignedBuf::zeroed(at);
        read_chunks(sources, &chunks, io_cpus, |piece, first, last, bytes| {
            let p = &mut packed[piece];
            let packed_row = body_bytes(2 * p.cols, p.cols);
            let body = &mut bodies[p.body_at + first * packed_row..p.body_at + last * packed_row];
            if p.cached {
                body.copy_from_slice(bytes);
                return Ok(());
            }
            pack_on(
                pool,
                bytes,
                p.cols,
                body,
                &mut p.exceptions,
                &mut p.row_exceptions,
            )
        })?;
        for p in packed.iter_mut().filter(|p| !p.cached) {
            let count = p.exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES;
            p.row_exceptions
                .push(u32::try_from(count).expect("under 2^32 exception blocks"));
            p.exceptions.shrink_to_fit();
        }
        packed.sort_unstable_by_key(|p| p.address);
        Ok(Self {
            buffer,
            tensors,
            bodies,
            packed,
        })
    }

    /// Bytes held: the buffer, the packed bodies, their exception blocks and row indexes.
    pub fn bytes(&self) -> usize {
        self.buffer.len() + self.packed_summary().packed_bytes
    }

    /// What is held packed.
    pub fn packed_summary(&self) -> PackedSummary {
        PackedSummary {
            pieces: self.packed.len(),
            cached: self.packed.iter().filter(|p| p.cached).count(),
            exceptions: self
                .packed
                .iter()
                .map(|p| p.exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES)
                .sum(),
            bf16_bytes: self.packed.iter().map(|p| p.len).sum(),
            packed_bytes: self.bodies.len()
                + self
                    .packed
                    .iter()
                    .map(|p| p.exceptions.len() + 4 * p.row_exceptions.len())
                    .sum::<usize>(),
        }
    }

    /// Where `bytes` (a loaded view's) are in the buffer, if they are resident as stored.
    fn find(&self, bytes: &[u8]) -> Option<&[u8]> {
        let at = bytes.as_ptr() as usize;
        let i = self.tensors.partition_point(|&(start, _, _)| start <= at);
        let &(start, len, offset) = self.tensors.get(i.checked_sub(1)?)?;
        (at + bytes.len() <= start + len).then(|| {
            let from = offset + (at - start);
            &self.buffer[from..from + bytes.len()]
        })
    }

    /// The packed form of `bytes` (a loaded BF16 view's whole rows), if they are resident
    /// packed.
    fn find_packed(&self, bytes: &[u8]) -> Option<PackedBf16Matrix<'_>> {
        let at = bytes.as_ptr() as usize;
        let i = self.packed.partition_point(|p| p.address <= at);
        let p = self.packed.get(i.checked_sub(1)?)?;
        let (row, within) = (2 * p.cols, at - p.address);
        if bytes.is_empty()
            || at + bytes.len() > p.address + p.len
            || !within.is_multiple_of(row)
            || !bytes.len().is_multiple_of(row)
        {
            return None;
        }
        // Only those rows: the view checks the index of the rows it covers.
        let rows = within / row..(within + bytes.len()) / row;
        let packed_row = mxfp4_kernels::packed::packed_body_bytes(1, p.cols);
        let at = p.body_at + rows.start * packed_row;
        PackedBf16Matrix::new(
            &self.bodies[at..at + rows.len() * packed_row],
            &p.exceptions,
            &p.row_exceptions[rows.start..=rows.end],
            rows.len(),
            p.cols,
        )
        .ok()
    }
}

/// Reads `chunks` (a piece, its first and end row) of `sources` (per piece: its shard, the
/// offset of its row 0 and its bytes per row) in order, on an I/O thread on `io_cpus` a chunk
/// ahead, and hands each chunk's bytes to `each` (two or three staging buffers of a chunk).
pub(crate) fn read_chunks(
    sources: Vec<(Arc<ShardReader>, usize, usize)>,
    chunks: &[(usize, usize, usize)],
    io_cpus: &[usize],
    mut each: impl FnMut(usize, usize, usize, &[u8]) -> Result<()>,
) -> Result<()> {
    if chunks.is_empty() {
        return Ok(());
    }
    let rows: Vec<usize> = sources.iter().map(|s| s.2).collect();
    let (full_tx, full) = std::sync::mpsc::sync_channel(0);
    let (free, free_rx) = channel::<AlignedBuf>();
    let order = chunks.to_vec();
    let io = numa_sched::spawn_io_thread(TRUNK_IO_THREAD, io_cpus, move || {
        for (piece, first, last) in order {
            let (shard, offset, row): &(Arc<ShardReader>, usize, usize) = &sources[piece];
            let range = offset + first * row..offset + last * row;
            let read = read_pieces(&[(&**shard, range)], free_rx.try_recv().ok(), |_, _| {})
                .map_err(|e| (e.path, e.source));
            let failed = read.is_err();
            if full_tx.send(read).is_err() || failed {
                return;
            }
        }
    })
    .map_err(|e| ModelError::Pool(format!("the packing reader: {e}")))?;
    let mut result = Ok(());
    for &(piece, first, last) in chunks {
        let (buf, starts) = match full.recv() {
            Ok(Ok(read)) => read,
            Ok(Err((path, e))) => {
                result = Err(checkpoint_io(path, e));
                break;
            }
            Err(_) => {
                result = Err(ModelError::Pool("the packing reader stopped".into()));
                break;
            }
        };
        let len = (last - first) * rows[piece];
        result = each(piece, first, last, &buf[starts[0]..starts[0] + len]);
        let _ = free.send(buf);
        if result.is_err() {
            break;
        }
    }
    drop(full);
    let _ = io.join();
    result
}

/// Packs whole rows of `cols` BF16 values (`src`) into `dst`, the rows split over `pool`'s
/// workers; appends their exception blocks and row starts as one [`pack_rows_into`] would.
///
/// [`pack_rows_into`]: mxfp4_kernels::pack_rows_into
pub(crate) fn pack_on(
    pool: &Pool,
    src: &[u8],
    cols: usize,
    dst: &mut [u8],
    exceptions: &mut Vec<u8>,
    row_exceptions: &mut Vec<u32>,
) -> Result<()> {
    let rows = src.len() / (2 * cols);
    let packed_row = dst.len() / rows.max(1);
    let per = rows.div_ceil(pool.threads().max(1)).max(1);
    let parts: Vec<Mutex<(&[u8], &mut [u8])>> = src
        .chunks(per * 2 * cols)
        .zip(dst.chunks_mut(per * packed_row))
        .map(Mutex::new)
        .collect();
    let packed = pool
        .map(parts.len(), |i| {
            let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            let (src, dst) = &mut *part;
            let (mut exceptions, mut starts) = (Vec::new(), Vec::with_capacity(per));
            mxfp4_kernels::pack_rows_into(src, cols, dst, &mut exceptions, &mut starts);
            (exceptions, starts)
        })
        .map_err(|e| ModelError::Pool(e.to_string()))?;
    for (more, starts) in packed {
        let before = u32::try_from(exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES)
            .expect("under 2^32 exception blocks");
        row_exceptions.extend(starts.iter().map(|s| s + before));
        exceptions.extend_from_slice(&more);
    }
    Ok(())
}

/// The reader of `path` among `readers`, opened (with `O_DIRECT`) if it is not there yet.
pub(crate) fn reader(
    readers: &mut Vec<Arc<ShardReader>>,
    path: &std::path::Path,
) -> Result<Arc<ShardReader>> {
    if let Some(reader) = readers.iter().find(|r| r.path == path) {
        return Ok(Arc::clone(reader));
    }
    let reader =
        Arc::new(ShardReader::open(path, true).map_err(|e| checkpoint_io(path.to_owned(), e))?);
    readers.push(Arc::clone(&reader));
    Ok(reader)
}

fn checkpoint_io(path: std::path::PathBuf, source: std::io::Error) -> ModelError {
    ModelError::Checkpoint(CheckpointError::Io { path, source })
}

struct Filled {
    step: usize,
    result: std::result::Result<(AlignedBuf, Vec<usize>), PieceError>,
}

/// One forward pass's hold on the stream (passes take the stream's steps in turn).
pub(super) struct Pass<'m> {
    filled: Option<MutexGuard<'m, Receiver<Filled>>>,
}

/// A stream buffer a pass holds, given back to the I/O thread on drop.
pub(super) struct Held<'m> {
    step: usize,
    buffer: Option<AlignedBuf>,
    starts: Vec<usize>,
    free: &'m Sender<AlignedBuf>,
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

impl<'a> Model<'a> {
    /// Takes the trunk as `plan` places it: the tensors it keeps resident from `resident`
    /// ([`ResidentTrunk::load`] of `plan.resident`), the ones it streams read from `ckpt`
    /// (the checkpoint this model was loaded from), or their packed bodies from `pack` where
    /// the plan reads them there ([`StoredTensor::packed_at`]), with `O_DIRECT` on an I/O
    /// thread on `io_cpus`, through `plan.slots` buffers, a step ahead of compute. Logits are
    /// the same bits.
    pub fn with_planned_trunk(
        mut self,
        ckpt: &'a Checkpoint,
        plan: &TrunkPlan,
        resident: Option<Arc<ResidentTrunk>>,
        pack: Option<Arc<PackCache>>,
        io_cpus: &[usize],
    ) -> Result<Self> {
        if !plan.streams() && resident.is_none() {
            return Ok(self);
        }
        let mut readers: Vec<Arc<ShardReader>> = Vec::new();
        let mut steps = Vec::with_capacity(plan.steps.len());
        let mut index: HashMap<(usize, Part), Vec<StepRows>> = HashMap::new();
        for (i, step) in plan.steps.iter().enumerate() {
            let mut reads: Reads = Vec::new();
            for (path, range) in merged_reads(&step.tensors) {
                reads.push((reader(&mut readers, &path)?, range));
            }
            let mut tensors = Vec::with_capacity(step.tensors.len());
            let mut packed = Vec::new();
            for stored in &step.tensors {
                // A row block is a range of its tensor's bytes.
                let t = ckpt.require(&stored.name)?;
                let (path, range) = stored.read_range();
                let read = reads
                    .iter()
                    .position(|(r, span)| {
                        r.path == path && span.start <= range.start && range.end <= span.end
                    })
                    .expect("every streamed tensor lies in one of its step's reads");
                let within = range.start - reads[read].1.start;
                let at = t.bytes.as_ptr() as usize + (stored.offset - t.offset);
                let len = stored.bytes as usize;
                match (&stored.packed_at, stored.pack_cols) {
                    (Some(packed_at), Some(cols)) => {
                        let cache = pack.as_ref().ok_or_else(|| {
                            ModelError::Plan(format!(
                                "{} is planned packed from {}, but no pack cache was given",
                                stored.name,
                                packed_at.path.display()
                            ))
                        })?;
                        let k = cache
                            .position(&stored.name)
                            .filter(|&k| {
                                let held = cache.at(k);
                                held.cols == cols && held.body == packed_at.body
                            })
                            .ok_or_else(|| {
                                ModelError::Plan(format!(
                                    "the pack cache {} does not hold {} as planned",
                                    cache.path().display(),
                                    stored.name
                                ))
                            })?;
                        packed.push((at, len, read, within, packed_at.first_row, k));
                    }
                    _ => tensors.push((at, len, read, within)),
                }
            }
            steps.push(StepReads {
                reads: Arc::new(reads),
                tensors,
                packed,
            });
            index
                .entry((step.layer, step.part))
                .or_default()
                .push((step.rows.clone(), i));
        }
        let order: Vec<(usize, Arc<Reads>)> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| (i, Arc::clone(&s.reads)))
            .collect();
        let buffer_bytes = order
            .iter()
            .map(|(_, reads)| {
                reads
                    .iter()
                    .map(|(_, r)| expert_store::io::aligned_span(r).1)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        let read = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&read);
        let (free, free_rx) = channel::<AlignedBuf>();
        let (filled_tx, filled) = channel::<Filled>();
        for _ in 0..plan.slots.max(1) {
            let _ = free.send(AlignedBuf::zeroed(buffer_bytes));
        }
        // Named `k3-io-{TRUNK_IO_THREAD}`, apart from the expert store's `k3-io-0..`.
        let thread = if order.is_empty() {
            None
        } else {
            Some(
                numa_sched::spawn_io_thread(TRUNK_IO_THREAD, io_cpus, move || {
                    stream(&order, &free_rx, &filled_tx, &counter)
                })
                .map_err(|e| checkpoint_io(ckpt.dir().to_owned(), e))?,
            )
        };
        self.trunk = Some(TrunkStream {
            resident,
            pack,
            steps,
            index,
            free,
            filled: Mutex::new(filled),
            buffer_bytes,
            read,
            thread,
        });
        Ok(self)
    }

    /// Bytes of trunk read from disk so far by the stream (0 without one); the stream reads
    /// up to `slots` steps ahead, so a pass's reads may land before or after it.
    pub fn streamed_trunk_bytes(&self) -> u64 {
        self.trunk
            .as_ref()
            .map_or(0, |t| t.read.load(Ordering::Relaxed))
    }

    /// A forward pass's hold on the stream: passes that run at once take turns.
    pub(super) fn trunk_pass(&self) -> Pass<'_> {
        Pass {
            filled: self
                .trunk
                .as_ref()
                .map(|t| t.filled.lock().unwrap_or_else(|e| e.into_inner())),
        }
    }

    /// The buffer of the plan's step `step`: waits for the I/O thread's read of it (reads
    /// of other steps, left by a pass that failed half-way or skipped the lm_head, are handed
    /// back unused).
    pub(super) fn trunk_step<'m>(&'m self, pass: &mut Pass<'m>, step: usize) -> Result<Held<'m>> {
        let (Some(trunk), Some(filled)) = (&self.trunk, pass.filled.as_mut()) else {
            unreachable!("a step is asked for only of a stream");
        };
        loop {
            let Filled { step: got, result } = self.waiting(|| filled.recv()).map_err(|_| {
                ModelError::Pool("the trunk stream's I/O thread has stopped".into())
            })?;
            let (buffer, starts) = match result {
                Ok(done) => done,
                Err(e) => {
                    // The buffer went with the failed read: a new one keeps the cycle whole.
                    let _ = trunk.free.send(AlignedBuf::zeroed(trunk.buffer_bytes));
                    if got == step {
                        return Err(ModelError::Checkpoint(CheckpointError::Io {
                            path: e.path,
                            source: e.source,
                        }));
                    }
                    continue;
                }
            };
            let held = Held {
                step: got,
                buffer: Some(buffer),
                starts,
                free: &trunk.free,
            };
            if got == step {
                return Ok(held);
            }
        }
    }

    /// The streamed steps of `part` of layer `layer` (the layer count for the head), with
    /// their rows for a part read in row blocks; empty where nothing of it is streamed.
    pub(super) fn trunk_steps(&self, layer: usize, part: Part) -> &[StepRows] {
        self.trunk
            .as_ref()
            .and_then(|t| t.index.get(&(layer, part)))
            .map_or(&[], Vec::as_slice)
    }

    /// The one step of an unsplittable `part` of layer `layer`, if it is streamed.
    pub(super) fn trunk_unit<'m>(
        &'m self,
        pass: &mut Pass<'m>,
        layer: usize,
        part: Part,
    ) -> Result<Option<Held<'m>>> {
        match self.trunk_steps(layer, part) {
            [] => Ok(None),
            [(_, step)] => self.trunk_step(pass, *step).map(Some),
            more => unreachable!("{} steps for an unsplittable part", more.len()),
        }
    }
}

impl TrunkStream {
    /// Where `bytes` (a loaded view's) are now: in `held` if its step streamed them, in the
    /// resident buffer if resident, else where they were.
    fn relocate<'l>(&'l self, held: Option<&'l Held<'_>>, bytes: &'l [u8]) -> &'l [u8] {
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
    /// packed from the pack cache or the resident copy holds them packed; an error where a
    /// packed step holds them but not as whole rows of one matrix.
    fn packed<'l>(
        &'l self,
        held: Option<&'l Held<'_>>,
        bytes: &[u8],
    ) -> Result<Option<PackedBf16Matrix<'l>>> {
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
                .map(Some)
                .map_err(ModelError::from);
            }
        }
        Ok(self.resident.as_ref().and_then(|r| r.find_packed(bytes)))
    }
}

/// The I/O thread's loop: the plan's steps in order, round and round, one per free buffer,
/// until the model is dropped.
fn stream(
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

#[cfg(test)]
mod tests;
