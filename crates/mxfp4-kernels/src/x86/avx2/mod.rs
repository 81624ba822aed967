//! The exact `avx2` tier: the exact `avx512` tier's arithmetic on 256-bit vectors, for CPUs
//! with avx2, fma and f16c but no AVX-512 (Zen 2/3, most Intel client parts).
//!
//! Same bits as `avx512`, by construction. Each of that tier's 16-lane accumulators is kept here
//! as two 8-lane halves (lanes 0..7 and 8..15), every lane receives the same weight and
//! activation values in the same order (the activations are `avx512`'s `perm32` layout, the
//! weights decoded exactly to the same f32), and each lane's chain is the same sequence of
//! correctly rounded FMAs, so each lane ends with the same bits. The horizontal sum then adds
//! the lanes in `x86::hsum`'s tree (lanes 8 apart, then 4, 2, 1), which `store_sums` (and its
//! `hsum16`) also follow. Row blocks and token groups differ from `avx512` (16 registers, not
//! 32), but no (row, token) result depends on them, as in every tier.

use core::arch::x86_64::*;
use std::ops::Range;

use super::{lanes, prefetch_distance};
use crate::activations::Activations;
use crate::packed::PackedBf16Matrix;
use crate::tier::Avx2;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix};

mod float;
mod mxfp4;
pub(crate) mod packed;

/// One `avx512` accumulator: lanes 0..7 and lanes 8..15.
pub(crate) type Acc = [__m256; 2];

/// The `avx2` dispatch: rows in blocks of `R` for the token count (2 x R x T of the 16 vector
/// registers hold the accumulators), more than 4 tokens as groups of 2-4 over stretches of
/// rows, as `by_tokens!` does (a group's accumulators stay in registers; the stretch stays in
/// L2 for the later groups).
macro_rules! by_tokens_avx2 {
    ($kernel:ident, $gemv_rows:literal, $m:expr, $act:expr, $rows:expr, $out:expr) => {{
        let rows: core::ops::Range<usize> = $rows;
        let (first, n) = (rows.start, rows.len());
        match $act.tokens() {
            1 => run_rows!($kernel, $gemv_rows, 1, 0, $m, $act, 0, rows, first, n, $out),
            2 => run_rows!($kernel, 2, 2, 0, $m, $act, 0, rows, first, n, $out),
            3 => run_rows!($kernel, 1, 3, 0, $m, $act, 0, rows, first, n, $out),
            4 => run_rows!($kernel, 1, 4, 0, $m, $act, 0, rows, first, n, $out),
            tokens => {
                let stretch = $crate::x86::stretch_rows($m.bytes_for_rows(1));
                let groups = tokens.div_ceil(4);
                let mut start = first;
                while start < rows.end {
                    let end = (start + stretch).min(rows.end);
                    for group in 0..groups {
                        let tok0 = group * tokens / groups;
                        match (group + 1) * tokens / groups - tok0 {
                            2 => run_rows!(
                                $kernel,
                                2,
                                2,
                                0,
                                $m,
                                $act,
                                tok0,
                                start..end,
                                first,
                                n,
                                $out
                            ),
                            3 => run_rows!(
                                $kernel,
                                1,
                                3,
                                0,
                                $m,
                                $act,
                                tok0,
                                start..end,
                                first,
                                n,
                                $out
                            ),
                            4 => run_rows!(
                                $kernel,
                                1,
                                4,
                                0,
                                $m,
                                $act,
                                tok0,
                                start..end,
                                first,
                                n,
                                $out
                            ),
                            _ => unreachable!("5..=MAX_TOKENS tokens split into groups of 2-4"),
                        }
                    }
                    start = end;
                }
            }
        }
    }};
}
pub(crate) use by_tokens_avx2;

/// Dequantizes `rows` of `matrix` to f32 (bit-identical to scalar: the decode is exact).
///
/// # Safety
/// `rows` must lie inside `matrix` and `out` hold `rows.len() * cols` f32 (checked by
/// `Kernels`); the token proves the CPU has avx2, fma and f16c.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_mxfp4(
    _: Avx2,
    matrix: &MxFp4Matrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    mxfp4::dequant(matrix, rows, out);
}

/// # Safety
/// As [`dequant_mxfp4`]; `act` was prepared for this tier with `matrix.cols()` columns and
/// `out` holds `rows.len() * act.tokens()` f32 (checked by `Kernels`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_mxfp4(
    _: Avx2,
    matrix: &MxFp4Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    mxfp4::matmul(matrix, act, rows, out);
}

