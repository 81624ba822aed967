//! MXFP4 matrices in the `avx2` tier: `exact::Mxfp4::block` on two 8-lane vectors.
//!
//! GEMV/GEMM decode: a group's 16 code bytes are widened to 16-bit words, each holding its low
//! nibble in its low byte and its high nibble in its high byte; two `pshufb`s look up the
//! scaled value's byte 2 and byte 3 (`exact::SCALED_BF16_BYTES`: E2M1 x 2^k is a BF16 value,
//! exact, -0 and infinities included) and interleaving them gives, per 32-bit lane, the BF16
//! of a byte's low-nibble weight and of its high-nibble weight side by side: a shift and a mask
//! make the two f32. So logical lane `j` (byte `j`, columns `2j` and `2j + 1`) sits at the same
//! position of a low and a high vector, and its chain is `avx512`'s: the low column's FMA, then
//! the high column's. The in-lane unpacks put lanes `[0..4, 8..12]` in the first accumulator
//! and `[4..8, 12..16]` in the second; the activations are laid out to match
//! (`Activations::avx2_mx`) and [`hsum_mx`] adds the lanes in `sums::hsum`'s tree and operand
//! order, so the result has `avx512`'s bits. Compared with a `vpermps` lookup of the scaled
//! table (what `dequant` still uses): 16 vector operations per group and row instead of 22.
//!
//! Dequant: half `h` of a group is its bytes `8h..8h + 8`, sign-extended to 8 dword lanes. An
//! E2M1 code is a sign bit over a 3-bit magnitude, and `vpermps` reads only bits 2..0 of each
//! index, so the lanes themselves (low nibbles, even columns) and the lanes shifted right by 4
//! (high nibbles, odd columns) index the 8 magnitudes of the group's scaled table
//! (`exact::SCALED_TABLES`, E2M1 x 2^k exact in f32); the code's sign bit, shifted up to bit
//! 31, is XORed on. `-(m x s)` is `(-m) x s` exactly, so every weight has the bits of
//! `avx512`'s 16-entry lookup (and of scalar's decode), including -0 and infinities.

use core::arch::x86_64::*;
use std::ops::Range;

use super::acc::{Acc, act_block, load_carry, store_carry};
use crate::activations::Activations;
use crate::isa::Avx2;
use crate::view::{GROUP, GROUP_BYTES, MxFp4Matrix};
use crate::x86::driver::{ChunkedGemm, Gemv, RowKernel, Tile};
use crate::x86::exact::{SCALED_BF16_BYTES, SCALED_TABLES};
use crate::x86::lanes;
use crate::x86::prefetch::{prefetch_distance, prefetch_step};

/// Dequantizes `rows` of `matrix` to f32 (bit-identical to scalar: the decode is exact): every
/// group decoded and put back in column order.
///
/// # Safety
/// The CPU must have avx2, fma and f16c (the token says it has); `rows` must lie inside
/// `matrix` and `out` hold `rows.len() * cols` f32 (checked by `Kernels`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_mxfp4(
    _: Avx2,
    matrix: &MxFp4Matrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let packed = matrix.packed_row(row).chunks_exact(GROUP_BYTES);
        for ((codes, &scale), dst) in packed
            .zip(matrix.scale_row(row))
            .zip(out_row.chunks_exact_mut(GROUP))
        {
            // SAFETY: `codes` is exactly 16 readable bytes.
            let w = unsafe { decode_group(codes.as_ptr(), scale) };
            for h in 0..2 {
                // Lanes 0, 1 of each 128-bit half: [even, odd] pairs in column order.
                let low = _mm256_unpacklo_ps(w[h], w[2 + h]);
                let high = _mm256_unpackhi_ps(w[h], w[2 + h]);
                // SAFETY: `dst` is exactly 32 writable f32; 16h + 16 <= 32.
                unsafe {
                    let at = dst.as_mut_ptr().add(16 * h);
                    _mm256_storeu_ps(at, _mm256_permute2f128_ps::<0x20>(low, high));
                    _mm256_storeu_ps(at.add(8), _mm256_permute2f128_ps::<0x31>(low, high));
                }
            }
        }
    }
}

