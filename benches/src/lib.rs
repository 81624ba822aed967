//! Shared helpers of the k3 criterion benchmarks live in `benches/kernels.rs`; this library is empty on purpose.
