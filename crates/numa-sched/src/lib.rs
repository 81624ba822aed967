//! Where work runs: NUMA topology (sysfs, or a synthetic split of the CPUs into N domains), pinned worker pools per domain, node-local allocation, and a dispatcher that writes each task result to a slot fixed in advance.
//!
//! A [`Pool`] holds one worker pool per domain of a [`Topology`]; worker `i` of domain `d` is
//! named `k3-d{d}-w{i}` and pinned to one of the domain's CPUs before it runs any task (so its
//! first touches place memory on that domain). [`Pool::map_on`] runs a flat list of tasks,
//! each on the domain the caller tags it with, work-stealing inside a domain only, and
//! returns the results in task order: nothing a caller computes from them can depend on which
//! worker ran what. [`memory`] binds memory to a domain's node.

#![warn(missing_docs)]

mod error;
mod hot;
#[cfg(feature = "libnuma")]
pub mod libnuma;
pub mod memory;
mod options;
mod pool;
pub mod ranks;
mod thread;
pub mod topology;

pub use error::Error;
pub use options::PoolOptions;
pub use pool::{Pool, Threads};
pub use ranks::{CollectiveStats, Ranks, RanksError};
pub use thread::spawn_io_thread;
pub use topology::{Domain, Topology, TopologyOptions, TopologySource};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
