//! What a binary's NUMA and thread flags ask for ([`PoolOptions`]), turned into a topology and
//! a pool.

use std::sync::Arc;

use crate::error::Error;
use crate::pool::{Pool, Threads};
use crate::ranks::{Ranks, cpu_share};
use crate::topology::{Topology, TopologyOptions, TopologySource};

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
        self.build_for(Arc::new(Ranks::single()))
    }

    /// The pool of one of several ranks: when ranks share a host, each takes its own
    /// contiguous share of the host's CPUs ([`cpu_share`]) so that their workers are not
    /// pinned to the same cores, and `--threads` counts this rank's workers.
    pub fn build_for(&self, ranks: Arc<Ranks>) -> Result<Pool, Error> {
        let mut topology = self.topology();
        let (index, count) = ranks.local();
        if count > 1 {
            let all: Vec<usize> = topology
                .domains
                .iter()
                .flat_map(|d| d.cpus.iter().copied())
                .collect();
            let mine = cpu_share(&all, index, count);
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
