//! Hot dispatch: while `Pool::install` runs, the other domains' workers spin on a mailbox each, and `map_on` posts their task lists there instead of waking them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// A domain's task list posted by `map_on` (see [`Mailbox`]).
struct Posted {
    /// `run(task index)`: points into the posting `map_on`'s frame, which does not return
    /// before `pending` is zero; a worker only calls it for an index it claimed below `len`.
    run: *const (dyn Fn(usize) + Sync),
    tasks: *const usize,
    len: usize,
    next: std::sync::atomic::AtomicUsize,
    pending: std::sync::atomic::AtomicUsize,
}

// SAFETY: the pointers are only dereferenced while the poster waits for `pending` to reach
// zero (see `run`), and what they point to is `Sync`.
unsafe impl Send for Posted {}
// SAFETY: as above.
unsafe impl Sync for Posted {}

/// Hot dispatch to one domain. A cross-domain `map_on` otherwise wakes the other domain's
/// sleeping workers on every call (a futex and a context switch, tens of microseconds); a
/// forward pass makes about a hundred such calls per token. Inside `install` the other
/// domains' workers instead spin on their mailbox and pick up a posted list at once.
#[derive(Default)]
pub(crate) struct Mailbox {
    generation: std::sync::atomic::AtomicU64,
    posted: Mutex<Option<Arc<Posted>>>,
    /// Workers currently in the spin loop.
    pub(crate) spinning: std::sync::atomic::AtomicUsize,
}

impl Mailbox {
    /// Claims and runs tasks of the current post until none are left.
    fn drain(&self, posted: &Posted) {
        loop {
            let k = posted.next.fetch_add(1, Ordering::AcqRel);
            if k >= posted.len {
                return;
            }
            // SAFETY: k < len claims task k of the post, whose poster is still waiting for
            // this task's `pending` decrement, so `run` and `tasks` are alive.
            unsafe { (*posted.run)(*posted.tasks.add(k)) };
            posted.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A worker's loop while the pool is hot: run every post, until `hot` clears.
    pub(crate) fn spin(&self, hot: &std::sync::atomic::AtomicBool) {
        // Not the current generation: a list posted before this worker started spinning (the
        // spin job starts asynchronously) is picked up on the first pass.
        let mut seen = u64::MAX;
        let mut idle: u32 = 0;
        while hot.load(Ordering::Acquire) {
            let now = self.generation.load(Ordering::Acquire);
            if now != seen {
                seen = now;
                idle = 0;
                let posted = self
                    .posted
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                if let Some(posted) = posted {
                    self.drain(&posted);
                }
            } else {
                idle = idle.saturating_add(1);
                if idle < 1 << 16 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// Inside `Pool::install`: posts each other domain's list (`by_domain[d]`, d >= 1) to its
/// spinning workers' mailbox, runs domain 0's list here through `run_local` (stealing among
/// domain 0's workers), then waits for the posts to drain.
pub(crate) fn run_hot(
    mailboxes: &[Arc<Mailbox>],
    by_domain: &[Vec<usize>],
    run: &(impl Fn(usize, usize) + Sync),
    run_local: impl FnOnce(&[usize]),
) {
    let closures: Vec<Box<dyn Fn(usize) + Sync + '_>> = (0..by_domain.len())
        .map(|d| Box::new(move |i: usize| run(i, d)) as Box<dyn Fn(usize) + Sync + '_>)
        .collect();
    let mut posts = Vec::new();
    for (d, list) in by_domain.iter().enumerate().skip(1) {
        if list.is_empty() {
            continue;
        }
        let closure: &(dyn Fn(usize) + Sync + '_) = &*closures[d];
        // SAFETY: the lifetime is erased only for the post; this function waits below
        // until every claimed task has finished (`pending == 0`) before `closures` and
        // `by_domain` go out of scope, and workers claim nothing past `len`.
        let run_static: *const (dyn Fn(usize) + Sync) =
            unsafe { std::mem::transmute(closure as *const (dyn Fn(usize) + Sync + '_)) };
        let posted = Arc::new(Posted {
            run: run_static,
            tasks: list.as_ptr(),
            len: list.len(),
            next: std::sync::atomic::AtomicUsize::new(0),
            pending: std::sync::atomic::AtomicUsize::new(list.len()),
        });
        let mailbox = &mailboxes[d];
        *mailbox.posted.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&posted));
        mailbox.generation.fetch_add(1, Ordering::AcqRel);
        posts.push((d, posted));
    }
    run_local(&by_domain[0]);
    for (d, posted) in &posts {
        let mut spins: u32 = 0;
        while posted.pending.load(Ordering::Acquire) > 0 {
            spins = spins.saturating_add(1);
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // The post is done: no worker may pick it up again.
        *mailboxes[*d]
            .posted
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }
}
