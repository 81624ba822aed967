//! The approximate `avx512-bf16` tier: activations rounded to BF16 (round to nearest even),
//! products by `vdpbf16ps` (BF16 x BF16 products are exact in f32; the instruction sums pairs
//! and flushes subnormals). E2M1 and BF16 weights are exact in BF16, so the only approximation
//! is the activation rounding (relative 2^-9 per element) plus the instruction's own rounding.
//!
//! MXFP4: 32 packed bytes (two groups A, B) are zero-extended to 32 words; `vpermw` reads bits
//! 4..0 of each index, so a 32-entry table (E2M1 twice) decodes the low nibbles directly and
//! the words shifted right by 4 give the high nibbles. The pair products land in dword lanes
//! 0..7 (group A) and 8..15 (group B); each lane is then scaled by its group's exact scale.

use core::arch::x86_64::*;

use super::driver::{Avx512Gemm, Bf16Gemv, MxFp4Gemv, RowKernel, Tile, width};
use super::loads::{group_lanes, load_bytes32, load_bytes64, scales16};
use super::prefetch::{bf16_prefetch_offset, prefetch_ahead};
use super::sums::store_sums;
use crate::activations::Activations;
use crate::codes::E2M1_VALUES;
use crate::view::{Bf16Matrix, MxFp4Matrix};

/// E2M1 as BF16 bit patterns, repeated so a 5-bit `vpermw` index needs no masking.
static E2M1_BF16_X2: [u16; 32] = {
    let mut table = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        // E2M1 values have at most 2 significant bits: their f32 low halves are zero.
        table[i] = (E2M1_VALUES[i % 16].to_bits() >> 16) as u16;
        i += 1;
    }
    table
};

/// Lane patterns selecting the scales of groups (2p, 2p+1) out of 16: lanes 0..7, 8..15.
static PAIR_LANES: [[i32; 16]; 8] = group_lanes::<8>(8);

/// `__m512i` as the BF16 pairs `vdpbf16ps` takes (also the packed rows' `dot` kernels).
#[inline]
pub(super) fn as_bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain vector types; every bit pattern is valid for each.
    unsafe { core::mem::transmute::<__m512i, __m512bh>(v) }
}

/// The MXFP4 row kernel: two groups per step, decoded by `vpermw` to BF16, `vdpbf16ps`.
pub(crate) struct Mxfp4;

impl RowKernel<MxFp4Matrix<'_>> for Mxfp4 {
    type Gemv = MxFp4Gemv;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &MxFp4Matrix<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        let rows = tile.mxfp4_rows::<R, C>(m);
        let (groups, row_bytes, packed) = (rows.groups, rows.row_bytes, rows.packed);
        let scales = rows.scales.as_ptr();
        let stride = act.padded();
        let x = tile.tokens::<T, _>(&act.bf16_mx, stride);
        // SAFETY: the table is 32 u16 = 64 bytes.
        let table = unsafe { _mm512_loadu_si512(E2M1_BF16_X2.as_ptr().cast()) };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut row_scales = [_mm512_setzero_ps(); R];
        let pairs = groups.div_ceil(2);
        for pair in 0..pairs {
            let g = 2 * pair;
            if g % 16 == 0 {
                for (r, s) in row_scales.iter_mut().enumerate() {
                    // SAFETY: reads min(16, groups - g) scale bytes of the tile's row r.
                    *s = unsafe { scales16(scales.add(r * groups + g), (groups - g).min(16)) };
                }
            }
            // SAFETY: PAIR_LANES rows are 16 i32.
            let lanes = unsafe { _mm512_loadu_si512(PAIR_LANES[(g % 16) / 2].as_ptr().cast()) };
            let code_bytes = 16 * (groups - g).min(2);
            let mut x_low = [_mm512_setzero_si512(); T];
            let mut x_high = [_mm512_setzero_si512(); T];
            for t in 0..T {
                // SAFETY: 32g + 64 <= stride (padded to 128 columns), inside `bf16_mx`.
                unsafe {
                    x_low[t] = _mm512_loadu_si512(x.add(t * stride + 32 * g).cast());
                    x_high[t] = _mm512_loadu_si512(x.add(t * stride + 32 * g + 32).cast());
                }
            }
            prefetch_ahead(packed, R * row_bytes, pair, pairs);
            for r in 0..R {
                let at = packed.wrapping_add(r * row_bytes + 16 * g);
                // SAFETY: `code_bytes` bytes of the groups left in the tile's row r are readable.
                let bytes = unsafe { load_bytes32(at, code_bytes) };
                let words = _mm512_cvtepu8_epi16(bytes);
                let w_low = _mm512_permutexvar_epi16(words, table);
                let w_high = _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), table);
                let scale = _mm512_permutexvar_ps(lanes, row_scales[r]);
                for t in 0..T {
                    let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(w_low), as_bh(x_low[t]));
                    let dot = _mm512_dpbf16_ps(dot, as_bh(w_high), as_bh(x_high[t]));
                    acc[r][t] = _mm512_fmadd_ps(dot, scale, acc[r][t]);
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}

/// BF16 rows: 32 weights and 32 BF16 activations in column order, one `vdpbf16ps`.
pub(crate) struct Bf16;

impl RowKernel<Bf16Matrix<'_>> for Bf16 {
    type Gemv = Bf16Gemv;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &Bf16Matrix<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        let row0 = tile.row0;
        assert!(row0 + R <= m.rows());
        let cols = width::<C>(m.cols());
        let stride = act.padded();
        let base = m.bytes()[row0 * cols * 2..].as_ptr().cast::<u16>();
        let x = tile.tokens::<T, _>(&act.bf16_natural, stride);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let blocks = cols.div_ceil(32);
        for block in 0..blocks {
            let valid = (cols - 32 * block).min(32);
            let mut xs = [_mm512_setzero_si512(); T];
            for (t, xt) in xs.iter_mut().enumerate() {
                // SAFETY: 32 * block + 32 <= stride, inside `bf16_natural`.
                *xt = unsafe { _mm512_loadu_si512(x.add(t * stride + 32 * block).cast()) };
            }
            let ahead = bf16_prefetch_offset(R, cols, block);
            for r in 0..R {
                let at = base.wrapping_add(r * cols + 32 * block);
                // Prefetch hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
                // SAFETY: `valid` values are left in row row0 + r from `at`.
                let w = unsafe { load_bytes64(at.cast(), 2 * valid) };
                for t in 0..T {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(w), as_bh(xs[t]));
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}
