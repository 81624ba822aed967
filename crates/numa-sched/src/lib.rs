//! Where work runs: NUMA topology (sysfs, or a synthetic split of the CPUs into N domains), pinned worker pools per domain, node-local allocation, and a dispatcher that writes each task result to a slot fixed in advance.
//!
//! Implemented so far: one domain — a pool of workers pinned to the machine's CPUs, named
//! `k3-d0-w{idx}`, and [`Pool::map`], which runs a flat list of tasks and returns their results
//! in task order, so what a caller computes from them cannot depend on which worker ran what.
//! Topology, several domains and node-local memory are the NUMA issue's.

pub mod topology;

pub use topology::{Domain, Topology, TopologyOptions, TopologySource};

/// Errors of pool construction.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("a pool needs at least one thread")]
    NoThreads,
    #[error("could not start the worker pool: {0}")]
    Start(String),
}

/// A pool of pinned workers (domain 0).
#[derive(Debug)]
pub struct Pool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl Pool {
    /// `threads` workers; worker `i` is pinned to the `i`-th CPU the process may run on (modulo
    /// their number) before it runs any task, so its first touches place memory there.
    pub fn new(threads: usize) -> Result<Self, Error> {
        if threads == 0 {
            return Err(Error::NoThreads);
        }
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("k3-d0-w{i}"))
            .start_handler(move |i| {
                if let Some(core) = cores.get(i % cores.len().max(1)) {
                    core_affinity::set_for_current(*core);
                }
            })
            .build()
            .map_err(|e| Error::Start(e.to_string()))?;
        Ok(Self { pool, threads })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on one of the workers and returns its result. [`Pool::map`] called inside `f`
    /// then starts on that worker at once while the others join, instead of waking all of
    /// them from the calling thread and sleeping until they finish.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads == 1 {
            return f();
        }
        self.pool.install(f)
    }

    /// Runs `task(0..tasks)` on the workers and returns the results in task order. A panicking
    /// task propagates to the caller (the pool stays usable).
    pub fn map<T: Send>(&self, tasks: usize, task: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
        use rayon::prelude::*;
        if self.threads == 1 {
            return (0..tasks).map(task).collect();
        }
        self.pool.install(|| {
            (0..tasks)
                .into_par_iter()
                .with_max_len(1)
                .map(task)
                .collect()
        })
    }
}

/// Starts an I/O thread named `k3-io-{index}` on domain 0's CPUs (all of them, with one
/// domain). I/O threads mostly sleep in `pread`, so they are not pinned to one core: the
/// domain is their placement. The NUMA issue gives each domain its own.
pub fn spawn_io_thread(
    index: usize,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("k3-io-{index}"))
        .spawn(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_task_order() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let squares = pool.map(100, |i| i * i);
            assert_eq!(squares, (0..100).map(|i| i * i).collect::<Vec<_>>());
        }
        assert!(matches!(Pool::new(0), Err(Error::NoThreads)));
    }

    #[test]
    fn workers_are_named_by_domain_and_index() {
        let pool = Pool::new(2).unwrap();
        let names = pool.map(8, |_| std::thread::current().name().map(str::to_owned));
        assert!(
            names
                .iter()
                .all(|n| n.as_deref().is_some_and(|n| n.starts_with("k3-d0-w"))),
            "{names:?}"
        );
    }

    #[test]
    fn install_runs_on_a_worker_and_map_inside_keeps_task_order() {
        let pool = Pool::new(2).unwrap();
        let (name, squares) = pool.install(|| {
            (
                std::thread::current().name().map(str::to_owned),
                pool.map(50, |i| i * i),
            )
        });
        assert!(
            name.as_deref().is_some_and(|n| n.starts_with("k3-d0-w")),
            "{name:?}"
        );
        assert_eq!(squares, (0..50).map(|i| i * i).collect::<Vec<_>>());
        // One thread: the caller runs it.
        let one = Pool::new(1).unwrap();
        assert_eq!(one.install(|| one.map(3, |i| i + 1)), [1, 2, 3]);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = Pool::new(2).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.map(4, |i| if i == 2 { panic!("task 2 failed") } else { i })
        }));
        assert!(caught.is_err());
        assert_eq!(pool.map(3, |i| i + 1), [1, 2, 3]);
    }
}