/// The MXFP4 row kernel. GEMVs stream 3 rows: the decode is the bottleneck here (compute, not
/// memory), and 4 rows' accumulators with the decode's temporaries spill to the stack.
/// 16384x3584 at 1 thread on this Zen 3 host, best of alternating runs: 8.4 ms with 3 rows,
/// 8.8 with 2, 9.3 with 4.
pub(crate) struct Mxfp4;

impl RowKernel<MxFp4Matrix<'_>> for Mxfp4 {
    type Gemv = Gemv<3>;
    type Gemm = ChunkedGemm<2, 1, 1>;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &MxFp4Matrix<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        let Tile {
            tok0, local0, n, ..
        } = tile;
        let rows = tile.mxfp4_rows::<R, C>(m);
        let (groups, row_bytes, packed, scales) =
            (rows.groups, rows.row_bytes, rows.packed, rows.scales);
        let stride = act.padded();
        let x = tile.tokens::<T, _>(&act.avx2_mx, stride);
        // The whole rows, or a chunk of them (`ChunkedGemm`) with the accumulators carried.
        let (from, to) = tile.blocks(groups);
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        if let Some(part) = tile.part.filter(|_| from > 0) {
            // SAFETY: `run_chunked` gives each tile R x T accumulators of 16 f32.
            unsafe { load_carry(&mut acc, part.carry) };
        }
        let ahead = prefetch_distance(R * row_bytes);
        for g in from..to {
            match tile.part {
                None => prefetch_step(packed, ahead, g, R * GROUP_BYTES),
                // A chunk: the next row block's line of these groups (4 to a line).
                Some(_) if g % 4 == 0 => {
                    for r in 0..R {
                        let at = packed.wrapping_add((r + R) * row_bytes + GROUP_BYTES * g);
                        // Prefetch hint only: it never faults.
                        _mm_prefetch::<_MM_HINT_T0>(at.cast());
                    }
                }
                Some(_) => {}
            }
            for r in 0..R {
                // SAFETY: r < R, a row of the tile (`Tile::mxfp4_rows`); the group's 16 bytes
                // lie in that row.
                let w = unsafe {
                    decode_unpacked(
                        packed.add(r * row_bytes + GROUP_BYTES * g),
                        scales[r * groups + g],
                    )
                };
                for t in 0..T {
                    // SAFETY: t < T and 32g + 32 <= cols <= stride, inside the tile's tokens of
                    // `avx2_mx` (`Tile::tokens`). The 4 vectors are `[low, high]` of lanes
                    // `[0..4, 8..12]`, then of `[4..8, 12..16]` (that layout's order).
                    let xt = unsafe { act_block(x.add(t * stride), g) };
                    for v in 0..2 {
                        acc[r][t][v] = _mm256_fmadd_ps(w[2 * v], xt[2 * v], acc[r][t][v]);
                        acc[r][t][v] = _mm256_fmadd_ps(w[2 * v + 1], xt[2 * v + 1], acc[r][t][v]);
                    }
                }
            }
        }
        if let Some(part) = tile.part.filter(|_| to < groups) {
            // SAFETY: as the load above.
            unsafe { store_carry(&acc, part.carry) };
            return;
        }
        for (r, row_acc) in acc.iter().enumerate() {
            for (t, &a) in row_acc.iter().enumerate() {
                out[(tok0 + t) * n + local0 + r] = hsum_mx(a);
            }
        }
    }
}

