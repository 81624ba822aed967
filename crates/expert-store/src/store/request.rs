//! Requests: a layer's selected experts, hits at once and misses as their loads land.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::buffer::Expert;
use super::cache::{Landed, Slot};
use super::config::{Result, StoreError};
use super::{ExpertStore, Shared};

impl ExpertStore {
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
}

/// A pending request: the experts of one layer, handed back as they become available.
#[derive(Debug)]
pub struct Request {
    pub(super) ready: VecDeque<Landed>,
    pub(super) rx: Receiver<Landed>,
    pub(super) pending: usize,
    pub(super) shared: Arc<Shared>,
}

impl Request {
    pub(super) fn new(
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
