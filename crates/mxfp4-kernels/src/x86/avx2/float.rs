//! BF16, F16 and F32 matrices in the `avx2` tier: the `avx512` BF16/float row kernel
//! (`exact::Bf16::block`, `float::float_block`) on two 8-lane halves. Per block of 32 columns,
//! half `h` holds columns `16h..16h + 16`; its loader yields their even columns (lane `j`:
//! column `16h + 2j`) and odd columns (`16h + 2j + 1`), exactly the values `avx512`'s loader
//! puts in lanes `8h + j` of `even`/`odd`.

use core::arch::x86_64::*;

use super::acc::{act_block, fma_block, load_carry, store_carry, store_sums};
use crate::activations::Activations;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix};
use crate::x86::driver::{ChunkedGemm, Gemv, RowKernel, Tile, width};
use crate::x86::lanes::{HALF_BITS, HIGH_HALF, block_offset};
use crate::x86::prefetch::Prefetch;

/// The weight formats of this kernel, as its `FORMAT` parameter.
const BF16: u8 = 0;
const F16: u8 = 1;
const F32: u8 = 2;

/// Bytes per value of a format.
const fn elem(format: u8) -> usize {
    if format == F32 { 4 } else { 2 }
}

/// The BF16, F16 and F32 row kernel; GEMVs stream 4 rows.
pub(crate) struct Float;

/// `Float`'s kernel for matrices of `$format` values.
macro_rules! float_kernel {
    ($matrix:ident, $format:ident) => {
        impl RowKernel<$matrix<'_>> for Float {
            type Gemv = Gemv<4>;
            type Gemm = ChunkedGemm<2, 1, 1>;

            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline]
            unsafe fn block<const R: usize, const T: usize, const C: usize>(
                m: &$matrix<'_>,
                act: &Activations,
                tile: Tile,
                out: &mut [f32],
            ) {
                float_block::<R, T, C, $format>((m.bytes(), m.rows(), m.cols()), act, tile, out);
            }
        }
    };
}
float_kernel!(Bf16Matrix, BF16);
float_kernel!(F16Matrix, F16);
float_kernel!(F32Matrix, F32);

/// Rows `row0..row0+R` for tokens `tok0..tok0+T` of a matrix of `FORMAT` values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
fn float_block<const R: usize, const T: usize, const C: usize, const FORMAT: u8>(
    (bytes, rows, cols): (&[u8], usize, usize),
    act: &Activations,
    tile: Tile,
    out: &mut [f32],
) {
    let row0 = tile.row0;
    let elem = elem(FORMAT);
    let stride = act.padded();
    assert!(row0 + R <= rows);
    let cols = width::<C>(cols);
    assert!(bytes.len() >= (row0 + R) * cols * elem);
    let first = row0 * cols * elem;
    let base = bytes[first..].as_ptr();
    let x = tile.tokens::<T, _>(&act.perm32, stride);
    let whole = cols / 32;
    let blocks = cols.div_ceil(32);
    // The whole rows, or a chunk of them (`ChunkedGemm`) with the accumulators carried.
    let (from, to) = tile.blocks(blocks);
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    if let Some(part) = tile.part.filter(|_| from > 0) {
        // SAFETY: `run_chunked` gives each tile R x T accumulators of 16 f32.
        unsafe { load_carry(&mut acc, part.carry) };
    }
    let mut prefetch = Prefetch::new(R * cols * elem, whole);
    for block in from..to.min(whole) {
        match tile.part {
            // One sequential prefetch stream over the row block (as MXFP4 does): on this Zen
            // host, 163840x1024 BF16 at 1 thread read at 8-10.8 GB/s with it, 6.7-8.2 with
            // `avx512`'s per-row prefetch (`bf16_prefetch_offset`), alternating runs.
            None => prefetch.step(base, block),
            // A chunk: each row's block in the next row block (rows pass chunk by chunk).
            Some(_) => {
                for r in 0..R {
                    let at = base.wrapping_add(block_offset(r + R, cols, block, elem));
                    for line in (0..32 * elem).step_by(64) {
                        // Prefetch hint only: it never faults.
                        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast());
                    }
                }
            }
        }
        for r in 0..R {
            let at = base.wrapping_add(block_offset(r, cols, block, elem));
            // SAFETY: block < cols / 32, so 32 values of row row0 + r are left from `at`
            // (the row block lies in `bytes`, asserted above).
            let w = unsafe { split::<FORMAT>(at) };
            for t in 0..T {
                // SAFETY: t < T and 32 * block + 32 <= cols <= stride, inside the tile's
                // tokens of `perm32` (`Tile::tokens`).
                let xt = unsafe { act_block(x.add(t * stride), block) };
                fma_block(&mut acc[r][t], &w, &xt);
            }
        }
    }
    if to == blocks && whole < blocks {
        // The last, partial block: its values then zeros, as `avx512`'s masked loads give.
        let valid = cols - 32 * whole;
        let mut tail = [0u8; 128];
        for r in 0..R {
            let at = first + block_offset(r, cols, whole, elem);
            tail[..valid * elem].copy_from_slice(&bytes[at..at + valid * elem]);
            // SAFETY: `tail` holds 128 bytes, 32 values of any format.
            let w = unsafe { split::<FORMAT>(tail.as_ptr()) };
            for t in 0..T {
                // SAFETY: 32 * whole + 32 <= stride (cols padded to 128), inside `perm32`.
                let xt = unsafe { act_block(x.add(t * stride), whole) };
                fma_block(&mut acc[r][t], &w, &xt);
            }
        }
    }
    match tile.part {
        // SAFETY: as the load above.
        Some(part) if to < blocks => unsafe { store_carry(&acc, part.carry) },
        _ => store_sums::<R, T>(&acc, tile, out),
    }
}

