//! Requests: a layer's selected experts, hits at once and misses as their loads land.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::buffer::Expert;
use super::cache::Use;
use super::config::{Result, StoreError};
use super::{ExpertStore, Shared};

/// One expert handed back by a request: its position in the request, and it or the error.
pub(super) type Landed = (usize, Result<Expert>);

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
            let mut cache = shared.lock();
            for (i, &expert) in experts.iter().enumerate() {
                if !shared.table.contains_key(&(layer, expert)) {
                    ready.push_back((i, Err(StoreError::NoExpert { layer, expert })));
                    continue;
                }
                if let Some(uses) = shared.uses[pos].get(expert) {
                    uses.fetch_add(1, Ordering::Relaxed);
                }
                let found = cache.use_expert(
                    pos,
                    (layer, expert),
                    || shared.uses_of(layer, expert),
                    || (tx.clone(), i),
                );
                match found {
                    Use::Hit(data) => {
                        shared.hits.fetch_add(1, Ordering::Relaxed);
                        ready.push_back((i, Ok(Expert(data))));
                    }
                    Use::Joined => {
                        shared.misses.fetch_add(1, Ordering::Relaxed);
                        pending += 1;
                    }
                    Use::Started => {
                        shared.misses.fetch_add(1, Ordering::Relaxed);
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
