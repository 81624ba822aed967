//! Where the layer loop gets each layer's weights (and the lm_head its): as loaded (views
//! over the file mapping or the resident copy), or, for a unit whose tensors the memory plan
//! streams ([`crate::plan::TrunkPlan`]: each layer, then the head), the same views relocated
//! into a buffer read from disk with `O_DIRECT` a unit ahead of compute.
//!
//! The stream is two buffers (one where the budget is tight) cycling between one I/O thread
//! and the forward pass: the thread
//! reads the streamed layers in layer order (each layer's tensors in file order, adjacent ones
//! in one read), round and round, into whichever buffer is free; the pass takes the buffer of
//! the layer it needs and gives it back when the layer is done. So the next layer's read
//! overlaps this layer's compute, the last layer's read overlaps the next token's first
//! layers, and no weight byte passes through the page cache. The bytes are the file's, so
//! the logits are the same bits as the mapped run's.

use std::collections::HashSet;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};

use expert_store::io::{AlignedBuf, PieceError, ShardReader, read_pieces};
use expert_store::{Checkpoint, CheckpointError};
use mxfp4_kernels::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, WeightMatrix};

use super::weights::{Attention, Ffn, Kda, Layer, Mla, Mlp, Moe};
use super::{Model, ModelError, Result};
use crate::plan::{TrunkPlan, merged_reads};

/// The index in the stream's I/O thread's name.
const TRUNK_IO_THREAD: usize = 999;

