//! The exact `avx512` tier: weights decoded exactly to f32, activations f32, f32 FMA. Differs
//! from scalar only in summation order (16 lanes, then a fixed horizontal tree).
//!
//! MXFP4 decode: 16 packed bytes (one group) are zero-extended to 16 dword lanes; `vpermps`
//! reads only bits 3..0 of each index, so the lanes themselves index the low nibbles and the
//! lanes shifted right by 4 index the high nibbles, into a 16-entry E2M1 table pre-multiplied
//! by the group's scale (E2M1 x 2^k is exact in f32). Low nibbles are the even columns, so the
//! activations are laid out per group as [even 16, odd 16] (see `Activations::perm32`).

use core::arch::x86_64::*;
use std::ops::Range;

use super::driver::{Avx512Gemm, Bf16Gemv, MxFp4Gemv, RowKernel, Tile, width};
use super::lanes::{HALF_BITS, HIGH_HALF, INTERLEAVE_FIRST, INTERLEAVE_SECOND, block_offset};
use super::loads::load_bytes64;
use super::prefetch::{bf16_prefetch_offset, prefetch_distance, prefetch_step, prefetch_step_l2};
use super::sums::store_sums;
use crate::activations::Activations;
use crate::codes::{E2M1_VALUES, E8M0_TO_F32};
use crate::isa::Avx512;
use crate::view::{Bf16Matrix, GROUP, GROUP_BYTES, MxFp4Matrix};

/// # Safety
/// The CPU must have avx512f, avx512bw and avx512vl (the token says it has); `rows` must lie
/// inside `matrix` and `out` hold `rows.len() * cols` f32 (checked by `Kernels`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn dequant_mxfp4(
    _: Avx512,
    matrix: &MxFp4Matrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let table = e2m1_table();
    // Interleave low (even column) and high (odd column) lanes back into column order.
    // SAFETY: both index tables are 16 i32 (64 bytes).
    let (first, second) = unsafe {
        (
            _mm512_loadu_si512(INTERLEAVE_FIRST.as_ptr().cast()),
            _mm512_loadu_si512(INTERLEAVE_SECOND.as_ptr().cast()),
        )
    };
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let packed = matrix.packed_row(row).chunks_exact(GROUP_BYTES);
        for ((codes, &scale), dst) in packed
            .zip(matrix.scale_row(row))
            .zip(out_row.chunks_exact_mut(GROUP))
        {
            // SAFETY: `codes` is exactly 16 readable bytes.
            let v = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(codes.as_ptr().cast()) });
            let scaled = _mm512_mul_ps(table, _mm512_set1_ps(E8M0_TO_F32[scale as usize]));
            let low = _mm512_permutexvar_ps(v, scaled);
            let high = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), scaled);
            // SAFETY: `dst` is exactly 32 writable f32.
            unsafe {
                _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_permutex2var_ps(low, first, high));
                _mm512_storeu_ps(
                    dst.as_mut_ptr().add(16),
                    _mm512_permutex2var_ps(low, second, high),
                );
            }
        }
    }
}

/// The MXFP4 row kernel: per group, 16 code bytes decoded by `vpermps` into the scaled table.
pub(crate) struct Mxfp4;

impl RowKernel<MxFp4Matrix<'_>> for Mxfp4 {
    type Gemv = MxFp4Gemv;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
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
        let x = tile.tokens::<T, _>(&act.perm32, stride);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let ahead = prefetch_distance(R * row_bytes);
        for g in 0..groups {
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            for t in 0..T {
                // SAFETY: t < T and 32g + 32 <= cols <= stride, so both loads lie in the tile's
                // tokens of `perm32` (`Tile::tokens`).
                unsafe {
                    even[t] = _mm512_loadu_ps(x.add(t * stride + GROUP * g));
                    odd[t] = _mm512_loadu_ps(x.add(t * stride + GROUP * g + 16));
                }
            }
            prefetch_step(packed, ahead, g, R * GROUP_BYTES);
            prefetch_step_l2(packed, ahead, g, R * GROUP_BYTES);
            for r in 0..R {
                // SAFETY: r < R, a row of the tile (`Tile::mxfp4_rows`); the group's 16 bytes
                // lie in that row.
                let v = _mm512_cvtepu8_epi32(unsafe {
                    _mm_loadu_si128(packed.add(r * row_bytes + GROUP_BYTES * g).cast())
                });
                // SAFETY: r < R and g < groups index the tile's R x groups scale bytes.
                let scaled = scaled_table(unsafe { *scales.add(r * groups + g) });
                let low = _mm512_permutexvar_ps(v, scaled);
                let high = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), scaled);
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(low, even[t], acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(high, odd[t], acc[r][t]);
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}