/// # Safety
/// As [`matmul_mxfp4`], for a BF16 matrix.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_bf16(
    _: Avx2,
    matrix: &Bf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    float::matmul_bf16(matrix, act, rows, out);
}

/// # Safety
/// As [`matmul_mxfp4`], for a packed BF16 matrix.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_packed_bf16(
    _: Avx2,
    matrix: &PackedBf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    packed::matmul_packed_bf16(matrix, act, rows, out);
}

/// # Safety
/// As [`matmul_mxfp4`], for an F16 matrix.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_f16(
    _: Avx2,
    matrix: &F16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    float::matmul_f16(matrix, act, rows, out);
}

/// # Safety
/// As [`matmul_mxfp4`], for an F32 matrix.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_f32(
    _: Avx2,
    matrix: &F32Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    float::matmul_f32(matrix, act, rows, out);
}

/// `x86::hsum` of the accumulator `v` (its two halves), in the same tree and operand order:
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

/// Writes the `R x T` accumulators of tokens `tok0..tok0 + T`: `out[(tok0 + t) * n + local0 + r]`,
/// each by `hsum` (`x86::store_sums`'s `hsum16` blocks give `hsum`'s bits too). No batched
/// tree as `hsum16`: a block here holds at most 4 accumulators, and one reduction per row
/// and token is a small share of a row's work.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn store_sums<const R: usize, const T: usize>(
    acc: &[[Acc; T]; R],
    tok0: usize,
    local0: usize,
    n: usize,
    out: &mut [f32],
) {
    for (r, row_acc) in acc.iter().enumerate() {
        for (t, &a) in row_acc.iter().enumerate() {
            out[(tok0 + t) * n + local0 + r] = hsum(a);
        }
    }
}

/// `x86::prefetch_ahead`'s sequential stream over a row block (the same lines, `PREFETCH_AHEAD`
/// bytes rounded up to whole blocks ahead), without its two divisions per step: the stream
/// keeps its position and each step prefetches the lines up to its share of the window.
pub(crate) struct Prefetch {
    /// Byte offset from the block's start of the next line to prefetch.
    next: usize,
    /// Bytes of the window per step: `window / steps` (rounded up).
    per_step: usize,
    /// The first prefetched offset (`ahead`): step `s` covers up to `ahead + (s + 1) * per_step`.
    ahead: usize,
}

impl Prefetch {
    /// A stream over a row block of `window` bytes walked in `steps` steps.
    #[inline(always)]
    pub(crate) fn new(window: usize, steps: usize) -> Self {
        let ahead = prefetch_distance(window);
        Self {
            next: ahead,
            per_step: window.div_ceil(steps.max(1)),
            ahead,
        }
    }

    /// Prefetches step `step`'s lines of the stream from `start` (steps in order from 0).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn step(&mut self, start: *const u8, step: usize) {
        for offset in self.lines(step).step_by(64) {
            // Prefetch hint only: it never faults, so an address past the matrix is harmless.
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset).cast());
        }
    }

    /// The byte offsets of step `step`'s lines (from the block's start; whole lines of 64).
    #[inline(always)]
    fn lines(&mut self, step: usize) -> Range<usize> {
        let end = self.ahead + (step + 1) * self.per_step;
        let first = self.next;
        while self.next < end {
            self.next += 64;
        }
        first..self.next
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86::PREFETCH_AHEAD;

    /// Over a row block's steps the stream prefetches each line once, in order, from `ahead`
    /// (`PREFETCH_AHEAD` rounded up to whole windows) through the whole window, as
    /// `x86::prefetch_ahead` does, overshooting by less than a line plus `steps` bytes (the
    /// per-step share is rounded up).
    #[test]
    fn prefetch_stream_covers_the_window_ahead_once() {
        for window in [1usize, 63, 64, 100, 3 * 1792, 4 * 2048, 16 << 10, 57_344] {
            for steps in [1usize, 2, 3, 32, 56, 224] {
                let mut stream = Prefetch::new(window, steps);
                let ahead = PREFETCH_AHEAD.div_ceil(window) * window;
                let mut next = ahead;
                for step in 0..steps {
                    let lines = stream.lines(step);
                    assert_eq!(lines.start, next, "window {window}, step {step}/{steps}");
                    assert!(lines.end >= lines.start && (lines.end - ahead).is_multiple_of(64));
                    next = lines.end;
                }
                assert!(
                    next >= ahead + window && next < ahead + window + 64 + steps,
                    "window {window} in {steps} steps ends at {next}, ahead {ahead}"
                );
            }
        }
    }
}
