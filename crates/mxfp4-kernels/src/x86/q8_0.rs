//! Q8_0 matrices in the exact `avx512` tier (and, with its bits, both approximate tiers: their
//! activations would round, and Q8_0 weights need no BF16 or int8 path to be fast).
//!
//! Activations are read as given (`Activations::raw`, column order): a Q8_0 row has whole
//! blocks of 32, so no padding is needed. Per block, lane `l` of an accumulator takes columns
//! `32b + l` and `32b + 16 + l`.
//!
//! The sum order (shared with the `avx2` tier, which runs it on two 8-lane halves): see
//! [`Q8_0`].

use core::arch::x86_64::*;
use std::ops::Range;

use super::driver::{Avx512Gemm, Q8_0Gemv, RowKernel, Tile, width};
use super::prefetch::bf16_prefetch_offset;
use super::sums::store_sums;
use crate::activations::Activations;
use crate::codes::{Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
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
            let [low, high] = unsafe { decode(block.as_ptr()) };
            // SAFETY: `dst` is exactly 32 writable f32.
            unsafe {
                _mm512_storeu_ps(dst.as_mut_ptr(), low);
                _mm512_storeu_ps(dst.as_mut_ptr().add(16), high);
            }
        }
    }
}

/// The Q8_0 row kernel. The sum order, per (row, token) and lane `l` of a 16-lane accumulator
/// `acc`, block by block (`w = q · d`, exact):
/// `acc = fma(w[32b + l], x[32b + l], acc)`, then `acc = fma(w[32b + 16 + l], x[32b + 16 + l],
/// acc)`; at the end the lanes are added in `sums::hsum`'s tree. That is the BF16 kernel's
/// chain with the two halves of a block in column order instead of even/odd, and the weight
/// exactly decoded, so the result is within `dot_bound` of scalar for the same reason.
pub(crate) struct Q8_0<const FOLD: bool>;

impl<const FOLD: bool> RowKernel<Q8_0Matrix<'_>> for Q8_0<FOLD> {
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
            let ahead = bf16_prefetch_offset(R, cols, b) / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
            for r in 0..R {
                let at = base.wrapping_add(r * stride + b * Q8_0_BLOCK_BYTES);
                // Prefetch hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
                if FOLD {
                    // SAFETY: block b of row row0 + r, 34 bytes inside the slice above.
                    let (d, [q_low, q_high]) = unsafe { (step(at), values(at)) };
                    for t in 0..T {
                        let p = _mm512_mul_ps(q_low, low[t]);
                        let p = _mm512_fmadd_ps(q_high, high[t], p);
                        acc[r][t] = _mm512_fmadd_ps(p, d, acc[r][t]);
                    }
                } else {
                    // SAFETY: block b of row row0 + r, 34 bytes inside the slice above.
                    let [w_low, w_high] = unsafe { decode(at) };
                    for t in 0..T {
                        acc[r][t] = _mm512_fmadd_ps(w_low, low[t], acc[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(w_high, high[t], acc[r][t]);
                    }
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}

/// One block's weights, exactly: columns 0..15 and 16..31 as `q · d`.
///
/// # Safety
/// 34 bytes from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn decode(at: *const u8) -> [__m512; 2] {
    // SAFETY: by the caller.
    let (d, [low, high]) = unsafe { (step(at), values(at)) };
    [_mm512_mul_ps(low, d), _mm512_mul_ps(high, d)]
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

/// A block's F16 step, widened exactly (`vcvtph2ps`) into every lane.
///
/// # Safety
/// 2 bytes from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn step(at: *const u8) -> __m512 {
    // SAFETY: 2 readable bytes, by the caller (unaligned read).
    let bits = unsafe { at.cast::<u16>().read_unaligned() };
    _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
}
