//! Preload: the experts an earlier run used most (or all of them) read before any request.

use std::time::{Duration, Instant};

use super::config::{Capacity, Result};
use super::open::ExpertStore;
use super::shared::Shared;

/// Progress of [`ExpertStore::preload`], reported after each expert lands.
#[derive(Debug, Clone, Copy)]
pub struct PreloadProgress {
    /// Experts landed so far.
    pub experts_done: usize,
    /// Experts the preload reads.
    pub experts_total: usize,
    /// Bytes landed so far.
    pub bytes_done: u64,
    /// Bytes the preload reads.
    pub bytes_total: u64,
}

/// What [`ExpertStore::preload`] did.
#[derive(Debug, Clone, Copy)]
pub struct PreloadReport {
    /// Experts read.
    pub experts: usize,
    /// Bytes read (buffers, with the 4 KiB rounding).
    pub bytes: u64,
    /// Wall time of the preload.
    pub elapsed: Duration,
}

impl PreloadReport {
    /// The read rate, in GB/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

impl ExpertStore {
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
                if cache.start_load(key, || (tx.clone(), n)) {
                    to_load.push(key);
                }
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
}

impl Shared {
    /// The experts preload reads: all at full residency, else the most used first.
    pub(super) fn preload_choice(&self) -> Vec<(usize, usize)> {
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
}
