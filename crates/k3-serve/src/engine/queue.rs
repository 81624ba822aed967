//! The admission queue between the server and the engine thread: at most `capacity` jobs wait
//! (a submit over it is refused, answered 429). A job whose client has gone away (its events
//! channel closed: the HTTP response or stream was dropped) leaves the queue at once: every
//! submit, every look at the depth and every pop drops such jobs first, so they hold no slot,
//! are not counted in `k3_queue_depth`, and the engine never prefills them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::job::Job;

/// The queue; shared by the senders' side ([`Sender`]) and the engine thread.
#[derive(Debug)]
pub(super) struct JobQueue {
    state: Mutex<State>,
    changed: Condvar,
    capacity: usize,
    /// `k3_queue_depth`, kept equal to the live jobs waiting.
    depth: Arc<AtomicI64>,
}

#[derive(Debug)]
struct State {
    jobs: VecDeque<Job>,
    /// False once every sender is gone: the engine finishes and stops.
    open: bool,
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full of jobs whose clients are still there: answered 429.
    Full,
    /// The engine has stopped: answered 503.
    Stopped,
}

/// What the engine thread takes from the queue.
#[derive(Debug)]
pub(super) enum Pop {
    Job(Box<Job>),
    /// Nothing waits (only when not blocking).
    Empty,
    /// Every sender is gone and nothing waits.
    Closed,
}

impl JobQueue {
    pub(super) fn new(capacity: usize, depth: Arc<AtomicI64>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                open: true,
            }),
            changed: Condvar::new(),
            capacity: capacity.max(1),
            depth,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the jobs whose client went away and republishes the depth.
    fn prune(&self, state: &mut State) {
        state.jobs.retain(|job| !job.events.is_closed());
        self.depth.store(state.jobs.len() as i64, Ordering::Relaxed);
    }

    /// Queues `job`, unless the queue holds `capacity` live jobs already or the engine has
    /// stopped taking jobs.
    pub(super) fn submit(&self, job: Job) -> Result<(), SubmitError> {
        let mut state = self.lock();
        if !state.open {
            return Err(SubmitError::Stopped);
        }
        self.prune(&mut state);
        if state.jobs.len() >= self.capacity {
            return Err(SubmitError::Full);
        }
        state.jobs.push_back(job);
        self.depth.store(state.jobs.len() as i64, Ordering::Relaxed);
        self.changed.notify_one();
        Ok(())
    }

    /// The live jobs waiting now.
    pub(super) fn depth(&self) -> usize {
        let mut state = self.lock();
        self.prune(&mut state);
        state.jobs.len()
    }

    /// The oldest live job; with `block`, waits for one (or for the queue to close).
    pub(super) fn pop(&self, block: bool) -> Pop {
        let mut state = self.lock();
        loop {
            self.prune(&mut state);
            if let Some(job) = state.jobs.pop_front() {
                self.depth.store(state.jobs.len() as i64, Ordering::Relaxed);
                return Pop::Job(Box::new(job));
            }
            if !state.open {
                return Pop::Closed;
            }
            if !block {
                return Pop::Empty;
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Takes no more jobs; the engine drains what waits, then stops.
    fn close(&self) {
        self.lock().open = false;
        self.changed.notify_all();
    }
}

/// The senders' hold on the queue: when the last clone of the [`super::handle::EngineHandle`] holding
/// it is dropped, the queue closes.
#[derive(Debug)]
pub(super) struct Sender(pub(super) Arc<JobQueue>);

impl Drop for Sender {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests;
