//! The worker pools, one per domain, and the dispatcher: `map_on` runs a flat list of tasks, each on the domain it is tagged with, and returns their results in task order.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::Error;
use crate::hot::{Mailbox, run_hot};
use crate::ranks::Ranks;
use crate::topology::Topology;

/// How many workers each domain gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// `--threads N`: N in all, split as evenly as the domains allow (at least one each).
    Total(usize),
    /// `--numa-threads N`: N in every domain.
    PerDomain(usize),
}

impl Threads {
    /// Workers of each of `domains` domains.
    pub fn split(self, domains: usize) -> Vec<usize> {
        match self {
            Threads::PerDomain(n) => vec![n.max(1); domains],
            Threads::Total(n) => (0..domains)
                .map(|d| (n * (d + 1) / domains - n * d / domains).max(1))
                .collect(),
        }
    }
}

/// One domain's workers.
pub(crate) struct DomainPool {
    pool: Option<rayon::ThreadPool>,
    pub(crate) threads: usize,
}

/// Counts live workers so `Drop` can wait for them to exit.
#[derive(Default)]
struct Live {
    count: Mutex<usize>,
    gone: Condvar,
}

/// Worker pools, one per domain.
///
/// Any number of threads may drive one pool at once (it is `Sync`, and `Arc`s of it are
/// shared between the model and its callers). With several domains, [`Pool::install`] makes
/// the other domains' workers wait on one mailbox each, which serves one caller at a time; so
/// a call from outside the pool ([`Pool::install`], [`Pool::map_on`], [`Pool::map`],
/// [`Pool::broadcast`]) first waits for the call in progress to return: callers take turns, a
/// whole call at a time. A call made from inside a call (by `install`'s `f`, or by a task) is
/// part of it and goes ahead. With one domain, rayon's own queues serve concurrent callers
/// and nothing waits.
pub struct Pool {
    pub(crate) domains: Vec<DomainPool>,
    topology: Topology,
    live: Arc<Live>,
    /// One per domain (index 0 unused): where `map_on` posts a domain's tasks while the
    /// domain's workers spin inside [`Pool::install`].
    pub(crate) mailboxes: Vec<Arc<Mailbox>>,
    /// Set while `install` keeps the other domains' workers spinning on their mailboxes.
    pub(crate) hot: std::sync::atomic::AtomicBool,
    /// Held for a call from outside the pool while the pool has several domains (see
    /// [`Pool::drive`]).
    driver: Mutex<()>,
    /// The processes this pool's work is split over (one unless the engine runs under MPI).
    ranks: Arc<Ranks>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("domains", &self.domains.len())
            .field("threads", &self.threads())
            .finish()
    }
}

