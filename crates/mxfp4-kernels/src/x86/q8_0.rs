//! Q8_0 matrices in the exact `avx512` tier (and, with its bits, both approximate tiers:
//! their activation roundings buy nothing here, as no BF16 or int8 product takes Q8_0
//! weights without rounding them).
//!
//! Activations are read as given (`Activations::raw`, column order): a Q8_0 row has whole
//! blocks of 32, so no padding is needed. A block's step is looked up in
//! `codes::F16_TO_F32` (exact) and broadcast from memory by the FMA that applies it.
//!
//! The sum order, per (row, token) and lane `l` of a 16-lane accumulator `acc`, block `b` by
//! block, with `q` the int8 values widened exactly and `d` the block's step:
//!
//! ```text
//! p   = q[32b + l] · x[32b + l]                    (rounded)
//! p   = fma(q[32b + 16 + l], x[32b + 16 + l], p)
//! acc = fma(p, d, acc)
//! ```
//!
//! then the lanes added in `sums::hsum`'s tree. The `avx2` tier runs the same order on two
//! 8-lane halves (`x86::avx2::q8_0`), so the two give the same bits. Each term is within
//! `dot_bound` of the scalar oracle: its product `q · x · d` is rounded at most twice (`p`,
//! then the FMA by `d`) before the chain, fewer roundings than the bound allows per term.
//!
//! Why this order: folding the step in once per block, rather than decoding each weight to
//! `q · d` first (the BF16 kernel's chain on exact weights), takes one multiply per 32 weights
//! and token instead of two, and the table lookup saves the per-row `vpbroadcastw` +
//! `vcvtph2ps`. 1024x7168 in cache, 1 thread, Zen 4, paired runs on a busy host: 14-15
//! Gweights/s decoding each weight first, 14.5-16.6 folding the step, 18.4-20.5 folding it
//! with the table step. A GEMM of 16 tokens runs about 15% slower folded (the multiply is per
//! token, the decode shared), a price paid for the decode GEMV.

use core::arch::x86_64::*;
use std::ops::Range;

use super::driver::{Avx512Gemm, Q8_0Gemv, RowKernel, Tile, width};
use super::prefetch::bf16_prefetch_offset;
use super::sums::store_sums;
use crate::activations::Activations;
use crate::codes::{F16_TO_F32, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
use crate::isa::Avx512;
use crate::view::Q8_0Matrix;

/// # Safety
/// The CPU must have avx512f, avx512bw and avx512vl (the token says it has); `rows` must lie
/// inside `matrix` and `out` hold `rows.len() * cols` f32 (checked by `Kernels`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn dequant_q8_0(
    _: Avx512,
    matrix: &Q8_0Matrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let blocks = matrix.row_bytes(row).chunks_exact(Q8_0_BLOCK_BYTES);
        for (block, dst) in blocks.zip(out_row.chunks_exact_mut(Q8_0_BLOCK)) {
            // SAFETY: `block` is exactly 34 readable bytes.
            let (d, [low, high]) = unsafe { (step(block.as_ptr()), values(block.as_ptr())) };
            // `q · d` is exact: the scalar decode's bits.
            // SAFETY: `dst` is exactly 32 writable f32.
            unsafe {
                _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_mul_ps(low, d));
                _mm512_storeu_ps(dst.as_mut_ptr().add(16), _mm512_mul_ps(high, d));
            }
        }
    }
}

/// The Q8_0 row kernel, in the module's sum order. Per 32 weights and row: two `vpmovsxbd`
/// and two `vcvtdq2ps` (the values), one multiply and two FMAs per token (the step's with its
/// broadcast load), and one prefetch (per row, as the BF16 kernel: a GEMV's 16 rows are 16
/// streams).
pub(crate) struct Q8_0;

impl RowKernel<Q8_0Matrix<'_>> for Q8_0 {
    type Gemv = Q8_0Gemv;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &Q8_0Matrix<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        let row0 = tile.row0;
        assert!(row0 + R <= m.rows());
        let cols = width::<C>(m.cols());
        let blocks = cols / Q8_0_BLOCK;
        let stride = blocks * Q8_0_BLOCK_BYTES;
        let base = m.bytes()[row0 * stride..(row0 + R) * stride].as_ptr();
        let x = tile.tokens::<T, _>(&act.raw, cols);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..blocks {
            let mut low = [_mm512_setzero_ps(); T];
            let mut high = [_mm512_setzero_ps(); T];
            for t in 0..T {
                // SAFETY: t < T and 32b + 32 <= cols: inside the tile's tokens of `raw`
                // (`Tile::tokens`, stride `cols`).
                unsafe {
                    low[t] = _mm512_loadu_ps(x.add(t * cols + Q8_0_BLOCK * b));
                    high[t] = _mm512_loadu_ps(x.add(t * cols + Q8_0_BLOCK * b + 16));
                }
            }
            // The BF16 kernel's per-row distance (in values), in Q8_0 bytes: whole blocks.
            let ahead = bf16_prefetch_offset(R, cols, b) / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
            for r in 0..R {
                let at = base.wrapping_add(r * stride + b * Q8_0_BLOCK_BYTES);
                // Prefetch hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
                // SAFETY: block b of row row0 + r: 34 bytes inside the slice taken above.
                let (d, [q_low, q_high]) = unsafe { (step(at), values(at)) };
                for t in 0..T {
                    let p = _mm512_mul_ps(q_low, low[t]);
                    let p = _mm512_fmadd_ps(q_high, high[t], p);
                    acc[r][t] = _mm512_fmadd_ps(p, d, acc[r][t]);
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}

/// A block's 32 int8 values as f32 (exact): columns 0..15, 16..31.
///
/// # Safety
/// 34 bytes from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn values(at: *const u8) -> [__m512; 2] {
    // SAFETY: bytes 2..18 and 18..34 of the block, by the caller.
    unsafe {
        [
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at.add(2).cast()))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at.add(18).cast()))),
        ]
    }
}

/// A block's F16 step, exactly (`F16_TO_F32`), in every lane: a broadcast load, which the
/// compiler folds into the FMA that uses it.
///
/// # Safety
/// 2 bytes from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn step(at: *const u8) -> __m512 {
    // SAFETY: 2 readable bytes, by the caller (unaligned read).
    let bits = unsafe { at.cast::<u16>().read_unaligned() };
    _mm512_set1_ps(F16_TO_F32[usize::from(bits)])
}
