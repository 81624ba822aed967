//! AVX-512 tiers, and the AVX2 tier that runs the exact AVX-512 tier's arithmetic on 256-bit
//! vectors (`avx2`). Each tier's public functions are `#[target_feature]` entry points called only
//! through a `Kernels` token; helpers are `#[inline]` target-feature functions so they inline
//! into the entries.
//!
//! Batch invariance by construction: a tier's row kernel is generic over `R` rows and `T`
//! tokens, and the arithmetic applied to one (row, token) pair — the loads, the FMA chain into
//! one accumulator, the final horizontal sum — does not depend on `R` or `T`. The GEMM is the
//! GEMV with more accumulators, so its rows equal the GEMV's bit for bit.

use core::arch::x86_64::*;

pub(crate) mod avx2;
pub(crate) mod bf16;
pub(crate) mod exact;
pub(crate) mod float;
pub(crate) mod lanes;
#[cfg(test)]
mod model;
pub(crate) mod packed;
pub(crate) mod vnni;

/// Runs `$kernel::<R, T, C>` for tokens `$tok0..$tok0 + T` over `$rows` in blocks of `R` rows
/// (then single rows for the tail). `$rows` may be a stretch of the caller's range, which
/// starts at `$first` and has `$n` rows: outputs land at the caller's offsets.
macro_rules! run_rows {
    ($kernel:ident, $r:literal, $t:literal, $c:literal, $m:expr, $act:expr, $tok0:expr, $rows:expr, $first:expr, $n:expr, $out:expr) => {{
        let rows: core::ops::Range<usize> = $rows;
        let mut row = rows.start;
        while rows.end - row >= $r {
            $kernel::<$r, $t, $c>($m, $act, $tok0, row, row - $first, $n, $out);
            row += $r;
        }
        while row < rows.end {
            $kernel::<1, $t, $c>($m, $act, $tok0, row, row - $first, $n, $out);
            row += 1;
        }
    }};
}

/// Picks the row blocking for the token count (enough independent FMA chains to hide latency,
/// few enough accumulators to stay in the 32 vector registers) and runs the kernel. A GEMV
/// streams `$gemv_rows` rows at once: more concurrent row streams keep more cache misses in
/// flight, up to the point where the accumulators no longer fit in registers.
///
/// GEMVs on the listed column counts (K3's shapes) run a copy of the kernel compiled for that
/// width (`C`), so row offsets are constants folded into addressing instead of registers
/// spilled to the stack; any other width runs the generic copy (`C = 0`). Same arithmetic.
///
/// More than 4 tokens run as groups of 2-4 tokens, split as evenly as possible, one group after
/// the other over each stretch of `STRETCH_BYTES` of rows: the first group streams the
/// stretch from memory, the others read it from L2. A kernel with 8 or 16 tokens' accumulators
/// and activations per row block spills registers: 1024x1024 BF16 from L3 at 1 thread, exact
/// tier, ran at 195-214 GFLOP/s with 4 tokens x 4 rows, 164 with 8 x 2 and 66 with 16 x 1
/// (PERFORMANCE.md, phase 7).
macro_rules! by_tokens {
    ($kernel:ident, $gemv_rows:literal, [$($cols:literal),*], $m:expr, $act:expr, $rows:expr, $out:expr) => {{
        let rows: core::ops::Range<usize> = $rows;
        let (first, n) = (rows.start, rows.len());
        match $act.tokens() {
            1 => match $m.cols() {
                $($cols => run_rows!($kernel, $gemv_rows, 1, $cols, $m, $act, 0, rows, first, n, $out),)*
                _ => run_rows!($kernel, $gemv_rows, 1, 0, $m, $act, 0, rows, first, n, $out),
            },
            2 => run_rows!($kernel, 4, 2, 0, $m, $act, 0, rows, first, n, $out),
            3 => run_rows!($kernel, 4, 3, 0, $m, $act, 0, rows, first, n, $out),
            4 => run_rows!($kernel, 4, 4, 0, $m, $act, 0, rows, first, n, $out),
            tokens => {
                let stretch = $crate::x86::stretch_rows($m.bytes_for_rows(1));
                let groups = tokens.div_ceil(4);
                let mut start = first;
                while start < rows.end {
                    let end = (start + stretch).min(rows.end);
                    for group in 0..groups {
                        let tok0 = group * tokens / groups;
                        match (group + 1) * tokens / groups - tok0 {
                            2 => run_rows!($kernel, 4, 2, 0, $m, $act, tok0, start..end, first, n, $out),
                            3 => run_rows!($kernel, 4, 3, 0, $m, $act, tok0, start..end, first, n, $out),
                            4 => run_rows!($kernel, 4, 4, 0, $m, $act, tok0, start..end, first, n, $out),
                            _ => unreachable!("5..=MAX_TOKENS tokens split into groups of 2-4"),
                        }
                    }
                    start = end;
                }
            }
        }
    }};
}
/// A BF16 tier's GEMV/GEMM dispatch: one-token GEMVs on rows of at most `SHORT_ROW_COLS`
/// columns stream 8 rows at once (copies compiled for k3-0.40b's and K3's short widths);
/// everything else goes through `by_tokens!` with 16-row GEMVs and copies for K3's widths.
/// Both BF16 tiers share it, so they pick the same row blocks for the same shapes.
macro_rules! by_tokens_bf16 {
    ($kernel:ident, $m:expr, $act:expr, $rows:expr, $out:expr) => {
        if $act.tokens() == 1 && $m.cols() <= $crate::x86::SHORT_ROW_COLS {
            let rows: core::ops::Range<usize> = $rows;
            let (first, n) = (rows.start, rows.len());
            match $m.cols() {
                256 => run_rows!($kernel, 8, 1, 256, $m, $act, 0, rows, first, n, $out),
                512 => run_rows!($kernel, 8, 1, 512, $m, $act, 0, rows, first, n, $out),
                1024 => run_rows!($kernel, 8, 1, 1024, $m, $act, 0, rows, first, n, $out),
                1536 => run_rows!($kernel, 8, 1, 1536, $m, $act, 0, rows, first, n, $out),
                2048 => run_rows!($kernel, 8, 1, 2048, $m, $act, 0, rows, first, n, $out),
                _ => run_rows!($kernel, 8, 1, 0, $m, $act, 0, rows, first, n, $out),
            }
        } else {
            by_tokens!(
                $kernel,
                16,
                [7168, 12288, 6144, 3584, 1536, 512],
                $m,
                $act,
                $rows,
                $out
            );
        }
    };
}
pub(crate) use {by_tokens, by_tokens_bf16, run_rows};

