//! Loads on the I/O threads: the reads in file order, and the validation of the bytes that
//! land.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use mxfp4_kernels::MxFp4Matrix;

use super::buffer::{Expert, ExpertData};
use super::config::{Result, StoreError};
use super::open::ExpertStore;
use super::shared::{ExpertCache, Job, Located, Shared};
use crate::io::{AlignedBuf, ShardReader, memlock_limit, read_pieces};

impl ExpertStore {
    pub(super) fn send_in_file_order(&self, mut keys: Vec<(usize, usize)>) {
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

impl Shared {
    /// Says once that some expert reads go through the page cache: at open (O_DIRECT refused
    /// or not asked for) or when a read first falls back (O_DIRECT refused at read time).
    pub(super) fn say_if_buffered(&self) {
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

    /// Runs on an I/O thread: reads `key`, makes it resident if the capacity allows, and
    /// answers everyone waiting for it.
    pub(super) fn load(&self, key: (usize, usize)) {
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
        let waiters = cache.finish_load(key);
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

    /// Makes a landed expert resident when the capacity allows (the cache evicts by the
    /// policy), and pins its buffer when asked.
    fn admit(&self, cache: &mut ExpertCache, key: (usize, usize), data: &Arc<ExpertData>) {
        let (layer, expert) = key;
        let pos = self.layer_pos[&layer];
        let admitted = cache.admit(pos, key, Arc::clone(data), data.bytes(), || {
            self.uses_of(layer, expert)
        });
        if !admitted {
            return;
        }
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
    }

    pub(super) fn build(
        &self,
        key: (usize, usize),
        located: &Located,
        buf: AlignedBuf,
        starts: &[usize],
    ) -> Result<Arc<ExpertData>> {
        let (layer, expert) = key;
        let part = |i: usize| -> &'static [u8] {
            let (segment, offset, len) = located.tensors[i];
            let at = starts[segment] + offset;
            // SAFETY: `buf` is moved into the ExpertData below, next to these views, and is
            // never mutated or freed while they live: an `Expert` hands them out only for
            // the duration of a borrow of itself, which keeps the buffer alive.
            unsafe { std::slice::from_raw_parts(buf[at..at + len].as_ptr(), len) }
        };
        let views = self
            .layout
            .matrices()
            .iter()
            .enumerate()
            .map(|(m, matrix)| {
                let (codes, scales) = (part(2 * m), part(2 * m + 1));
                MxFp4Matrix::with_name(matrix.what, codes, scales, matrix.rows, matrix.cols)
                    .map_err(|e| StoreError::Read {
                        path: self.readers[located.first_reader()].path.clone(),
                        layer,
                        expert,
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(ExpertData {
            views,
            buf: Some(buf),
            size: located.bytes,
            free: Arc::clone(&self.free),
        }))
    }
}
