//! The model's side of the trunk stream: taking the trunk as a plan places it (the stream's
//! thread started), and a forward pass's access to the steps it needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use expert_store::io::{AlignedBuf, ShardReader};
use expert_store::{Checkpoint, CheckpointError};

use super::resident::ResidentTrunk;
use super::stream::{Filled, Held, Pass, Reads, StepReads, StepRows, TrunkStream, stream};
use crate::io::chunks::{BULK_IO_THREAD, reader};
use crate::io::error::checkpoint_io;
use crate::model::error::{ModelError, Result};
use crate::model::forward::Model;
use crate::packcache::types::PackCache;
use crate::plan::{Part, TrunkPlan, merged_reads};

impl<'a> Model<'a> {
    /// Takes the trunk as `plan` places it: the tensors it keeps resident from `resident`
    /// ([`ResidentTrunk::load`] of `plan.resident`), the ones it streams read from `ckpt`
    /// (the checkpoint this model was loaded from), or their packed bodies from `pack` where
    /// the plan reads them there ([`StoredTensor::packed_at`]), with `O_DIRECT` on an I/O
    /// thread on `io_cpus`, through `plan.slots` buffers, a step ahead of compute. Logits are
    /// the same bits.
    ///
    /// [`StoredTensor::packed_at`]: crate::plan::StoredTensor::packed_at
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
        // Named `k3-io-{BULK_IO_THREAD}`, apart from the expert store's `k3-io-0..`.
        let thread = if order.is_empty() {
            None
        } else {
            Some(
                numa_sched::spawn_io_thread(BULK_IO_THREAD, io_cpus, move || {
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
    pub(in crate::model) fn trunk_pass(&self) -> Pass<'_> {
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
    pub(in crate::model) fn trunk_step<'m>(
        &'m self,
        pass: &mut Pass<'m>,
        step: usize,
    ) -> Result<Held<'m>> {
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
    pub(in crate::model) fn trunk_steps(&self, layer: usize, part: Part) -> &[StepRows] {
        self.trunk
            .as_ref()
            .and_then(|t| t.index.get(&(layer, part)))
            .map_or(&[], Vec::as_slice)
    }

    /// The one step of an unsplittable `part` of layer `layer`, if it is streamed.
    pub(in crate::model) fn trunk_unit<'m>(
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