/// The matrix width a kernel copy runs with: the constant `C` it was compiled for, or the
/// runtime `cols` for the generic copy (`C = 0`). `by_tokens!` picks `C == cols`.
#[inline(always)]
pub(crate) fn width<const C: usize>(cols: usize) -> usize {
    if C == 0 {
        cols
    } else {
        assert_eq!(C, cols, "kernel copy for {C} columns called on {cols}");
        C
    }
}

/// Weight bytes of a stretch of rows that a GEMM's token groups share in cache (`by_tokens!`):
/// well inside the 1 MB L2 of a Zen 4 core.
pub(crate) const STRETCH_BYTES: usize = 128 << 10;

/// Rows per stretch for rows of `row_bytes`: about `STRETCH_BYTES`, a multiple of 16 rows (so
/// every kernel's row block divides it and only a range's last stretch has a row tail).
pub(crate) fn stretch_rows(row_bytes: usize) -> usize {
    (STRETCH_BYTES / row_bytes.max(1)).div_ceil(16).max(1) * 16
}

/// `N` lane patterns for `vpermps` over a vector of 16 group scales: pattern `p` gives lane
/// `l` the scale of group `(16 / N) * p + l / N`, i.e. each of `16 / N` consecutive groups
/// fills `N` consecutive lanes (the lanes its products land in).
pub(crate) const fn group_lanes<const P: usize>(lanes_per_group: usize) -> [[i32; 16]; P] {
    let mut idx = [[0i32; 16]; P];
    let groups_per_pattern = 16 / lanes_per_group;
    let mut p = 0;
    while p < P {
        let mut l = 0;
        while l < 16 {
            idx[p][l] = (groups_per_pattern * p + l / lanes_per_group) as i32;
            l += 1;
        }
        p += 1;
    }
    idx
}

