//! The `avx2` tier's accumulator, one `avx512` accumulator as two 8-lane halves, and what
//! every `avx2` kernel does with it: load a block's activations, run a block's FMAs in the
//! `avx512` order, sum the lanes in `x86::sums::hsum`'s tree, store a row block's sums.

use core::arch::x86_64::*;

use crate::x86::driver::Tile;
use crate::x86::lanes;

/// One `avx512` accumulator: lanes 0..7 and lanes 8..15.
pub(crate) type Acc = [__m256; 2];

/// `x86::sums::hsum` of the accumulator `v` (its two halves), in the same tree and operand order:
/// lanes `i + (i + 8)`, then `i + (i + 4)`, `i + (i + 2)`, lane 0 + lane 1.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: Acc) -> f32 {
    let s = _mm256_add_ps(v[0], v[1]);
    let x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<{ lanes::HSUM_LANE_ONE }>(x, x));
    _mm_cvtss_f32(x)
}

/// Writes the `R x T` accumulators of a row block where [`Tile`] says:
/// `out[(tok0 + t) * n + local0 + r]`, each by `hsum` (`x86::sums::store_sums`'s `hsum16`
/// blocks give `hsum`'s bits too). No batched tree as `hsum16`: a block here holds at most 4
/// accumulators, and one reduction per row and token is a small share of a row's work.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn store_sums<const R: usize, const T: usize>(
    acc: &[[Acc; T]; R],
    tile: Tile,
    out: &mut [f32],
) {
    let Tile {
        tok0, local0, n, ..
    } = tile;
    for (r, row_acc) in acc.iter().enumerate() {
        for (t, &a) in row_acc.iter().enumerate() {
            out[(tok0 + t) * n + local0 + r] = hsum(a);
        }
    }
}

/// The 32 activations of token row `x` at value block `block`, as 4 vectors in the row's
/// order: for a `perm32` row the even columns' halves, then the odd columns' halves
/// (`avx512`'s `even` lanes 0..7, 8..15, then `odd`'s); for an `avx2_mx` row, that layout's.
///
/// # Safety
/// `x + 32 * block + 32` f32 must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn act_block(x: *const f32, block: usize) -> [__m256; 4] {
    // SAFETY: 32 readable f32 from x + 32 * block, by the caller.
    unsafe {
        let at = x.add(32 * block);
        [
            _mm256_loadu_ps(at),
            _mm256_loadu_ps(at.add(8)),
            _mm256_loadu_ps(at.add(16)),
            _mm256_loadu_ps(at.add(24)),
        ]
    }
}

/// One block's FMAs into one accumulator, in `avx512`'s order: lane by lane, the even column's
/// product, then the odd column's. `w` and `x` are `[even 0..7, even 8..15, odd 0..7, odd 8..15]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn fma_block(acc: &mut Acc, w: &[__m256; 4], x: &[__m256; 4]) {
    for h in 0..2 {
        acc[h] = _mm256_fmadd_ps(w[h], x[h], acc[h]);
        acc[h] = _mm256_fmadd_ps(w[2 + h], x[2 + h], acc[h]);
    }
}

/// A chunked tile's `R x T` accumulators from `carry` (`x86::driver::ColumnPart`: 16 f32
/// each, row by row, token by token).
///
/// # Safety
/// `R * T * 16` f32 from `carry` must be readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load_carry<const R: usize, const T: usize>(
    acc: &mut [[Acc; T]; R],
    carry: *const f32,
) {
    for (r, row_acc) in acc.iter_mut().enumerate() {
        for (t, a) in row_acc.iter_mut().enumerate() {
            // SAFETY: by the caller.
            unsafe {
                let at = carry.add((r * T + t) * 16);
                *a = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
            }
        }
    }
}

/// Stores a chunked tile's accumulators where [`load_carry`] loads them.
///
/// # Safety
/// `R * T * 16` f32 from `carry` must be writable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn store_carry<const R: usize, const T: usize>(
    acc: &[[Acc; T]; R],
    carry: *mut f32,
) {
    for (r, row_acc) in acc.iter().enumerate() {
        for (t, a) in row_acc.iter().enumerate() {
            // SAFETY: by the caller.
            unsafe {
                let at = carry.add((r * T + t) * 16);
                _mm256_storeu_ps(at, a[0]);
                _mm256_storeu_ps(at.add(8), a[1]);
            }
        }
    }
}
