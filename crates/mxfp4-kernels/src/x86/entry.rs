//! The x86 tiers' entry points: one `#[target_feature]` function per tier, generic over the
//! row kernel it runs through the driver, so the kernel and the whole row walk are compiled
//! for that tier's instruction set. `Kernels` calls them (`per_tier!`) with the token it
//! holds, naming each tier's kernel once per format.
//!
//! A kernel runs only through the entry of a tier whose features include its own (`exact`
//! and `float` through `avx512`, `bf16` through `avx512_bf16`, `vnni` through `avx512_vnni`,
//! `float::Float` also through both approximate tiers, `avx2` through `avx2`).

use std::ops::Range;

use super::driver::{RowKernel, Rows, drive};
use crate::activations::Activations;
use crate::isa::{Avx2, Avx512};

/// The `avx2` tier: `K` over `rows` for every token of `act`.
///
/// # Safety
/// `K`'s target features must be among avx2, fma and f16c (the token proves those).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn avx2<M: Rows, K: RowKernel<M>>(
    _: Avx2,
    m: &M,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the CPU has `K`'s target features, by this function's contract.
    unsafe { drive::<M, K>(m, act, rows, out) }
}

/// The exact `avx512` tier: `K` over `rows` for every token of `act`.
///
/// # Safety
/// `K`'s target features must be among avx512f, avx512bw and avx512vl (the token proves
/// those).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn avx512<M: Rows, K: RowKernel<M>>(
    _: Avx512,
    m: &M,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the CPU has `K`'s target features, by this function's contract.
    unsafe { drive::<M, K>(m, act, rows, out) }
}

/// The `avx512-bf16` tier: `K` over `rows` for every token of `act`.
///
/// # Safety
/// The CPU must have avx512bf16 (`Kernels::new` detected it for this tier), and `K`'s target
/// features must be among avx512f/bw/vl (the token proves those) and avx512bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn avx512_bf16<M: Rows, K: RowKernel<M>>(
    _: Avx512,
    m: &M,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the CPU has `K`'s target features, by this function's contract.
    unsafe { drive::<M, K>(m, act, rows, out) }
}

/// The `avx512-vnni` tier: `K` over `rows` for every token of `act`.
///
/// # Safety
/// The CPU must have avx512bf16, avx512vnni and avx512vbmi (`Kernels::new` detected them for
/// this tier), and `K`'s target features must be among those and avx512f/bw/vl (the token
/// proves those).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx512vbmi")]
pub(crate) unsafe fn avx512_vnni<M: Rows, K: RowKernel<M>>(
    _: Avx512,
    m: &M,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the CPU has `K`'s target features, by this function's contract.
    unsafe { drive::<M, K>(m, act, rows, out) }
}
