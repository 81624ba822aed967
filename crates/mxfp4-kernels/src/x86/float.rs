//! F16 and F32 matrices in the AVX-512 tiers. One kernel shape serves both formats and both
//! activation layouts, and it is the exact BF16 kernel's: per block of 32 columns the weights
//! are split into even and odd columns (F32 by `vpermt2ps`, F16 by `vpmovdw` then the exact
//! `vcvtph2ps`), and each (row, token) accumulator takes `fma(even, x_even)` then
//! `fma(odd, x_odd)`, reduced by `store_sums`. So a matrix of BF16 values widened to F32 gives
//! the BF16 kernel's bits, and batch invariance holds for the same reason as there.
//!
//! Exact tier: activations are `perm32` (f32). Approximate tiers: activations are the BF16
//! rounding the tier uses for BF16 matrices (`bf16_natural`, widened exactly by the same shift
//! and mask as BF16 weights), weights stay exact and products are f32 FMAs: `vdpbf16ps` cannot
//! take F16 or F32 weights without rounding them.

use core::arch::x86_64::*;

use super::driver::{Avx512Gemm, Bf16Gemv, RowKernel, Tile, width};
use super::lanes::{F32_EVEN_IDX, F32_ODD_IDX, HALF_BITS, HIGH_HALF, block_offset, f32_tail_masks};
use super::loads::load_bytes64;
use super::prefetch::bf16_prefetch_offset;
use super::sums::store_sums;
use crate::activations::Activations;
use crate::view::{F16Matrix, F32Matrix};

/// The F16 and F32 row kernel, on f32 activations or (`BF16_ACT`) on the approximate tiers'
/// BF16 ones; the BF16 kernels' plans, so the same row blocks for the same shapes.
pub(crate) struct Float<const BF16_ACT: bool>;

/// `Float`'s kernel for one format of `$elem`-byte values.
macro_rules! float_kernel {
    ($matrix:ident, $elem:literal) => {
        impl<const BF16_ACT: bool> RowKernel<$matrix<'_>> for Float<BF16_ACT> {
            type Gemv = Bf16Gemv;
            type Gemm = Avx512Gemm;

            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            #[inline]
            unsafe fn block<const R: usize, const T: usize, const C: usize>(
                m: &$matrix<'_>,
                act: &Activations,
                tile: Tile,
                out: &mut [f32],
            ) {
                float_block::<R, T, C, $elem, BF16_ACT>(
                    (m.bytes(), m.rows(), m.cols()),
                    act,
                    tile,
                    out,
                );
            }
        }
    };
}
float_kernel!(F32Matrix, 4);
float_kernel!(F16Matrix, 2);

/// Rows `row0..row0+R` for tokens `tok0..tok0+T` of a matrix of `ELEM`-byte floats (4: F32,
/// 2: F16); activations f32 (`perm32`) or BF16 (`bf16_natural`, `BF16_ACT`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
#[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
fn float_block<
    const R: usize,
    const T: usize,
    const C: usize,
    const ELEM: usize,
    const BF16_ACT: bool,
>(
    (bytes, rows, cols): (&[u8], usize, usize),
    act: &Activations,
    tile: Tile,
    out: &mut [f32],
) {
    let Tile { tok0, row0, .. } = tile;
    let stride = act.padded();
    let x_len = if BF16_ACT {
        act.bf16_natural.len()
    } else {
        act.perm32.len()
    };
    assert!(row0 + R <= rows && x_len >= (tok0 + T) * stride);
    let cols = width::<C>(cols);
    assert!(bytes.len() >= (row0 + R) * cols * ELEM);
    let base = bytes[row0 * cols * ELEM..].as_ptr();
    let high_half = _mm512_set1_epi32(HIGH_HALF as i32);
    // SAFETY: both index tables are 16 i32 (64 bytes).
    let (even_idx, odd_idx) = unsafe {
        (
            _mm512_loadu_si512(F32_EVEN_IDX.as_ptr().cast()),
            _mm512_loadu_si512(F32_ODD_IDX.as_ptr().cast()),
        )
    };
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let blocks = cols.div_ceil(32);
    for block in 0..blocks {
        let valid = (cols - 32 * block).min(32);
        let mut even = [_mm512_setzero_ps(); T];
        let mut odd = [_mm512_setzero_ps(); T];
        for t in 0..T {
            let at = (tok0 + t) * stride + 32 * block;
            if BF16_ACT {
                // SAFETY: 32 * block + 32 <= stride (cols padded to 128): 32 u16 inside
                // `bf16_natural` (length asserted above).
                let v = unsafe { _mm512_loadu_si512(act.bf16_natural.as_ptr().add(at).cast()) };
                even[t] = _mm512_castsi512_ps(_mm512_slli_epi32::<HALF_BITS>(v));
                odd[t] = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
            } else {
                // SAFETY: as above, 32 f32 inside `perm32`.
                unsafe {
                    even[t] = _mm512_loadu_ps(act.perm32.as_ptr().add(at));
                    odd[t] = _mm512_loadu_ps(act.perm32.as_ptr().add(at + 16));
                }
            }
        }
        let ahead = bf16_prefetch_offset(R, cols, block) * ELEM;
        for r in 0..R {
            let at = base.wrapping_add(block_offset(r, cols, block, ELEM));
            // Prefetch hint only: it never faults, so an address past the matrix is harmless.
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
            // SAFETY: `valid` values of row row0 + r are left from `at` (asserted above).
            let (w_even, w_odd) = unsafe {
                if ELEM == 4 {
                    load_f32_split(at, valid, even_idx, odd_idx)
                } else {
                    load_f16_split(at, valid)
                }
            };
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(w_even, even[t], acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(w_odd, odd[t], acc[r][t]);
            }
        }
    }
    store_sums(&acc, tile, out);
}

/// Up to 32 f32 from `at` (the rest zero), split into even and odd columns.
///
/// # Safety
/// `min(valid, 32)` f32 from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn load_f32_split(
    at: *const u8,
    valid: usize,
    even_idx: __m512i,
    odd_idx: __m512i,
) -> (__m512, __m512) {
    let (low, high) = if valid >= 32 {
        // SAFETY: 32 readable f32, by the caller.
        unsafe {
            (
                _mm512_loadu_ps(at.cast()),
                _mm512_loadu_ps(at.add(64).cast()),
            )
        }
    } else {
        let (low_mask, high_mask) = f32_tail_masks(valid);
        // SAFETY: the masks limit the loads to the `valid` readable values; masked-off lanes
        // are not accessed (no fault), so the second address may lie past them.
        unsafe {
            (
                _mm512_maskz_loadu_ps(low_mask, at.cast()),
                _mm512_maskz_loadu_ps(high_mask, at.wrapping_add(64).cast()),
            )
        }
    };
    (
        _mm512_permutex2var_ps(low, even_idx, high),
        _mm512_permutex2var_ps(low, odd_idx, high),
    )
}

/// Up to 32 F16 from `at` (the rest zero), widened exactly and split into even and odd columns:
/// dword lane j holds columns 2j (low half) and 2j+1 (high half).
///
/// # Safety
/// `min(valid, 32)` F16 from `at` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn load_f16_split(at: *const u8, valid: usize) -> (__m512, __m512) {
    // SAFETY: `2 * valid` readable bytes, by the caller (whole 64-byte loads when valid = 32).
    let v = unsafe { load_bytes64(at, 2 * valid) };
    (
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<HALF_BITS>(v))),
    )
}