/// BF16 rows: 64 bytes hold 32 values; dword lane j has column 2j in its low half and 2j+1 in
/// its high half, so `<< 16` gives the even columns as f32 and masking the low half the odd
/// ones — exact widening in two instructions, paired with the same [even, odd] activations.
///
/// Memory: a GEMV streams `R` rows at once (16 for one token), 64 bytes of each in turn, while
/// each row prefetches ahead of itself and, near its end, into the next row block
/// (`bf16_prefetch_offset`).
pub(crate) struct Bf16;

impl RowKernel<Bf16Matrix<'_>> for Bf16 {
    type Gemv = Bf16Gemv;
    type Gemm = Avx512Gemm;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
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
        let base = m.bytes()[row0 * cols * 2..].as_ptr();
        let x = tile.tokens::<T, _>(&act.perm32, stride);
        let high_half = _mm512_set1_epi32(HIGH_HALF as i32);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let blocks = cols.div_ceil(32);
        for block in 0..blocks {
            let valid = (cols - 32 * block).min(32);
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            for t in 0..T {
                // SAFETY: 32 * block + 32 <= stride (cols padded to 128), inside `perm32`.
                unsafe {
                    even[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block));
                    odd[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block + 16));
                }
            }
            let ahead = bf16_prefetch_offset(R, cols, block) * 2;
            for r in 0..R {
                let at = base.wrapping_add(block_offset(r, cols, block, 2));
                // Prefetch hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead).cast());
                // One load, a shift and an AND. (A second, masked load of the line in place of
                // the AND saved an instruction on paper, but the compiler set its mask register
                // from a general one for every row: on Zen 4 that made the in-cache GEMV 1.37x
                // slower, 28 against 39 G weights/s, PERFORMANCE.md phase 29.)
                // SAFETY: `valid` values are left in row row0 + r from `at` (whole 64-byte
                // loads when `valid` is 32).
                let v = unsafe { load_bytes64(at, 2 * valid) };
                let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<HALF_BITS>(v));
                let w_odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(w_even, even[t], acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(w_odd, odd[t], acc[r][t]);
                }
            }
        }
        store_sums(&acc, tile, out);
    }
}

/// The 16 E2M1 values as one vector.
#[target_feature(enable = "avx512f")]
#[inline]
fn e2m1_table() -> __m512 {
    // SAFETY: E2M1_VALUES is 16 f32.
    unsafe { _mm512_loadu_ps(E2M1_VALUES.as_ptr()) }
}

/// `SCALED_TABLES` as the two high bytes of each f32, for `pshufb`: per scale byte, the 16
/// codes' byte 2, then their byte 3. Every entry's two low bytes are zero (E2M1 has one
/// mantissa bit, and a power of two times it is a BF16 value down to 2^-128 and up to
/// infinity or NaN); the initialiser checks that, so the table is exact.
pub(crate) static SCALED_BF16_BYTES: [[u8; 32]; 256] = {
    let mut tables = [[0u8; 32]; 256];
    let mut s = 0;
    while s < 256 {
        let mut code = 0;
        while code < 16 {
            let bits = (E2M1_VALUES[code] * E8M0_TO_F32_CONST[s]).to_bits();
            assert!(
                bits & 0xFFFF == 0,
                "a scaled E2M1 value is not a BF16 value"
            );
            tables[s][code] = (bits >> 16) as u8;
            tables[s][16 + code] = (bits >> 24) as u8;
            code += 1;
        }
        s += 1;
    }
    tables
};

/// E2M1 x 2^(s-127) for every scale byte s: 256 tables of 16 f32 (16 KiB), each product exact,
/// so a row's group decode loads its table instead of multiplying (one vector op fewer per 32
/// weights; a decode uses only the few tables of the scales present).
pub(crate) static SCALED_TABLES: [[f32; 16]; 256] = {
    let mut tables = [[0.0f32; 16]; 256];
    let mut s = 0;
    while s < 256 {
        let mut code = 0;
        while code < 16 {
            tables[s][code] = E2M1_VALUES[code] * E8M0_TO_F32_CONST[s];
            code += 1;
        }
        s += 1;
    }
    tables
};

/// `E8M0_TO_F32` as a const (statics cannot be read in const initialisers).
const E8M0_TO_F32_CONST: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        table[s] = crate::codes::e8m0_to_f32(s as u8);
        s += 1;
    }
    table
};

/// The E2M1 table scaled by the E8M0 byte `s`.
#[target_feature(enable = "avx512f")]
#[inline]
fn scaled_table(s: u8) -> __m512 {
    // SAFETY: each table is 16 f32.
    unsafe { _mm512_loadu_ps(SCALED_TABLES[s as usize].as_ptr()) }
}