impl Pool {
    /// `threads` workers in one domain: worker `i` is pinned to the `i`-th CPU the process
    /// may run on (modulo their number).
    pub fn new(threads: usize) -> Result<Self, Error> {
        if threads == 0 {
            return Err(Error::NoThreads);
        }
        let mut cpus: Vec<usize> = core_affinity::get_core_ids()
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.id)
            .collect();
        cpus.sort_unstable();
        Self::with_topology(
            Topology::split(&cpus, 1, Vec::new()),
            Threads::Total(threads),
        )
    }

    /// One pool per domain of `topology`, sized by `threads`; worker `i` of domain `d` is
    /// pinned to the domain's `i`-th CPU (modulo their number).
    pub fn with_topology(topology: Topology, threads: Threads) -> Result<Self, Error> {
        if matches!(threads, Threads::Total(0) | Threads::PerDomain(0)) {
            return Err(Error::NoThreads);
        }
        let live = Arc::new(Live::default());
        let sizes = threads.split(topology.domains.len());
        let domains = topology
            .domains
            .iter()
            .zip(sizes)
            .map(|(domain, threads)| {
                let cpus = domain.cpus.clone();
                let d = domain.index;
                let exit = Arc::clone(&live);
                // Counted before they start, so a drop can never miss one still starting.
                *live.count.lock().unwrap_or_else(|p| p.into_inner()) += threads;
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("k3-d{d}-w{i}"))
                    .start_handler(move |i| {
                        if let Some(&cpu) = cpus.get(i % cpus.len().max(1)) {
                            core_affinity::set_for_current(core_affinity::CoreId { id: cpu });
                        }
                    })
                    .exit_handler(move |_| {
                        let mut count = exit.count.lock().unwrap_or_else(|p| p.into_inner());
                        *count -= 1;
                        exit.gone.notify_all();
                    })
                    .build()
                    .map_err(|e| Error::Start(e.to_string()))?;
                Ok(DomainPool {
                    pool: Some(pool),
                    threads,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let mailboxes = (0..domains.len())
            .map(|_| Arc::new(Mailbox::default()))
            .collect();
        Ok(Self {
            domains,
            topology,
            live,
            mailboxes,
            hot: std::sync::atomic::AtomicBool::new(false),
            driver: Mutex::new(()),
            ranks: Arc::new(Ranks::single()),
        })
    }

    /// The pool as one rank of several ([`Ranks`]): callers split row-split work over the
    /// ranks first, then over this pool's domains.
    pub fn with_ranks(mut self, ranks: Arc<Ranks>) -> Self {
        self.ranks = ranks;
        self
    }

    /// The ranks this pool is one of.
    pub fn ranks(&self) -> &Arc<Ranks> {
        &self.ranks
    }

    /// Workers in all domains.
    pub fn threads(&self) -> usize {
        self.domains.iter().map(|d| d.threads).sum()
    }

    /// Number of domains.
    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    /// Workers of domain `d`.
    pub fn domain_threads(&self, d: usize) -> usize {
        self.domains[d].threads
    }

    /// The domains the pool's workers are pinned to.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    pub(crate) fn rayon(&self, d: usize) -> &rayon::ThreadPool {
        self.domains[d]
            .pool
            .as_ref()
            .expect("pools live until drop")
    }

    /// The single-caller rule of the mailboxes (see [`Pool`]): with several domains, a caller
    /// outside the pool holds `driver` for its whole call; the pool's own workers run on
    /// behalf of the holder and take nothing (taking it would deadlock a nested call).
    fn drive(&self) -> Option<MutexGuard<'_, ()>> {
        if self.domains.len() == 1 || self.is_own_worker() {
            return None;
        }
        // A panic in another caller's call leaves nothing half-done that the lock guards.
        Some(self.driver.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether the current thread is one of this pool's workers.
    fn is_own_worker(&self) -> bool {
        self.domains.iter().any(|d| {
            d.pool
                .as_ref()
                .is_some_and(|p| p.current_thread_index().is_some())
        })
    }

    /// Runs `f` on one of domain 0's workers and returns its result. [`Pool::map_on`] called
    /// inside `f` then starts on that worker at once while the others join, instead of waking
    /// them all from the calling thread and sleeping until they finish.
    ///
    /// With several domains, the other domains' workers spin on their mailboxes while `f`
    /// runs, so each `map_on` inside reaches them at once (they sleep again when `f` returns).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads() == 1 {
            return f();
        }
        let _driver = self.drive();
        if self.domains.len() == 1 || self.hot.swap(true, Ordering::AcqRel) {
            return self.rayon(0).install(f);
        }
        // The spin jobs own their Arcs; `hot` is cleared before we wait for them to stop.
        let hot = Arc::new(std::sync::atomic::AtomicBool::new(true));
        for (d, mailbox) in self.mailboxes.iter().enumerate().skip(1) {
            let workers = self.domains[d].threads;
            mailbox.spinning.fetch_add(workers, Ordering::AcqRel);
            let (mailbox, hot) = (Arc::clone(mailbox), Arc::clone(&hot));
            self.rayon(d).spawn_broadcast(move |_| {
                mailbox.spin(&hot);
                mailbox.spinning.fetch_sub(1, Ordering::AcqRel);
            });
        }
        let result = self.rayon(0).install(f);
        hot.store(false, Ordering::Release);
        for mailbox in &self.mailboxes[1..] {
            while mailbox.spinning.load(Ordering::Acquire) > 0 {
                std::thread::yield_now();
            }
        }
        self.hot.store(false, Ordering::Release);
        result
    }

    /// Runs `f(worker)` once on every worker of every domain, all at once, and returns when
    /// all have returned; `worker` counts `0..threads()`, domain 0's workers first. For work
    /// that must give each pinned worker exactly one share (the read-bandwidth probe), which
    /// `map_on`'s stealing does not promise.
    ///
    /// # Panics
    ///
    /// If `f` panics; and if called from inside [`Pool::install`] with several domains, where
    /// the other domains' workers are busy on their mailboxes and could never take part.
    pub fn broadcast(&self, f: impl Fn(usize) + Sync) {
        let _driver = self.drive();
        assert!(
            self.domains.len() == 1 || !self.hot.load(Ordering::Acquire),
            "Pool::broadcast called inside Pool::install with {} domains",
            self.domains.len()
        );
        let firsts: Vec<usize> = self
            .domains
            .iter()
            .scan(0, |first, d| {
                let this = *first;
                *first += d.threads;
                Some(this)
            })
            .collect();
        self.broadcast_from(0, &firsts, &f);
    }

    /// Domains `d..` each broadcast in their own pool, in nested scopes so all run at once.
    fn broadcast_from(&self, d: usize, firsts: &[usize], f: &(impl Fn(usize) + Sync)) {
        let here = |d: usize| {
            self.rayon(d).broadcast(|ctx| f(firsts[d] + ctx.index()));
        };
        if d + 1 == self.domains.len() {
            return here(d);
        }
        self.rayon(d).in_place_scope(|scope| {
            // One job into domain d's pool: the worker that takes it joins its own broadcast.
            scope.spawn(move |_| here(d));
            self.broadcast_from(d + 1, firsts, f);
        });
    }

    /// The domain that task `i` of `tasks` gets from [`Pool::map`]: contiguous, equal blocks
    /// of tasks per domain (so a row-block split gives each domain its own rows).
    pub fn block_domain(&self, i: usize, tasks: usize) -> usize {
        i * self.domains.len() / tasks.max(1)
    }

    /// [`Pool::map_on`] with each task on [`Pool::block_domain`].
    pub fn map<T: Send>(
        &self,
        tasks: usize,
        task: impl Fn(usize) -> T + Sync + Send,
    ) -> Result<Vec<T>, Error> {
        self.map_on(tasks, |i| self.block_domain(i, tasks), task)
    }

    /// Runs `task(0..tasks)`, task `i` on domain `domain_of(i)`'s workers (stealing only
    /// among them), and returns the results in task order. A panicking task is reported as
    /// [`Error::TaskPanicked`]; the pool stays usable.
    pub fn map_on<T: Send>(
        &self,
        tasks: usize,
        domain_of: impl Fn(usize) -> usize,
        task: impl Fn(usize) -> T + Sync + Send,
    ) -> Result<Vec<T>, Error> {
        let _driver = self.drive();
        let n = self.domains.len();
        let mut by_domain: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in 0..tasks {
            let d = domain_of(i);
            if d >= n {
                return Err(Error::NoDomain {
                    task: i,
                    domain: d,
                    domains: n,
                });
            }
            by_domain[d].push(i);
        }
        let slots: Vec<Mutex<Option<Result<T, Error>>>> =
            (0..tasks).map(|_| Mutex::new(None)).collect();
        let run = |i: usize, d: usize| {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(i)))
                .map_err(|payload| Error::TaskPanicked {
                    task: i,
                    domain: d,
                    message: panic_message(&*payload),
                });
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        };
        if self.threads() == 1 {
            for (d, list) in by_domain.iter().enumerate() {
                list.iter().for_each(|&i| run(i, d));
            }
        } else if self.hot.load(Ordering::Acquire) && self.domains.len() > 1 {
            run_hot(&self.mailboxes, &by_domain, &run, |local| {
                use rayon::prelude::*;
                if !local.is_empty() {
                    self.rayon(0).install(|| {
                        local.par_iter().with_max_len(1).for_each(|&i| run(i, 0));
                    });
                }
            });
        } else {
            self.run_domains(&by_domain, &run, 1);
        }
        slots
            .into_iter()
            .map(|slot| {
                slot.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .expect("every task ran")
            })
            .collect()
    }

    /// Domains `d..` each run their list inside their own pool (one scope per domain, nested
    /// so they all run at once); domain 0's list runs last, innermost, on the calling side.
    fn run_domains(
        &self,
        by_domain: &[Vec<usize>],
        run: &(impl Fn(usize, usize) + Sync),
        d: usize,
    ) {
        use rayon::prelude::*;
        if d == by_domain.len() {
            let list = &by_domain[0];
            if !list.is_empty() {
                self.rayon(0).install(|| {
                    list.par_iter().with_max_len(1).for_each(|&i| run(i, 0));
                });
            }
            return;
        }
        let list = &by_domain[d];
        if list.is_empty() {
            return self.run_domains(by_domain, run, d + 1);
        }
        self.rayon(d).in_place_scope(|scope| {
            // One job into domain d's pool; inside it the list splits among d's workers.
            scope.spawn(move |_| {
                list.par_iter().with_max_len(1).for_each(|&i| run(i, d));
            });
            self.run_domains(by_domain, run, d + 1);
        });
    }
}

impl Drop for Pool {
    /// Ends every worker and waits until they have exited.
    fn drop(&mut self) {
        for domain in &mut self.domains {
            domain.pool = None;
        }
        let mut count = self.live.count.lock().unwrap_or_else(|p| p.into_inner());
        while *count > 0 {
            count = self
                .live
                .gone
                .wait(count)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".into())
}

#[cfg(test)]
mod tests;
