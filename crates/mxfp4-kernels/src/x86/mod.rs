//! The x86 tiers: the AVX-512 tiers (`exact`, `bf16`, `vnni`, with `float` for F16/F32 weights
//! and `packed` for packed BF16 in the exact tier) and the `avx2` tier, which runs the exact
//! AVX-512 tier's arithmetic on 256-bit vectors. Each tier's `pub(crate)` functions are
//! `#[target_feature]` entry points that take their tier's token and are called only through
//! a `Kernels` value; helpers are `#[inline]` target-feature functions so they inline into the
//! entries. Every matmul runs its row blocks through one driver (`driver::drive`).
//!
//! Layers, bottom up: `lanes`, `prefetch`, `driver` -> `loads`, `sums` -> the tiers (`avx2`'s
//! MXFP4 decode borrows `exact`'s tables, `packed` the `avx2` block decode).

pub(crate) mod avx2;
pub(crate) mod bf16;
pub(crate) mod driver;
pub(crate) mod exact;
pub(crate) mod float;
pub(crate) mod lanes;
pub(crate) mod loads;
#[cfg(test)]
mod model;
pub(crate) mod packed;
pub(crate) mod prefetch;
pub(crate) mod sums;
pub(crate) mod vnni;
