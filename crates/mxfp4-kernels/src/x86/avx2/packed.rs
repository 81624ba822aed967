//! Packed BF16 matrices (`crate::packed`) in the `avx2` tier: each block decoded in
//! registers to the two 16-value halves `float::split_bf16` loads from a BF16 row, then the
//! BF16 kernel's FMAs in its order, so every result has `matmul_bf16`'s bits.
//!
//! Decode of a block: the 16 code bytes in both lanes, the upper lane shifted down a nibble,
//! give code `p` in byte `p`; one `pshufb` of the block's table (`0` for code 0, `base + c - 1` for
//! code `c`) gives the exponents; with the sign/mantissa bytes, each value's low byte is
//! `(e & 1) << 7 | mantissa` and its high byte `sign | e >> 1`. Interleaving the low and high
//! bytes in each 128-bit lane puts the bytes' slots `[0..8 | 16..24]` and `[8..16 | 24..32]`
//! in words, which the block's slot order (`packed::SLOT_COLUMN`) makes columns `0..16` and
//! `16..32`. An exception block (base 0) is read from the matrix's kept BF16 blocks instead.
//! 15 vector operations per block and row besides the FMAs, against 4 for BF16; on this Zen 3
//! host that costs less than the 15 bytes per block it does not read (PERFORMANCE.md).

use core::arch::x86_64::*;
use std::ops::Range;

use super::acc::{act_block, fma_block, store_sums};
use super::float::split_bf16;
use crate::activations::Activations;
use crate::packed::{BASE_AT, CODES_AT, PACKED_BLOCK_BYTES, PackedBf16Matrix};
use crate::x86::driver::{Avx2Gemm, Gemv, RowKernel, Tile, width};
use crate::x86::lanes::{HALF_BITS, HIGH_HALF};
use crate::x86::prefetch::{prefetch_distance, prefetch_step};

/// `code -> exponent` offsets: entry 0 is masked to 0, entry `c` is `base + c - 1`.
const OFFSETS: [i8; 16] = [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
/// Keeps entries 1..16 of the table.
const NOT_FIRST: [i8; 16] = [
    0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
];

/// The packed row kernel. GEMVs run 3 rows at a time: 2, 3 and 4 measured alike (12288x7168
/// from memory, 2 threads, 9.7-11.6 GB/s of packed bytes), 3 at the top.
pub(crate) struct Packed;

impl RowKernel<PackedBf16Matrix<'_>> for Packed {
    type Gemv = Gemv<3>;
    type Gemm = Avx2Gemm;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &PackedBf16Matrix<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        let row0 = tile.row0;
        assert!(row0 + R <= m.rows());
        let stride = act.padded();
        let cols = width::<C>(m.cols());
        let blocks = cols / 32;
        let row_bytes = blocks * PACKED_BLOCK_BYTES;
        let body = &m.body()[row0 * row_bytes..(row0 + R) * row_bytes];
        let base = body.as_ptr();
        let x = tile.tokens::<T, _>(&act.perm32, stride);
        let mut next: [usize; R] = std::array::from_fn(|r| m.first_exception(row0 + r));
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        let ahead = prefetch_distance(R * row_bytes);
        let (offsets, not_first) = tables();
        for block in 0..blocks {
            prefetch_step(base, ahead, block, R * PACKED_BLOCK_BYTES);
            for r in 0..R {
                let at = r * row_bytes + block * PACKED_BLOCK_BYTES;
                let w = if body[at + BASE_AT] != 0 {
                    // SAFETY: the block's 49 bytes lie in `body` (`at + 49 <= R * row_bytes`).
                    unsafe { decode(base.add(at), offsets, not_first) }
                } else {
                    let raw = m.take_exception(row0 + r, &mut next[r]);
                    // SAFETY: `raw` is 64 bytes, 32 BF16 values.
                    unsafe { split_bf16(raw.as_ptr()) }
                };
                for t in 0..T {
                    // SAFETY: t < T and 32 * block + 32 <= cols <= stride, inside the tile's
                    // tokens of `perm32` (`Tile::tokens`).
                    let xt = unsafe { act_block(x.add(t * stride), block) };
                    fma_block(&mut acc[r][t], &w, &xt);
                }
            }
        }
        store_sums::<R, T>(&acc, tile, out);
    }
}