/// The streamed part of the trunk and the I/O thread that reads it.
pub(super) struct TrunkStream {
    /// The tensors kept resident (`None`: none).
    resident: Option<Arc<ResidentTrunk>>,
    /// Per model layer, then the head: how its streamed tensors are read (`None`: nothing
    /// streamed).
    layers: Vec<Option<LayerReads>>,
    /// Buffers given back, for the I/O thread to fill.
    free: Sender<AlignedBuf>,
    /// Filled buffers, in the order read; locked for a whole forward pass.
    filled: Mutex<Receiver<Filled>>,
    /// Bytes of the largest layer's reads (a buffer lost to a failed read is replaced).
    buffer_bytes: usize,
    /// Bytes the I/O thread has read so far.
    read: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A unit's reads in file order: the shard and the byte range of each.
type Reads = Vec<(Arc<ShardReader>, Range<usize>)>;

/// One streamed layer: its reads and where each streamed tensor lands.
struct LayerReads {
    reads: Arc<Reads>,
    /// `(address of the tensor in the mapping, its length, read index, offset in the read)`.
    tensors: Vec<(usize, usize, usize, usize)>,
}

/// The trunk tensors the plan keeps resident, read once with `O_DIRECT` into one buffer (no
/// copy of them stays in the page cache), shared by every model built over the engine.
#[derive(Debug)]
pub struct ResidentTrunk {
    buffer: AlignedBuf,
    /// `(address of the tensor in the mapping, its length, its offset in the buffer)`, by
    /// address.
    tensors: Vec<(usize, usize, usize)>,
}

impl ResidentTrunk {
    /// Reads the tensors of `ckpt` whose stored names are `names`, in file order, each from
    /// a 4 KiB boundary of one new buffer.
    pub fn load(ckpt: &Checkpoint, names: &HashSet<String>) -> Result<Self> {
        let mut found = Vec::with_capacity(names.len());
        for name in names {
            found.push(ckpt.require(name)?);
        }
        found.sort_by(|a, b| (a.path, a.offset).cmp(&(b.path, b.offset)));
        let mut readers = Vec::new();
        let mut pieces = Vec::with_capacity(found.len());
        for t in &found {
            pieces.push((
                reader(&mut readers, t.path)?,
                t.offset..t.offset + t.bytes.len(),
            ));
        }
        let borrowed: Vec<(&ShardReader, Range<usize>)> = pieces
            .iter()
            .map(|(r, range)| (&**r, range.clone()))
            .collect();
        let (buffer, starts) =
            read_pieces(&borrowed, None, |_, _| {}).map_err(|e| checkpoint_io(e.path, e.source))?;
        let mut tensors: Vec<(usize, usize, usize)> = found
            .iter()
            .zip(&starts)
            .map(|(t, &at)| (t.bytes.as_ptr() as usize, t.bytes.len(), at))
            .collect();
        tensors.sort_unstable();
        Ok(Self { buffer, tensors })
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Where `bytes` (a loaded view's) are in the buffer, if they are resident.
    fn find(&self, bytes: &[u8]) -> Option<&[u8]> {
        let at = bytes.as_ptr() as usize;
        let i = self.tensors.partition_point(|&(start, _, _)| start <= at);
        let &(start, len, offset) = self.tensors.get(i.checked_sub(1)?)?;
        (at + bytes.len() <= start + len).then(|| {
            let from = offset + (at - start);
            &self.buffer[from..from + bytes.len()]
        })
    }
}

/// The reader of `path` among `readers`, opened (with `O_DIRECT`) if it is not there yet.
fn reader(readers: &mut Vec<Arc<ShardReader>>, path: &std::path::Path) -> Result<Arc<ShardReader>> {
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
    layer: usize,
    result: std::result::Result<(AlignedBuf, Vec<usize>), PieceError>,
}

/// The weights of one layer for the pass that asked: borrowed as loaded, or relocated into a
/// stream buffer (given back to the I/O thread on drop).
// Held on the stack for one layer of one step: boxing would allocate every step.
#[allow(clippy::large_enum_variant)]
pub(super) enum LayerRef<'l, 'a> {
    Loaded(&'l Layer<'a>),
    Streamed(Layer<'l>),
}

impl<'l> Deref for LayerRef<'l, '_> {
    type Target = Layer<'l>;

    fn deref(&self) -> &Layer<'l> {
        match self {
            LayerRef::Loaded(layer) => layer,
            LayerRef::Streamed(layer) => layer,
        }
    }
}

/// One forward pass's hold on the stream (passes take the stream's layers in turn).
pub(super) struct Pass<'m> {
    filled: Option<MutexGuard<'m, Receiver<Filled>>>,
}

/// A stream buffer a pass holds, given back to the I/O thread on drop.
pub(super) struct Held<'m> {
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
    /// (the checkpoint this model was loaded from) with `O_DIRECT` on an I/O thread on
    /// `io_cpus`, through `plan.slots` buffers, a unit ahead of compute. Logits are the same
    /// bits.
    pub fn with_planned_trunk(
        mut self,
        ckpt: &'a Checkpoint,
        plan: &TrunkPlan,
        resident: Option<Arc<ResidentTrunk>>,
        io_cpus: &[usize],
    ) -> Result<Self> {
        if !plan.streams() && resident.is_none() {
            return Ok(self);
        }
        let mut readers: Vec<Arc<ShardReader>> = Vec::new();
        let mut layers = Vec::with_capacity(plan.streamed.len());
        for streamed in &plan.streamed {
            if streamed.is_empty() {
                layers.push(None);
                continue;
            }
            let mut reads: Reads = Vec::new();
            for (path, range) in merged_reads(streamed) {
                reads.push((reader(&mut readers, &path)?, range));
            }
            let mut tensors = Vec::with_capacity(streamed.len());
            for stored in streamed {
                let t = ckpt.require(&stored.name)?;
                let range = t.offset..t.offset + t.bytes.len();
                let read = reads
                    .iter()
                    .position(|(r, span)| {
                        r.path == t.path && span.start <= range.start && range.end <= span.end
                    })
                    .expect("every streamed tensor lies in one of its layer's reads");
                let within = range.start - reads[read].1.start;
                tensors.push((t.bytes.as_ptr() as usize, t.bytes.len(), read, within));
            }
            layers.push(Some(LayerReads {
                reads: Arc::new(reads),
                tensors,
            }));
        }
        let order: Vec<(usize, Arc<Reads>)> = layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.as_ref().map(|l| (i, Arc::clone(&l.reads))))
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
            layers,
            free,
            filled: Mutex::new(filled),
            buffer_bytes,
            read,
            thread,
        });
        Ok(self)
    }

    /// Bytes of trunk read from disk so far by the stream (0 without one); the stream reads
    /// up to two layers ahead, so a pass's reads may land before or after it.
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

    /// Layer `i`'s buffer, if it is streamed: waits for the I/O thread's read of it (reads of
    /// other layers, left by a pass that failed half-way, are handed back unused).
    pub(super) fn trunk_buffer<'m>(
        &'m self,
        pass: &mut Pass<'m>,
        i: usize,
    ) -> Result<Option<Held<'m>>> {
        let (Some(trunk), Some(filled)) = (&self.trunk, pass.filled.as_mut()) else {
            return Ok(None);
        };
        if trunk.layers[i].is_none() {
            return Ok(None);
        }
        loop {
            let Filled { layer, result } = filled.recv().map_err(|_| {
                ModelError::Pool("the trunk stream's I/O thread has stopped".into())
            })?;
            let (buffer, starts) = match result {
                Ok(done) => done,
                Err(e) => {
                    // The buffer went with the failed read: a new one keeps two in the cycle.
                    let _ = trunk.free.send(AlignedBuf::zeroed(trunk.buffer_bytes));
                    if layer == i {
                        return Err(ModelError::Checkpoint(CheckpointError::Io {
                            path: e.path,
                            source: e.source,
                        }));
                    }
                    continue;
                }
            };
            let held = Held {
                buffer: Some(buffer),
                starts,
                free: &trunk.free,
            };
            if layer == i {
                return Ok(Some(held));
            }
        }
    }

    /// Layer `i`'s weights: as loaded, or relocated into the resident buffer and `held` (its
    /// stream buffer).
    pub(super) fn layer_weights<'l>(
        &'l self,
        i: usize,
        held: Option<&'l Held<'_>>,
    ) -> Result<LayerRef<'l, 'a>> {
        let layer = &self.layers[i];
        Ok(match &self.trunk {
            None => LayerRef::Loaded(layer),
            Some(trunk) => {
                LayerRef::Streamed(relocated(layer, &|bytes| trunk.relocate(i, held, bytes))?)
            }
        })
    }

    /// The lm_head: as loaded, or relocated as [`Model::layer_weights`] does.
    pub(super) fn head_weights<'l>(
        &'l self,
        held: Option<&'l Held<'_>>,
    ) -> Result<WeightMatrix<'l>> {
        let unit = self.layers.len();
        match &self.trunk {
            None => Ok(self.lm_head),
            Some(trunk) => {
                relocated_matrix(&self.lm_head, &|bytes| trunk.relocate(unit, held, bytes))
            }
        }
    }
}

