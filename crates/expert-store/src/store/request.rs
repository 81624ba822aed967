//! Requests: a layer's selected experts, hits at once and misses as their loads land.
//!
//! A request keeps at most [`ExpertStore::window`] of its own reads outstanding (sent to the
//! I/O threads and not yet handed back): the others wait in its queue, in file order, and go
//! out as landed experts are handed back. So the expert buffers one request holds outside the
//! cache are bounded by the window and the batch its caller holds, whatever the layer's
//! count of missing experts (`buffer::request_buffers`): memory a budget can give to the trunk.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::buffer::Expert;
use super::cache::Use;
use super::config::{Result, StoreError};
use super::open::ExpertStore;
use super::shared::{Job, Landed, Shared};

impl ExpertStore {
    /// Asks for `experts` of checkpoint layer `layer`: resident ones are ready at once, the
    /// others are read in file-offset order on the I/O threads, at most [`Self::window`] of
    /// them outstanding at a time. Results are indexed by the position in `experts`.
    pub fn request(&self, layer: usize, experts: &[usize]) -> Request<'_> {
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
            return Request::new(self, ready, rx, 0, Vec::new());
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
                        to_load.push((i, (layer, expert)));
                        pending += 1;
                    }
                }
            }
        }
        to_load.sort_by_key(|(_, k)| shared.table[k].file_order());
        let mut request = Request::new(self, ready, rx, pending, to_load);
        request.send_up_to_window();
        request
    }

    /// Reads one request keeps outstanding at most: one per I/O thread, so every thread has a
    /// read while the caller runs the experts that landed.
    pub fn window(&self) -> usize {
        self.shared.window
    }
}

/// A pending request: the experts of one layer, handed back as they become available.
#[derive(Debug)]
pub struct Request<'s> {
    store: &'s ExpertStore,
    ready: VecDeque<Landed>,
    rx: Receiver<Landed>,
    /// Experts still to come: queued, outstanding, or loading for another request.
    pending: usize,
    /// This request's loads not yet sent, in file order: (position, key).
    queue: VecDeque<(usize, (usize, usize))>,
    /// Positions whose load this request sent, by position (the others it waits on were
    /// started by another request, or are hits).
    sent: Vec<bool>,
    /// Sent and not yet received back.
    outstanding: usize,
}

impl<'s> Request<'s> {
    fn new(
        store: &'s ExpertStore,
        ready: VecDeque<Landed>,
        rx: Receiver<Landed>,
        pending: usize,
        to_load: Vec<(usize, (usize, usize))>,
    ) -> Self {
        let positions = to_load.iter().map(|&(i, _)| i + 1).max().unwrap_or(0);
        Self {
            store,
            ready,
            rx,
            pending,
            queue: to_load.into(),
            sent: vec![false; positions],
            outstanding: 0,
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.store.shared
    }

    /// Sends queued loads until [`ExpertStore::window`] are outstanding.
    fn send_up_to_window(&mut self) {
        while self.outstanding < self.store.window()
            && let Some((i, key)) = self.queue.pop_front()
        {
            self.send(i, key);
        }
    }

    fn send(&mut self, i: usize, key: (usize, usize)) {
        self.sent[i] = true;
        self.outstanding += 1;
        // The I/O threads only stop when the store drops, which this borrow rules out.
        let jobs = self.store.jobs.as_ref();
        let _ = jobs.map(|jobs| jobs.send(Job { key }));
    }

    /// Counts `landed` as received (one of this request's own loads, or another's it joined).
    fn received(&mut self, landed: &Landed) {
        if self.sent.get(landed.0).copied().unwrap_or(false) {
            self.sent[landed.0] = false;
            self.outstanding -= 1;
        }
        self.pending -= 1;
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
                    self.received(&landed);
                    batch.push(landed);
                }
                Err(_) => break,
            }
        }
        if batch.is_empty() && self.pending > 0 {
            self.send_up_to_window();
            let start = Instant::now();
            let landed = self
                .rx
                .recv()
                .expect("every waiter is answered before its loader drops the sender");
            self.shared()
                .wait_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.received(&landed);
            batch.push(landed);
        }
        // The next reads go out before the caller runs this batch.
        self.send_up_to_window();
        batch
    }
}

impl Drop for Request<'_> {
    /// Sends what is still queued: another request may have joined one of these loads, and
    /// waits for it (the landed experts of this one go nowhere and are dropped).
    fn drop(&mut self) {
        while let Some((i, key)) = self.queue.pop_front() {
            self.send(i, key);
        }
    }
}
