//! The x86 tiers: the AVX-512 tiers (`exact`, `bf16`, `vnni`, with `float` for F16/F32 weights,
//! `packed` for packed BF16 in the exact tier and `q8_0` for Q8_0 in all three) and the `avx2`
//! tier, which runs the exact AVX-512 tier's arithmetic on 256-bit vectors. A tier is a set of
//! row kernels, one per weight format (types implementing `driver::RowKernel`); `entry` has
//! each tier's one `#[target_feature]` entry point, generic over the kernel, which runs it
//! through the one row-blocking driver (`driver::drive`). `Kernels` calls the entries with its
//! token; helpers are `#[inline]` target-feature functions so they inline into the kernels.
//!
//! Layers, bottom up: `lanes`, `prefetch`, `driver` -> `entry`, `loads`, `sums` -> the tiers
//! (`avx2`'s MXFP4 decode borrows `exact`'s tables, `packed` the `avx2` block decode).

pub(crate) mod avx2;
pub(crate) mod bf16;
pub(crate) mod driver;
pub(crate) mod entry;
pub(crate) mod exact;
pub(crate) mod float;
pub(crate) mod lanes;
pub(crate) mod loads;
#[cfg(test)]
mod model;
pub(crate) mod packed;
pub(crate) mod prefetch;
pub(crate) mod q8_0;
pub(crate) mod sums;
pub(crate) mod vnni;