impl TrunkStream {
    /// Where `bytes` (a loaded view's, of stream unit `unit`) are now: in `held` if streamed,
    /// in the resident buffer if resident, else where they were.
    fn relocate<'l>(
        &'l self,
        unit: usize,
        held: Option<&'l Held<'_>>,
        bytes: &'l [u8],
    ) -> &'l [u8] {
        let at = bytes.as_ptr() as usize;
        if let (Some(held), Some(reads)) = (held, &self.layers[unit]) {
            let buffer: &[u8] = held.buffer.as_deref().expect("held until dropped");
            for &(start, len, read, within) in &reads.tensors {
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
}

/// The I/O thread's loop: the streamed units in order, round and round, one per free buffer,
/// until the model is dropped.
fn stream(
    order: &[(usize, Arc<Reads>)],
    free: &Receiver<AlignedBuf>,
    filled: &Sender<Filled>,
    counter: &AtomicU64,
) {
    for (layer, reads) in order.iter().cycle() {
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
        let layer = *layer;
        if filled.send(Filled { layer, result }).is_err() {
            return;
        }
    }
}

/// `w` with its bytes passed through `relocate`.
fn relocated_matrix<'l>(
    w: &'l WeightMatrix<'_>,
    relocate: &dyn Fn(&'l [u8]) -> &'l [u8],
) -> Result<WeightMatrix<'l>> {
    Ok(match w {
        WeightMatrix::Bf16(x) => Bf16Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        WeightMatrix::F16(x) => F16Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        WeightMatrix::F32(x) => F32Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        WeightMatrix::MxFp4(x) => MxFp4Matrix::new(
            relocate(x.packed()),
            relocate(x.scales()),
            x.rows(),
            x.cols(),
        )?
        .into(),
    })
}

/// `layer` with every matrix's bytes passed through `relocate`; vectors shared.
fn relocated<'l>(
    layer: &'l Layer<'_>,
    relocate: &dyn Fn(&'l [u8]) -> &'l [u8],
) -> Result<Layer<'l>> {
    let m = |w: &'l WeightMatrix<'_>| relocated_matrix(w, relocate);
    let mlp = |w: &'l Mlp<'_>| -> Result<Mlp<'l>> {
        Ok(Mlp {
            gate: m(&w.gate)?,
            up: m(&w.up)?,
            down: m(&w.down)?,
        })
    };
    let attention = match &layer.attention {
        Attention::Kda(w) => Attention::Kda(Kda {
            q: m(&w.q)?,
            k: m(&w.k)?,
            v: m(&w.v)?,
            g: m(&w.g)?,
            o: m(&w.o)?,
            conv: w.conv.clone(),
            f_a: m(&w.f_a)?,
            f_b: m(&w.f_b)?,
            b: m(&w.b)?,
            a_log: w.a_log.clone(),
            dt_bias: w.dt_bias.clone(),
            o_norm: w.o_norm.clone(),
        }),
        Attention::Mla(w) => Attention::Mla(Mla {
            q_a: m(&w.q_a)?,
            q_a_norm: w.q_a_norm.clone(),
            q_b: m(&w.q_b)?,
            kv_a: m(&w.kv_a)?,
            kv_a_norm: w.kv_a_norm.clone(),
            kv_b: w.kv_b.clone(),
            g: w.g.as_ref().map(m).transpose()?,
            o: m(&w.o)?,
        }),
    };
    let ffn = match &layer.ffn {
        Ffn::Dense(w) => Ffn::Dense(mlp(w)?),
        Ffn::Moe(w) => Ffn::Moe(Moe {
            router: m(&w.router)?,
            bias: w.bias.clone(),
            latent: match &w.latent {
                Some((down, norm, up)) => Some((m(down)?, norm.clone(), m(up)?)),
                None => None,
            },
            shared: w.shared.as_ref().map(mlp).transpose()?,
            layer: w.layer,
        }),
    };
    Ok(Layer {
        input_norm: layer.input_norm.clone(),
        post_norm: layer.post_norm.clone(),
        attn_res_score: layer.attn_res_score.clone(),
        mlp_res_score: layer.mlp_res_score.clone(),
        attention,
        ffn,
    })
}
