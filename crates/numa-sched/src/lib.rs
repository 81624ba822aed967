//! Where work runs: NUMA topology (sysfs, or a synthetic split of the CPUs into N domains), pinned worker pools per domain, node-local allocation, and a dispatcher that writes each task result to a slot fixed in advance.
//!
//! A [`Pool`] holds one worker pool per domain of a [`Topology`]; worker `i` of domain `d` is
//! named `k3-d{d}-w{i}` and pinned to one of the domain's CPUs before it runs any task (so its
//! first touches place memory on that domain). [`Pool::map_on`] runs a flat list of tasks,
//! each on the domain the caller tags it with, work-stealing inside a domain only, and
//! returns the results in task order: nothing a caller computes from them can depend on which
//! worker ran what. [`memory`] binds memory to a domain's node.

mod hot;
#[cfg(feature = "libnuma")]
pub mod libnuma;
pub mod memory;
mod pool;
pub mod ranks;
mod thread;
pub mod topology;

pub use pool::Pool;
pub use ranks::{CollectiveStats, Ranks, RanksError};
pub use thread::spawn_io_thread;
pub use topology::{Domain, Topology, TopologyOptions, TopologySource};

/// Errors of pool construction and of tasks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("a pool needs at least one thread")]
    NoThreads,
    #[error("could not start the worker pool: {0}")]
    Start(String),
    #[error("task {task} (domain {domain}) panicked: {message}")]
    TaskPanicked {
        task: usize,
        domain: usize,
        message: String,
    },
    #[error("task {task} was tagged with domain {domain}, but the pool has {domains}")]
    NoDomain {
        task: usize,
        domain: usize,
        domains: usize,
    },
}

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

/// What the binaries' `--numa`, `--numa-fake N`, `--threads N`, `--numa-threads N` and
/// `--hyperthreads` flags ask for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Use the machine's NUMA nodes as domains (otherwise one domain over all CPUs).
    pub numa: bool,
    /// Split the CPUs into this many synthetic domains (overrides `numa`).
    pub fake_domains: Option<usize>,
    /// Workers in all (split evenly over the domains, at least one each); default: one per
    /// CPU of the topology (physical cores unless `hyperthreads`).
    pub threads: Option<usize>,
    /// Workers per domain (overrides `threads`).
    pub threads_per_domain: Option<usize>,
    /// Keep hyperthread siblings.
    pub hyperthreads: bool,
}

impl PoolOptions {
    /// The topology these options describe.
    pub fn topology(&self) -> Topology {
        let options = TopologyOptions {
            hyperthreads: self.hyperthreads,
        };
        match self.fake_domains {
            Some(n) => Topology::fake(n, options),
            None if self.numa => Topology::detect(options),
            None => {
                let real = Topology::detect(options);
                let mut cpus: Vec<usize> =
                    real.domains.iter().flat_map(|d| d.cpus.clone()).collect();
                cpus.sort_unstable();
                let mut one = Topology::split(&cpus, 1, real.skipped_siblings);
                one.source = TopologySource::Merged;
                one.domains[0].node = (real.domains.len() == 1)
                    .then_some(real.domains[0].node)
                    .flatten();
                one
            }
        }
    }

    /// The pool: one per domain of [`Self::topology`].
    pub fn build(&self) -> Result<Pool, Error> {
        self.build_for(std::sync::Arc::new(Ranks::single()))
    }

    /// The pool of one of several ranks: when ranks share a host, each takes its own
    /// contiguous share of the host's CPUs ([`ranks::cpu_share`]) so that their workers are not
    /// pinned to the same cores, and `--threads` counts this rank's workers.
    pub fn build_for(&self, ranks: std::sync::Arc<Ranks>) -> Result<Pool, Error> {
        let mut topology = self.topology();
        let (index, count) = ranks.local();
        if count > 1 {
            let all: Vec<usize> = topology
                .domains
                .iter()
                .flat_map(|d| d.cpus.iter().copied())
                .collect();
            let mine = ranks::cpu_share(&all, index, count);
            for domain in &mut topology.domains {
                let kept: Vec<usize> = domain
                    .cpus
                    .iter()
                    .copied()
                    .filter(|c| mine.contains(c))
                    .collect();
                // A domain left without CPUs runs on this rank's share (still its own pool).
                domain.cpus = if kept.is_empty() { mine.clone() } else { kept };
            }
        }
        let threads = match (self.threads_per_domain, self.threads) {
            (Some(n), _) => Threads::PerDomain(n),
            (None, Some(n)) => Threads::Total(n),
            (None, None) => Threads::Total(topology.domains.iter().map(|d| d.cpus.len()).sum()),
        };
        Ok(Pool::with_topology(topology, threads)?.with_ranks(ranks))
    }
}

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
