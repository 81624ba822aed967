//! The routed-expert residency cache: experts read from their shards into owned buffers on a
//! pool of I/O threads, kept up to a capacity (experts per layer, or bytes) under an eviction
//! policy, preloaded on request, with usage statistics.
//!
//! Policy. LRU by default: the expert whose last use is oldest goes first. `UsageWeighted`
//! evicts the expert with the fewest uses (this run's plus an earlier run's, from the usage
//! file), the oldest last use breaking ties. A capacity in experts per layer evicts within the
//! layer that needs room; a capacity in bytes evicts across layers. At full residency (the
//! capacity holds every expert) nothing is ever evicted, so no order is kept at all.
//!
//! Guards. A request hands out [`Expert`]s, each an `Arc` to the buffer: eviction only drops
//! the cache's reference, so an expert stays in memory while a task uses it (the cache can
//! briefly hold more than its capacity by the experts of requests in flight).
//!
//! Loads. A request names all of a layer's selected experts at once; hits come back at once,
//! misses are sent to the I/O threads in file-offset order and come back as they land. Each
//! miss is one `pread` per run of its tensors stored back to back in one file: one when an
//! expert's tensors are contiguous (as in K3's release), several when a re-sharded checkpoint
//! splits them over shards; with `O_DIRECT` where the filesystem allows it. A failed read fails
//! the requests that wanted that expert, naming the file and the expert; nothing else is
//! affected.
//!
//! Layout. Which tensors make up an expert and each matrix's shape come from the caller's
//! [`ExpertLayout`](crate::ExpertLayout): the store finds experts by its names and validates
//! every landed expert against its shapes.
//!
//! Determinism. The store decides only when bytes arrive, never what they are: the forward
//! pass writes each expert's output to a slot fixed by the router and sums in a fixed order.
//!
//! Files, bottom up. `config` (capacity, policy, errors), `cache` (the residency cache: a pure
//! type, no I/O or threads, with the eviction order's unit tests), `buffer` (expert buffers,
//! guards, the free list), `shared` (the state the I/O threads share), `open` (the store's
//! handle, opened), then its methods: `loader` (reads on the I/O threads), `placement` (NUMA
//! homes and binding), `preload`, `request`, `stats`, `source` (the [`crate::source`] seam);
//! this file only declares them and re-exports the public names.

pub(crate) mod buffer;
mod cache;
pub(crate) mod config;
mod loader;
pub(crate) mod open;
mod placement;
pub(crate) mod preload;
pub(crate) mod request;
mod shared;
mod source;
pub(crate) mod stats;

pub use buffer::{Expert, buffer_bytes, io_buffers, request_buffers};
pub use config::{Capacity, Policy, Result, StoreConfig, StoreError};
pub use open::ExpertStore;
pub use preload::{PreloadProgress, PreloadReport};
pub use request::Request;
pub use stats::StoreStats;
