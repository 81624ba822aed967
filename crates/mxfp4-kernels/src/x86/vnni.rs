//! The approximate `avx512-vnni` tier for MXFP4: activations quantised to int8 per 32-group
//! (`q = round(x / d)`, `d = max|x| / 127`), E2M1 codes as exact doubled integers, `vpdpbusd`.
//!
//! Zen 4 has only the unsigned x signed form, so the doubled codes {0, ±1, .., ±12} are stored
//! offset by +12 (0..24, unsigned) and `-12 * Σq` per lane (precomputed with the activations)
//! is the dot product's starting value. One 64-byte load holds four groups; `vpermb` reads
//! bits 5..0 of each byte, so a 64-entry table (the 16 codes four times) decodes the low
//! nibbles with no masking, and the bytes shifted right by 4 give the high nibbles. Dword lane
//! `l` then holds group `l / 4`; it is converted to f32 and scaled by `2^(s-128) * d`.

use core::arch::x86_64::*;

use super::driver::{Avx512Gemm, Gemv, RowKernel, Tile};
use super::loads::{group_lanes, load_bytes64, scales16};
use super::prefetch::prefetch_ahead;
use super::sums::store_sums;
use crate::activations::Activations;
use crate::codes::E2M1_DOUBLED;
use crate::view::MxFp4Matrix;

/// Offset doubled E2M1 codes (`2 * E2M1 + 12`), four times over for a 6-bit `vpermb` index.
static CODES_U8_X4: [u8; 64] = {
    let mut table = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        table[i] = (E2M1_DOUBLED[i % 16] + 12) as u8;
        i += 1;
    }
    table
};

/// Lane patterns selecting the scales of groups 4q..4q+3 out of 16 (four lanes each).
static QUAD_LANES: [[i32; 16]; 4] = group_lanes::<4>(4);

/// The MXFP4 row kernel: four groups per step, `vpermb` to offset int8 codes, `vpdpbusd`.
/// GEMVs stream 3 rows.
pub(crate) struct Mxfp4;

impl RowKernel<MxFp4Matrix<'_>> for Mxfp4 {
    type Gemv = Gemv<3>;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    #[inline]
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
        let blocks_per_token = stride / 128;
        let q8 = tile.tokens::<T, _>(&act.q8, stride);
        let correction = tile.tokens::<T, _>(&act.q8_correction, blocks_per_token * 16);
        let step = tile.tokens::<T, _>(&act.q8_step, blocks_per_token * 16);
        // SAFETY: the table is 64 bytes.
        let table = unsafe { _mm512_loadu_si512(CODES_U8_X4.as_ptr().cast()) };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut row_scales = [_mm512_setzero_ps(); R];
        let blocks = groups.div_ceil(4);
        for block in 0..blocks {
            let g = 4 * block;
            if g % 16 == 0 {
                for (r, s) in row_scales.iter_mut().enumerate() {
                    // SAFETY: reads min(16, groups - g) scale bytes of the tile's row r.
                    let scale =
                        unsafe { scales16(scales.add(r * groups + g), (groups - g).min(16)) };
                    // 2^(s-127) / 2 undoes the doubled codes; exact (a power of two).
                    *s = _mm512_mul_ps(scale, _mm512_set1_ps(0.5));
                }
            }
            // SAFETY: QUAD_LANES rows are 16 i32.
            let lanes = unsafe { _mm512_loadu_si512(QUAD_LANES[(g % 16) / 4].as_ptr().cast()) };
            let code_bytes = 16 * (groups - g).min(4);
            let mut x_low = [_mm512_setzero_si512(); T];
            let mut x_high = [_mm512_setzero_si512(); T];
            let mut start = [_mm512_setzero_si512(); T];
            let mut x_step = [_mm512_setzero_ps(); T];
            for t in 0..T {
                let at = t * blocks_per_token + block;
                // SAFETY: t < T and block < blocks_per_token, so every load lies in the tile's
                // tokens (`Tile::tokens`).
                unsafe {
                    x_low[t] = _mm512_loadu_si512(q8.add(128 * at).cast());
                    x_high[t] = _mm512_loadu_si512(q8.add(128 * at + 64).cast());
                    start[t] = _mm512_loadu_si512(correction.add(16 * at).cast());
                    x_step[t] = _mm512_loadu_ps(step.add(16 * at));
                }
            }
            prefetch_ahead(packed, R * row_bytes, block, blocks);
            for r in 0..R {
                let at = packed.wrapping_add(r * row_bytes + 16 * g);
                // SAFETY: `code_bytes` bytes of the groups left in the tile's row r are readable.
                let v = unsafe { load_bytes64(at, code_bytes) };
                let w_low = _mm512_permutexvar_epi8(v, table);
                let w_high = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v), table);
                let w_scale = _mm512_permutexvar_ps(lanes, row_scales[r]);
                for t in 0..T {
                    let dot = _mm512_dpbusd_epi32(start[t], w_low, x_low[t]);
                    let dot = _mm512_dpbusd_epi32(dot, w_high, x_high[t]);
                    let scale = _mm512_mul_ps(w_scale, x_step[t]);
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][t]);
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}