/// Horizontal sum in a fixed tree (halves, then quarters, ...), written out so the order never
/// depends on how the compiler lowers a reduction intrinsic.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn hsum(v: __m512) -> f32 {
    let s = _mm512_add_ps(v, _mm512_shuffle_f32x4::<{ lanes::HSUM_UPPER_HALF }>(v, v));
    let s = _mm512_add_ps(
        s,
        _mm512_shuffle_f32x4::<{ lanes::HSUM_UPPER_QUARTER }>(s, s),
    );
    let x = _mm512_castps512_ps128(s);
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<{ lanes::HSUM_LANE_ONE }>(x, x));
    _mm_cvtss_f32(x)
}

/// The exact f32 scales of 16 consecutive groups (bytes beyond `n` read as 0, giving 2^-127
/// for groups whose weights are also masked to zero). Same values as `E8M0_TO_F32` (0xFF was
/// rejected when the matrix view was built).
///
/// # Safety
/// `ptr..ptr + n` must be readable, `n <= 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) unsafe fn scales16(ptr: *const u8, n: usize) -> __m512 {
    let bytes = if n >= 16 {
        // SAFETY: the caller vouches for 16 readable bytes.
        unsafe { _mm_loadu_si128(ptr.cast()) }
    } else {
        // SAFETY: the masked load touches only the `n` bytes the caller vouches for.
        unsafe { _mm_maskz_loadu_epi8((1u16 << n) - 1, ptr.cast()) }
    };
    let s = _mm512_cvtepu8_epi32(bytes);
    let normal = _mm512_slli_epi32::<23>(s);
    let zero = _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512());
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(
        normal,
        zero,
        _mm512_set1_epi32(0x0040_0000),
    ))
}

/// Writes the `R x T` accumulators of tokens `tok0..tok0 + T`: `out[(tok0 + t) * n + local0 + r]`.
/// Blocks of 8 or 16 accumulators reduce together (`hsum16`), the rest one by one; the sums
/// are `hsum`'s either way.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn store_sums<const R: usize, const T: usize>(
    acc: &[[__m512; T]; R],
    tok0: usize,
    local0: usize,
    n: usize,
    out: &mut [f32],
) {
    if R * T == 16 || R * T == 8 {
        let mut flat = [_mm512_setzero_ps(); 16];
        for (r, row_acc) in acc.iter().enumerate() {
            for (t, &a) in row_acc.iter().enumerate() {
                flat[t * R + r] = a;
            }
        }
        let mut sums = [0.0f32; 16];
        // SAFETY: `sums` is 16 writable f32.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), hsum16(&flat)) };
        for t in 0..T {
            let at = (tok0 + t) * n + local0;
            out[at..at + R].copy_from_slice(&sums[t * R..(t + 1) * R]);
        }
        return;
    }
    for (r, row_acc) in acc.iter().enumerate() {
        for (t, &a) in row_acc.iter().enumerate() {
            out[(tok0 + t) * n + local0 + r] = hsum(a);
        }
    }
}

/// The horizontal sums of 16 vectors at once: lane `l` is `hsum(v[l])` bit for bit. Each step
/// adds the same pairs as `hsum` (lanes 8 apart, then 4, 2, 1), with two vectors' halves packed
/// into one register, so 16 sums take 45 vector operations instead of about 140. Short rows
/// (256-512 columns) spend a large share of a GEMM block in these reductions.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn hsum16(v: &[__m512; 16]) -> __m512 {
    // The steps leave input 4k + q's sum in lane 4q + k; reading the inputs transposed puts
    // v[l]'s sum in lane l.
    let input = |j: usize| v[lanes::hsum16_input(j)];
    // Lanes i + (i + 8): two inputs' eight partial sums per vector.
    let halves: [__m512; 8] = core::array::from_fn(|k| {
        let (a, b) = (input(2 * k), input(2 * k + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_LOW_BLOCKS }>(a, b),
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_HIGH_BLOCKS }>(a, b),
        )
    });
    // Lanes i + (i + 4): 128-bit block q of `quarters[m]` holds input 4m + q's four sums.
    let quarters: [__m512; 4] = core::array::from_fn(|m| {
        let (c, d) = (halves[2 * m], halves[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_EVEN_BLOCKS }>(c, d),
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_ODD_BLOCKS }>(c, d),
        )
    });
    // Lanes i + (i + 2), as `movehl`: block q of `pairs[p]` is [input 8p+q's two sums, input
    // 8p+4+q's two sums].
    let pairs: [__m512; 2] = core::array::from_fn(|p| {
        let (e, f) = (
            _mm512_castps_pd(quarters[2 * p]),
            _mm512_castps_pd(quarters[2 * p + 1]),
        );
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(e, f)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(e, f)),
        )
    });
    // Lane 0 + lane 1, as the final `add_ss`.
    _mm512_add_ps(
        _mm512_shuffle_ps::<{ lanes::HSUM16_EVEN_LANES }>(pairs[0], pairs[1]),
        _mm512_shuffle_ps::<{ lanes::HSUM16_ODD_LANES }>(pairs[0], pairs[1]),
    )
}