/// 32 values of `FORMAT` from `at`, widened exactly: `[even 0..7, even 8..15, odd 0..7, odd
/// 8..15]` of the block's columns (`fma_block`'s order).
///
/// # Safety
/// `32 * elem(FORMAT)` bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn split<const FORMAT: u8>(at: *const u8) -> [__m256; 4] {
    let mut even = [_mm256_setzero_ps(); 2];
    let mut odd = [_mm256_setzero_ps(); 2];
    for h in 0..2 {
        // SAFETY: half h's 16 values lie in the 32 the caller vouches for.
        let (e, o) = unsafe {
            match FORMAT {
                BF16 => bf16_half(at.add(32 * h)),
                F16 => f16_half(at.add(32 * h)),
                _ => f32_half(at.add(64 * h)),
            }
        };
        even[h] = e;
        odd[h] = o;
    }
    [even[0], even[1], odd[0], odd[1]]
}

/// 32 BF16 values from `at` as the BF16 kernel widens a block (the packed kernel's exception
/// blocks).
///
/// # Safety
/// 64 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn split_bf16(at: *const u8) -> [__m256; 4] {
    // SAFETY: by the caller.
    unsafe { split::<BF16>(at) }
}

/// 16 BF16 values: dword lane j holds column 2j (low half) and 2j + 1 (high half), so `<< 16`
/// gives the even columns as f32 and masking the low half the odd ones (exact).
///
/// # Safety
/// 32 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bf16_half(at: *const u8) -> (__m256, __m256) {
    // SAFETY: 32 readable bytes, by the caller.
    let v = unsafe { _mm256_loadu_si256(at.cast()) };
    (
        _mm256_castsi256_ps(_mm256_slli_epi32::<{ HALF_BITS as i32 }>(v)),
        _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(HIGH_HALF as i32))),
    )
}

/// `vpshufb` indices gathering, in each 128-bit half, the four even words then the four odd
/// words of the half's eight F16 values.
static F16_EVEN_ODD_WORDS: [i8; 32] = {
    let mut idx = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        let word = (i % 16) / 2;
        let source = if word < 4 {
            2 * word
        } else {
            2 * (word - 4) + 1
        };
        idx[i] = (2 * source + i % 2) as i8;
        i += 1;
    }
    idx
};

/// 16 F16 values: even and odd words gathered (`vpshufb`, then 64-bit lanes reordered so the
/// low 128 bits hold the 8 even columns and the high 128 bits the 8 odd ones), each widened
/// exactly by `vcvtph2ps`.
///
/// # Safety
/// 32 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_half(at: *const u8) -> (__m256, __m256) {
    // SAFETY: 32 readable bytes, by the caller; the index table is 32 bytes.
    let (v, idx) = unsafe {
        (
            _mm256_loadu_si256(at.cast()),
            _mm256_loadu_si256(F16_EVEN_ODD_WORDS.as_ptr().cast()),
        )
    };
    let grouped = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, idx));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(grouped)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(grouped)),
    )
}

/// 16 F32 values: `shufps` takes lanes 0, 2 (1, 3) of each 128-bit half of both loads, and a
/// 64-bit lane reorder puts the 8 even (odd) columns in order.
///
/// # Safety
/// 64 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f32_half(at: *const u8) -> (__m256, __m256) {
    // SAFETY: 64 readable bytes, by the caller.
    let (a, b) = unsafe {
        (
            _mm256_loadu_ps(at.cast()),
            _mm256_loadu_ps(at.add(32).cast()),
        )
    };
    let order =
        |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
    (
        order(_mm256_shuffle_ps::<0b10_00_10_00>(a, b)),
        order(_mm256_shuffle_ps::<0b11_01_11_01>(a, b)),
    )
}