/// One packed block's 32 values as `split_bf16` gives a BF16 block's: `[even 0..7, even 8..15,
/// odd 0..7, odd 8..15]` of its columns, exactly.
///
/// # Safety
/// 49 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode(at: *const u8, offsets: __m256i, not_first: __m256i) -> [__m256; 4] {
    // SAFETY: the block's 49 bytes, by the caller.
    let (first, second) = unsafe { decode_words(at, offsets, not_first) };
    let high_half = _mm256_set1_epi32(HIGH_HALF as i32);
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<{ HALF_BITS as i32 }>(first)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<{ HALF_BITS as i32 }>(second)),
        _mm256_castsi256_ps(_mm256_and_si256(first, high_half)),
        _mm256_castsi256_ps(_mm256_and_si256(second, high_half)),
    ]
}

/// The decode's tables: `OFFSETS` and `NOT_FIRST` in both lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn tables() -> (__m256i, __m256i) {
    // SAFETY: the tables are 16 bytes each.
    unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(OFFSETS.as_ptr().cast())),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(NOT_FIRST.as_ptr().cast())),
        )
    }
}

/// One packed block's 32 BF16 values, exactly, as a BF16 row holds them: columns `0..16`,
/// then `16..32`, one 16-bit word each (`tables()` gives `offsets` and `not_first`). The
/// `avx512` tier joins the halves into one vector.
///
/// # Safety
/// 49 bytes from `at` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn decode_words(
    at: *const u8,
    offsets: __m256i,
    not_first: __m256i,
) -> (__m256i, __m256i) {
    // SAFETY: the block's 49 bytes, by the caller.
    let (signs, codes, base) = unsafe {
        (
            _mm256_loadu_si256(at.cast()),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(at.add(CODES_AT).cast())),
            *at.add(BASE_AT),
        )
    };
    let table = _mm256_and_si256(
        _mm256_add_epi8(_mm256_set1_epi8(base as i8), offsets),
        not_first,
    );
    // Slots 0..16 are the low nibbles, slots 16..32 the high ones: the upper lane shifted.
    let slots = _mm256_and_si256(
        _mm256_blend_epi32::<0xF0>(codes, _mm256_srli_epi16::<4>(codes)),
        _mm256_set1_epi8(0x0F),
    );
    let e = _mm256_shuffle_epi8(table, slots);
    let top = _mm256_set1_epi8(i8::MIN);
    // Low byte: the exponent's bit 0 under the mantissa; high byte: sign over bits 7..1.
    let rest = _mm256_set1_epi8(0x7F);
    let low_bytes = _mm256_or_si256(
        _mm256_andnot_si256(top, signs),
        _mm256_and_si256(_mm256_slli_epi16::<7>(e), top),
    );
    let high_bytes = _mm256_or_si256(
        _mm256_and_si256(signs, top),
        _mm256_and_si256(_mm256_srli_epi16::<1>(e), rest),
    );
    // In each 128-bit lane: slots [0..8 | 16..24] and [8..16 | 24..32], i.e. (by
    // `packed::SLOT_COLUMN`) columns 0..16 and 16..32.
    (
        _mm256_unpacklo_epi8(low_bytes, high_bytes),
        _mm256_unpackhi_epi8(low_bytes, high_bytes),
    )
}