/// Loads `32` bytes, or the first `n < 32` of them (the rest zero). Whole loads are plain:
/// AVX-512 masked loads that miss the cache stream far slower on Zen 4 (PERFORMANCE.md).
///
/// # Safety
/// `ptr..ptr + min(n, 32)` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) unsafe fn load_bytes32(ptr: *const u8, n: usize) -> __m256i {
    if n >= 32 {
        // SAFETY: 32 readable bytes, by the caller.
        unsafe { _mm256_loadu_si256(ptr.cast()) }
    } else {
        // SAFETY: the mask limits the load to the `n` readable bytes.
        unsafe { _mm256_maskz_loadu_epi8(lanes::byte_mask32(n), ptr.cast()) }
    }
}

/// As [`load_bytes32`], for 64 bytes.
///
/// # Safety
/// `ptr..ptr + min(n, 64)` must be readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(crate) unsafe fn load_bytes64(ptr: *const u8, n: usize) -> __m512i {
    if n >= 64 {
        // SAFETY: 64 readable bytes, by the caller.
        unsafe { _mm512_loadu_si512(ptr.cast()) }
    } else {
        // SAFETY: the mask limits the load to the `n` readable bytes.
        unsafe { _mm512_maskz_loadu_epi8(lanes::byte_mask64(n), ptr.cast()) }
    }
}

/// Prefetches step `step` of `steps` of a row block `PREFETCH_AHEAD` bytes (rounded up to
/// whole blocks) past the block that starts at `start` and spans `window` bytes. A row block
/// of a matrix is one contiguous window (rows are contiguous), so this is one sequential
/// prefetch stream running ahead of the demand loads whatever the row length: short MXFP4
/// rows (1.5-1.8 KB) end before a per-row prefetcher ramps up.
///
/// Needs only sse (`prefetcht0`), so the AVX2 tier calls it too.
#[target_feature(enable = "sse")]
#[inline]
pub(crate) fn prefetch_ahead(start: *const u8, window: usize, step: usize, steps: usize) {
    let ahead = prefetch_distance(window);
    let lines = window.div_ceil(64);
    for line in lines * step / steps..lines * (step + 1) / steps {
        // Prefetch hint only: it never faults, so an address past the matrix is harmless.
        _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(ahead + 64 * line).cast());
    }
}

/// A row block's stream in fixed steps: a kernel that walks a block of rows in equal steps of
/// `step_bytes` (a value block or group of each of its rows) prefetches at step `step` the
/// lines from `start + ahead + step * step_bytes`, `step_bytes` rounded up to whole lines, so
/// the steps cover the window `ahead` bytes on in order (a line at most missed at a step's end
/// is the next step's first). The row blocks of a range are one contiguous window, so this
/// streams the next row block while this one computes. No division and no data-dependent trip
/// count: `prefetch_ahead`'s two divisions per step, and `avx2::Prefetch`'s count of the lines
/// up to each step's exact end, cost the packed kernels a third of their rate in cache
/// (PERFORMANCE.md, phase 17).
#[target_feature(enable = "sse")]
#[inline]
pub(crate) fn prefetch_step(start: *const u8, ahead: usize, step: usize, step_bytes: usize) {
    for offset in step_offsets(ahead, step, step_bytes) {
        // Prefetch hint only: it never faults, so an address past the matrix is harmless.
        _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset).cast());
    }
}

/// The offsets [`prefetch_step`] prefetches at step `step`, one per line.
#[inline(always)]
fn step_offsets(ahead: usize, step: usize, step_bytes: usize) -> impl Iterator<Item = usize> {
    let from = ahead + step * step_bytes;
    (0..step_bytes.div_ceil(64)).map(move |line| from + 64 * line)
}

