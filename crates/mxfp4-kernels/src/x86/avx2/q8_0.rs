//! Q8_0 matrices in the `avx2` tier: `x86::q8_0::Q8_0::block` on two 8-lane halves. Per block
//! of 32 columns, half `h` of the `avx512` accumulator (its lanes `8h..8h + 8`) takes columns
//! `32b + 8h + j` and `32b + 16 + 8h + j`, the values `avx512` puts in those lanes, through the
//! same operations (`x86::q8_0`'s sum order: the block's products, then one FMA by its step),
//! so every lane ends with the same bits and `acc::hsum` adds them in `sums::hsum`'s tree: the
//! result is `avx512`'s bit for bit.

use core::arch::x86_64::*;
use std::ops::Range;

use super::acc::{Acc, act_block, store_sums};
use crate::activations::Activations;
use crate::codes::{F16_TO_F32, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
use crate::isa::Avx2;
use crate::view::Q8_0Matrix;
use crate::x86::driver::{Avx2Gemm, Gemv, RowKernel, Tile, width};
use crate::x86::prefetch::bf16_prefetch_offset;

/// Dequantizes `rows` of `matrix` to f32 (bit-identical to scalar: `q · d` is exact).
///
/// # Safety
/// The CPU must have avx2, fma and f16c (the token says it has); `rows` must lie inside
/// `matrix` and `out` hold `rows.len() * cols` f32 (checked by `Kernels`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_q8_0(
    _: Avx2,
    matrix: &Q8_0Matrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let blocks = matrix.row_bytes(row).chunks_exact(Q8_0_BLOCK_BYTES);
        for (block, dst) in blocks.zip(out_row.chunks_exact_mut(Q8_0_BLOCK)) {
            // SAFETY: `block` is exactly 34 readable bytes.
            let (d, q) = unsafe { (step(block.as_ptr()), values(block.as_ptr())) };
            // `values`' order is [0..8, 8..16, 16..24, 24..32]: column order; `q · d` is exact.
            for (i, v) in q.into_iter().enumerate() {
                // SAFETY: `dst` is exactly 32 writable f32; 8i + 8 <= 32.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(8 * i), _mm256_mul_ps(v, d)) };
            }
        }
    }
}

/// The Q8_0 row kernel; GEMVs stream 4 rows (8 accumulators of the 16 registers), each row
/// prefetching ahead of itself as the `avx512` kernel does. 12288x7168 at 1 thread on the
/// Zen 4 host running this tier: 54-56% of the read probe with the per-row prefetch, 39-47%
/// with the one sequential stream `float` uses (better there for BF16 on Zen 3, not measured
/// for Q8_0 on Zen 3); in cache 73-83% against 42-52%.
pub(crate) struct Q8_0;

impl RowKernel<Q8_0Matrix<'_>> for Q8_0 {
    type Gemv = Gemv<4>;
    type Gemm = Avx2Gemm;

    #[target_feature(enable = "avx2,fma,f16c")]
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
        let mut acc: [[Acc; T]; R] = [[[_mm256_setzero_ps(); 2]; T]; R];
        for b in 0..blocks {
            let ahead = bf16_prefetch_offset(R, cols, b) / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
            for r in 0..R {
                let at = base.wrapping_add(r * stride + b * Q8_0_BLOCK_BYTES);
                // Prefetch hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
                // SAFETY: block b of row row0 + r, 34 bytes inside the slice above.
                let (d, q) = unsafe { (step(at), values(at)) };
                for t in 0..T {
                    // SAFETY: t < T and 32b + 32 <= cols: inside the tile's tokens of `raw`
                    // (`Tile::tokens`, stride `cols`).
                    let xt = unsafe { act_block(x.add(t * cols), b) };
                    // Half h: the block's products of its lanes, then the step's FMA.
                    for h in 0..2 {
                        let p = _mm256_mul_ps(q[h], xt[h]);
                        let p = _mm256_fmadd_ps(q[2 + h], xt[2 + h], p);
                        acc[r][t][h] = _mm256_fmadd_ps(p, d, acc[r][t][h]);
                    }
                }
            }
        }
        store_sums::<R, T>(&acc, tile, out);
    }
}

/// A block's 32 int8 values as f32 (exact): columns `[0..8, 8..16, 16..24, 24..32]`, which
/// are `act_block`'s `[low half 0, low half 1, high half 0, high half 1]`.
///
/// # Safety
/// 34 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values(at: *const u8) -> [__m256; 4] {
    core::array::from_fn(|i| {
        // SAFETY: bytes 2 + 8i..10 + 8i of the block, by the caller.
        let q = unsafe { _mm_loadl_epi64(at.add(2 + 8 * i).cast()) };
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
    })
}

/// A block's F16 step, exactly (`F16_TO_F32`), in every lane (`vbroadcastss` from memory).
///
/// # Safety
/// 2 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn step(at: *const u8) -> __m256 {
    // SAFETY: 2 readable bytes, by the caller (unaligned read).
    let bits = unsafe { at.cast::<u16>().read_unaligned() };
    _mm256_set1_ps(F16_TO_F32[usize::from(bits)])
}