/// `sums::hsum` of the 16 logical lanes held as `[0..4, 8..12]` and `[4..8, 12..16]`: lanes
/// `i + (i + 8)` (the two halves of each vector), then `i + (i + 4)` (the two vectors), `i + (i
/// + 2)`, lane 0 + lane 1, each sum with the lower lane first, as `hsum` adds them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum_mx(v: Acc) -> f32 {
    let low = _mm_add_ps(
        _mm256_castps256_ps128(v[0]),
        _mm256_extractf128_ps::<1>(v[0]),
    );
    let high = _mm_add_ps(
        _mm256_castps256_ps128(v[1]),
        _mm256_extractf128_ps::<1>(v[1]),
    );
    let x = _mm_add_ps(low, high);
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<{ lanes::HSUM_LANE_ONE }>(x, x));
    _mm_cvtss_f32(x)
}

/// One group's 32 weights, exactly, as `Mxfp4::block` consumes them: the low-nibble weights of
/// bytes `[0..4, 8..12]`, their high-nibble weights, then the same for bytes `[4..8, 12..16]`.
///
/// # Safety
/// 16 bytes from `codes` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_unpacked(codes: *const u8, scale: u8) -> [__m256; 4] {
    // Word j: byte j's low nibble in its low byte, its high nibble in its high byte.
    // SAFETY: 16 bytes from `codes`, by the caller.
    let words = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(codes.cast()) });
    let nibbles = _mm256_and_si256(
        _mm256_or_si256(words, _mm256_slli_epi16::<4>(words)),
        _mm256_set1_epi16(0x0F0F),
    );
    let table = SCALED_BF16_BYTES[scale as usize].as_ptr();
    // SAFETY: each table is 32 bytes: byte 2 of the 16 codes' values, then byte 3.
    let (byte2, byte3) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(table.cast())),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(table.add(16).cast())),
        )
    };
    let b2 = _mm256_shuffle_epi8(byte2, nibbles);
    let b3 = _mm256_shuffle_epi8(byte3, nibbles);
    // 32-bit lane p: [BF16 of the low-nibble weight, BF16 of the high-nibble weight].
    let first = _mm256_unpacklo_epi8(b2, b3);
    let second = _mm256_unpackhi_epi8(b2, b3);
    let high_half = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(first)),
        _mm256_castsi256_ps(_mm256_and_si256(first, high_half)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(second)),
        _mm256_castsi256_ps(_mm256_and_si256(second, high_half)),
    ]
}

/// One group's 32 weights, exactly, for `dequant`: `[even 0..7, even 8..15, odd 0..7, odd
/// 8..15]` of its columns (even columns are low nibbles).
///
/// # Safety
/// 16 bytes from `codes` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_group(codes: *const u8, scale: u8) -> [__m256; 4] {
    // SAFETY: each scaled table is 16 f32; the first 8 are the positive magnitudes.
    let table = unsafe { _mm256_loadu_ps(SCALED_TABLES[scale as usize].as_ptr()) };
    let sign = _mm256_set1_epi32(i32::MIN);
    let mut low = [_mm256_setzero_ps(); 2];
    let mut high = [_mm256_setzero_ps(); 2];
    for h in 0..2 {
        // Sign-extended, so a lane's bit 31 is the byte's bit 7, the high nibble's sign.
        // SAFETY: bytes 8h..8h + 8 of the 16 the caller vouches for.
        let v = _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(codes.add(8 * h).cast()) });
        // Bit 3, the low nibble's sign, to bit 31.
        let low_sign = _mm256_and_si256(_mm256_slli_epi32::<28>(v), sign);
        let high_sign = _mm256_and_si256(v, sign);
        low[h] = _mm256_xor_ps(
            _mm256_permutevar8x32_ps(table, v),
            _mm256_castsi256_ps(low_sign),
        );
        // Bits 6..4 to 2..0 (the bits `vpermps` reads).
        high[h] = _mm256_xor_ps(
            _mm256_permutevar8x32_ps(table, _mm256_srli_epi32::<4>(v)),
            _mm256_castsi256_ps(high_sign),
        );
    }
    [low[0], low[1], high[0], high[1]]
}
