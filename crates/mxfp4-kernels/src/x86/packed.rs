//! Packed BF16 matrices (`crate::packed`) in the exact `avx512` tier: each block decoded in
//! registers to the 32 BF16 words a BF16 row holds (the `avx2` decode's two 16-word halves,
//! joined), widened as `exact::bf16_block` widens a BF16 row's 64 bytes, then its FMAs in its
//! order, so every result has `matmul_bf16`'s bits. An exception block (base 0) is read from
//! the matrix's kept BF16 blocks instead.
//!
//! Without it this tier decoded a few rows at a time into a buffer and ran the BF16 kernel
//! over it (`Kernels::packed_via_bf16`): on k3-wide at half the model's size in memory, where
//! most of the trunk is packed, that made a token's compute 2.3 s (PERFORMANCE.md, phase 16).

use core::arch::x86_64::*;
use std::ops::Range;

use super::avx2::Prefetch;
use super::avx2::packed::{decode_words, tables};
use super::lanes::{HALF_BITS, HIGH_HALF};
use super::{by_tokens, run_rows, store_sums, width};
use crate::activations::Activations;
use crate::packed::{BASE_AT, PACKED_BLOCK_BYTES, PackedBf16Matrix};

/// # Safety
/// The CPU must have avx512f/bw/vl (which imply avx2, fma and f16c); `rows` must lie inside
/// `matrix` and `out` hold `rows.len() * tokens` f32 (checked by `Kernels`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_packed_bf16(
    matrix: &PackedBf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // GEMVs run 4 rows at a time: on k3-wide in a cgroup of 0.9x the model (the whole trunk
    // packed and resident), 2 threads, alternating, 4 rows 131-151 ms/token (mean of 8 steps),
    // 8 rows 138-157, 16 rows 157-167.
    by_tokens!(
        packed_block,
        4,
        [7168, 12288, 6144, 3584, 1536, 512],
        matrix,
        act,
        rows,
        out
    );
}

/// Rows `row0..row0+R` for tokens `tok0..tok0+T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
fn packed_block<const R: usize, const T: usize, const C: usize>(
    m: &PackedBf16Matrix<'_>,
    act: &Activations,
    tok0: usize,
    row0: usize,
    local0: usize,
    n: usize,
    out: &mut [f32],
) {
    let stride = act.padded();
    assert!(row0 + R <= m.rows() && act.perm32.len() >= (tok0 + T) * stride);
    let cols = width::<C>(m.cols());
    let blocks = cols / 32;
    let row_bytes = blocks * PACKED_BLOCK_BYTES;
    let body = &m.body()[row0 * row_bytes..(row0 + R) * row_bytes];
    let base = body.as_ptr();
    let x = act.perm32[tok0 * stride..].as_ptr();
    let mut next: [usize; R] = std::array::from_fn(|r| m.first_exception(row0 + r));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut prefetch = Prefetch::new(R * row_bytes, blocks);
    let (offsets, not_first) = tables();
    let high_half = _mm512_set1_epi32(HIGH_HALF as i32);
    for block in 0..blocks {
        prefetch.step(base, block);
        let mut even = [_mm512_setzero_ps(); T];
        let mut odd = [_mm512_setzero_ps(); T];
        for t in 0..T {
            // SAFETY: 32 * block + 32 <= cols <= stride, inside token tok0 + t's row of
            // `perm32` (length asserted above).
            unsafe {
                even[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block));
                odd[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block + 16));
            }
        }
        for r in 0..R {
            let at = r * row_bytes + block * PACKED_BLOCK_BYTES;
            let v = if body[at + BASE_AT] != 0 {
                // SAFETY: the block's 49 bytes lie in `body` (`at + 49 <= R * row_bytes`).
                let (first, second) = unsafe { decode_words(base.add(at), offsets, not_first) };
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
            } else {
                let raw = m.take_exception(row0 + r, &mut next[r]);
                // SAFETY: `raw` is 64 bytes, 32 BF16 values.
                unsafe { _mm512_loadu_si512(raw.as_ptr().cast()) }
            };
            let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<HALF_BITS>(v));
            let w_odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(w_even, even[t], acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(w_odd, odd[t], acc[r][t]);
            }
        }
    }
    store_sums(&acc, tok0, local0, n, out);
}