/// How far ahead a row block of `window` bytes prefetches ([`prefetch_step`],
/// [`prefetch_ahead`], `avx2::Prefetch`): `PREFETCH_AHEAD` rounded up to whole row blocks.
#[inline(always)]
pub(crate) fn prefetch_distance(window: usize) -> usize {
    PREFETCH_AHEAD.div_ceil(window.max(1)) * window
}

/// How far ahead the MXFP4 row-block prefetch runs (measured best of 5-28 KB, PERFORMANCE.md).
pub(crate) const PREFETCH_AHEAD: usize = 16 << 10;

/// BF16 GEMV rows of at most this many columns (4 KB) run 8 rows at once, not 16: a 16-row
/// block of 2 KB rows is 16 short streams that start cold every 32 KB, and 4 rows are too
/// few FMA chains. k3-0.40b's 163840x1024 lm_head at 1 thread: 74-76% of the read with 16,
/// 85-86% with 8, 69-70% with 4 (PERFORMANCE.md, phase 7). Per-row arithmetic does not
/// depend on the row block, so the bits do not either.
pub(crate) const SHORT_ROW_COLS: usize = 2048;

/// Where a BF16 row block's row `r` prefetches while at value block `block` (32 values), as an
/// offset in values from that row's current position: `PREFETCH_BF16` ahead in the row, and
/// near the row's end the same distance into row `r` of the *next* row block (the next row is
/// already streaming in this one), so a short row's first lines are not all demand misses.
#[inline(always)]
pub(crate) fn bf16_prefetch_offset(rows: usize, cols: usize, block: usize) -> usize {
    let ahead = 32 * block + PREFETCH_BF16;
    if ahead < cols {
        PREFETCH_BF16
    } else {
        rows * cols + ahead - cols - 32 * block
    }
}

/// Per-row software prefetch distance in BF16 rows, in values (512 bytes: 8 lines ahead).
/// BF16 rows are long (14 KB for K3's 7168 columns), so each row is its own stream; measured
/// best of 128..2048 values and better than the row-block prefetch here (PERFORMANCE.md).
pub(crate) const PREFETCH_BF16: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed-step stream prefetches every line of the window ahead (the row block after
    /// this one, or the one after that for small blocks) by the end of the walk, for the
    /// kernels' row blocks and steps: packed blocks of 3 and 4 rows, MXFP4 groups of 4 and 8.
    #[test]
    fn prefetch_steps_cover_the_next_row_block() {
        for (rows, step_bytes_per_row) in [(3usize, 49usize), (4, 49), (4, 16), (8, 16)] {
            for steps in [1usize, 16, 48, 112, 224, 384] {
                let step_bytes = rows * step_bytes_per_row;
                let window = steps * step_bytes;
                let ahead = prefetch_distance(window);
                assert!(ahead >= PREFETCH_AHEAD && ahead.is_multiple_of(window));
                let lines: std::collections::BTreeSet<usize> = (0..steps)
                    .flat_map(|s| step_offsets(ahead, s, step_bytes))
                    .map(|o| o / 64)
                    .collect();
                for byte in (ahead..ahead + window)
                    .step_by(16)
                    .chain([ahead + window - 1])
                {
                    assert!(
                        lines.contains(&(byte / 64)),
                        "{rows} rows x {step_bytes_per_row} bytes, {steps} steps: byte {byte}"
                    );
                }
            }
        }
    }

    /// `hsum16` gives every vector `hsum`'s bits, on values of mixed signs and magnitudes
    /// (where the order of additions shows in the last bits).
    #[test]
    fn hsum16_matches_hsum_bitwise() {
        if !(is_x86_feature_detected!("avx512f")) {
            eprintln!("skipped: no avx512f on this CPU");
            return;
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mantissa = ((state >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            mantissa * 2f32.powi(((state >> 20) % 40) as i32 - 20)
        };
        for _ in 0..200 {
            let values: Vec<f32> = (0..256).map(|_| next()).collect();
            // SAFETY: avx512f was detected above; every load reads 16 of the 256 values.
            unsafe {
                let v: [__m512; 16] =
                    core::array::from_fn(|i| _mm512_loadu_ps(values[16 * i..].as_ptr()));
                let mut got = [0.0f32; 16];
                _mm512_storeu_ps(got.as_mut_ptr(), hsum16(&v));
                for (l, &g) in got.iter().enumerate() {
                    assert_eq!(g.to_bits(), hsum(v[l]).to_bits(), "lane {l}");
                }
            }
        }
    }
}