/// Rows `rows` of `m` as little-endian BF16 bytes (`rows.len() * cols * 2`), exactly: what
/// `PackedBf16Matrix::decode_rows_bf16` gives, a block at a time in registers. The tiers that
/// run a GEMM of many tokens over decoded rows (`Kernels::packed_via_bf16`) use it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn decode_rows_bf16(m: &PackedBf16Matrix<'_>, rows: Range<usize>, out: &mut [u8]) {
    let (offsets, not_first) = tables();
    decode_rows_with(m, rows, out, |block, _, d| {
        // SAFETY: `block` is the block's 49 bytes; `d` is 64 writable bytes.
        unsafe {
            let (first, second) = decode_words(block.as_ptr(), offsets, not_first);
            _mm256_storeu_si256(d.as_mut_ptr().cast(), first);
            _mm256_storeu_si256(d.as_mut_ptr().add(32).cast(), second);
        }
    });
}

/// The walk of a row decode: each block of `rows` whose base is not 0 goes to `decode` with
/// its 49 bytes, its offset in the body and its 64 bytes of `out` to fill; each exception
/// block's kept 64 bytes are copied. Inlined into each decode's `#[target_feature]` function.
#[inline(always)]
pub(crate) fn decode_rows_with(
    m: &PackedBf16Matrix<'_>,
    rows: Range<usize>,
    out: &mut [u8],
    mut decode: impl FnMut(&[u8], usize, &mut [u8]),
) {
    let (cols, row_bytes) = (m.cols(), m.row_bytes());
    assert_eq!(out.len(), rows.len() * cols * 2, "the rows' bytes");
    for (row, dst) in rows.zip(out.chunks_exact_mut(cols * 2)) {
        let mut next = m.first_exception(row);
        let blocks = m.row_body(row).chunks_exact(PACKED_BLOCK_BYTES);
        for (k, (block, d)) in blocks.zip(dst.chunks_exact_mut(64)).enumerate() {
            if block[BASE_AT] != 0 {
                decode(block, row * row_bytes + k * PACKED_BLOCK_BYTES, d);
            } else {
                d.copy_from_slice(m.take_exception(row, &mut next));
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::ops::Range;

    use k3_testkit::Rng;

    use crate::packed::{PackedBf16, PackedBf16Matrix};

    /// Checks a row decode against the portable decode and the values packed: 11 rows of 320
    /// columns like trained weights, with exception blocks (every fifth block spans 40
    /// exponents) and zeros, over row ranges that include the body's last block.
    pub(crate) fn check_row_decode(
        decode: impl Fn(&PackedBf16Matrix<'_>, Range<usize>, &mut [u8]),
    ) {
        let (rows, cols) = (11, 320);
        let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
        let bf16: Vec<u8> = (0..rows * cols)
            .flat_map(|i| {
                let r = rng.next_u64() as u16;
                let e = match ((i / 32) % 5, r % 53) {
                    (4, _) => 90 + (r >> 10) % 40,
                    (_, 0) => 0,
                    _ => 115 + (r >> 10) % 9,
                };
                ((r & 0x807F) | (e << 7)).to_le_bytes()
            })
            .collect();
        let packed = PackedBf16::pack(&bf16, rows, cols).unwrap();
        assert!(
            packed.exception_count() > 0,
            "the test has exception blocks"
        );
        let m = packed.view();
        for range in [0..rows, 3..7, 10..11] {
            let mut want = vec![0u8; range.len() * cols * 2];
            let mut got = vec![0u8; range.len() * cols * 2];
            m.decode_rows_bf16(range.clone(), &mut want);
            decode(&m, range.clone(), &mut got);
            assert_eq!(got, want, "rows {range:?}");
            assert_eq!(want, bf16[range.start * cols * 2..range.end * cols * 2]);
        }
    }

    /// The in-register row decode gives the portable decode's bytes.
    #[test]
    fn decode_rows_matches_the_portable_decode() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("note: no avx2 here; the in-register decode is not tested");
            return;
        }
        // SAFETY: avx2, fma and f16c were detected above.
        check_row_decode(|m, rows, out| unsafe { super::decode_rows_bf16(m, rows, out) });
    }
}
