//! Eight (AVX-512, two heads) or four (AVX2, for one head or two) positions' scores at once,
//! and the weighted latents (AVX-512 two heads at a time, AVX2 one), with the straightforward
//! loops' bits (`ops::dot`'s lanes and tree; position order).

use core::arch::x86_64::*;

/// `(dot(q, latent[l]) + dot(q_pe, pe[l])) * scale` for 4 rows `l` on AVX2: each row's 16
/// lanes are two 8-lane halves (lanes 0..7 and 8..15), summed as `ops::dot` sums them (lane
/// `i` the products of values `i, i + 16, …` from 0.0, each fused into the sum by an FMA),
/// then its tree: the halves added (lanes 8 apart), then 4, 2 and 1 apart. Four rows
/// share each load of `q`: 8 accumulators, independent chains.
///
/// # Safety
/// The CPU must have avx2 and fma (the `avx2` tier has both).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores4(
    q: &[f32],
    q_pe: &[f32],
    latent: &[f32],
    pe: &[f32],
    scale: f32,
) -> [f32; 4] {
    let d1 = lanes4(q, latent);
    let d2 = lanes4(q_pe, pe);
    std::array::from_fn(|l| (tree8x2(d1[l]) + tree8x2(d2[l])) * scale)
}

/// Each of the 4 rows' 16 partial sums of `a · row` as two halves (rows of `a.len()`
/// values, a multiple of 16).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn lanes4(a: &[f32], rows: &[f32]) -> [[__m256; 2]; 4] {
    let width = a.len();
    assert!(width.is_multiple_of(16) && rows.len() == 4 * width);
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    for k in (0..width).step_by(16) {
        // SAFETY: k + 16 <= width = a.len().
        let x = unsafe {
            [
                _mm256_loadu_ps(a.as_ptr().add(k)),
                _mm256_loadu_ps(a.as_ptr().add(k + 8)),
            ]
        };
        for (l, sums) in acc.iter_mut().enumerate() {
            for (h, sum) in sums.iter_mut().enumerate() {
                // SAFETY: l * width + k + 8h + 8 <= 4 * width = rows.len() (asserted).
                let y = unsafe { _mm256_loadu_ps(rows.as_ptr().add(l * width + k + 8 * h)) };
                *sum = _mm256_fmadd_ps(x[h], y, *sum);
            }
        }
    }
    acc
}

/// As [`scores4`] for two heads at once: `[h][l]` is head `h`'s score at row `l` of the 4,
/// with the bits of `(dot(q[h], latent[l]) + dot(q_pe[h], pe[l])) * scale`. Each loaded row
/// piece serves both heads, so the rows are read once per pair of heads: scores4 loads ten
/// vectors per eight multiplies, a row piece per multiply, from L2 once the block of rows
/// outgrows L1; this loads six per eight (PERFORMANCE.md phase 27).
///
/// # Safety
/// The CPU must have avx2 and fma (the `avx2` tier has both).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores2x4(
    q: [&[f32]; 2],
    q_pe: [&[f32]; 2],
    latent: &[f32],
    pe: &[f32],
    scale: f32,
) -> [[f32; 4]; 2] {
    let d1 = lanes2x4(q, latent);
    let d2 = lanes2x4(q_pe, pe);
    std::array::from_fn(|h| {
        std::array::from_fn(|l| (tree8x2(d1[h][l]) + tree8x2(d2[h][l])) * scale)
    })
}

/// Two vectors' 16 partial sums against each of 4 rows (`lanes4`'s), as `[h][l][half]`.
/// One half of the lanes at a time: 8 accumulators (2 heads × 4 rows) stay in registers
/// beside the two heads' pieces and a row's piece, where both halves at once would need 16.
/// The halves are independent chains of `ops::dot`, so their order between them is free.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn lanes2x4(a: [&[f32]; 2], rows: &[f32]) -> [[[__m256; 2]; 4]; 2] {
    let width = a[0].len();
    assert!(width.is_multiple_of(16) && a[1].len() == width && rows.len() == 4 * width);
    let mut out = [[[_mm256_setzero_ps(); 2]; 4]; 2];
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        for k in (8 * half..width).step_by(16) {
            // SAFETY: k + 8 <= width = a[h].len().
            let x = unsafe {
                [
                    _mm256_loadu_ps(a[0].as_ptr().add(k)),
                    _mm256_loadu_ps(a[1].as_ptr().add(k)),
                ]
            };
            for l in 0..4 {
                // SAFETY: l * width + k + 8 <= 4 * width = rows.len() (asserted).
                let y = unsafe { _mm256_loadu_ps(rows.as_ptr().add(l * width + k)) };
                for h in 0..2 {
                    acc[h][l] = _mm256_fmadd_ps(x[h], y, acc[h][l]);
                }
            }
        }
        for h in 0..2 {
            for l in 0..4 {
                out[h][l][half] = acc[h][l];
            }
        }
    }
    out
}

/// `weighted_rows` on AVX2 for the first `ctx.len()` columns (a multiple of `8 * N`) of rows
/// of `width` values: per stripe of `8 * N` columns, the sums in `N` registers, each
/// position's `w · row` fused into the sums (FMA), in position order. Each register's adds
/// form a chain a position long; with `N = 4` (32 columns) the chains' add latency bounded the
/// loop, `N = 8` (64 columns) keeps both add pipes busy: 3-17% faster over 4096 and 65,536
/// positions on Zen 3, alternated (PERFORMANCE.md phase 27).
///
/// # Safety
/// The CPU must have avx2 and fma (the `avx2` tier has both); `latent` must hold
/// `weights.len()` rows of `width >= ctx.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_rows_stripes<const N: usize>(
    weights: &[f32],
    latent: &[f32],
    ctx: &mut [f32],
    width: usize,
) {
    assert!(ctx.len().is_multiple_of(8 * N) && ctx.len() <= width);
    assert!(latent.len() >= weights.len() * width);
    for start in (0..ctx.len()).step_by(8 * N) {
        let at = ctx[start..].as_mut_ptr();
        // SAFETY: start + 8 * N <= ctx.len().
        let mut acc: [__m256; N] =
            std::array::from_fn(|k| unsafe { _mm256_loadu_ps(at.add(8 * k)) });
        for (p, &w) in weights.iter().enumerate() {
            let w = _mm256_set1_ps(w);
            let row = latent[p * width + start..].as_ptr();
            for (k, sum) in acc.iter_mut().enumerate() {
                // SAFETY: p * width + start + 8 * N <= latent.len() (asserted).
                let v = unsafe { _mm256_loadu_ps(row.add(8 * k)) };
                *sum = _mm256_fmadd_ps(w, v, *sum);
            }
        }
        for (k, sum) in acc.iter().enumerate() {
            // SAFETY: start + 8 * N <= ctx.len().
            unsafe { _mm256_storeu_ps(at.add(8 * k), *sum) };
        }
    }
}

/// `ops::dot`'s tree over 16 lanes held as two halves: lanes `i + (i + 8)`, then `i +
/// (i + 4)`, `i + (i + 2)`, lane 0 + lane 1.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn tree8x2(v: [__m256; 2]) -> f32 {
    let s = _mm256_add_ps(v[0], v[1]);
    let x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<0b01>(x, x));
    _mm_cvtss_f32(x)
}

/// `[tree(v[0]), …, tree(v[15])]`, where `tree` is `ops::dot`'s: lanes 8 apart added, then
/// 4, 2, 1. Each level adds the same lane pairs as the tree, for two or four vectors in
/// one add, and a last permutation puts row `l`'s sum in lane `l`.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn reduce16(v: [__m512; 16]) -> __m512 {
    // Lanes i + 8 onto i: [a.q0 a.q1 b.q0 b.q1] + [a.q2 a.q3 b.q2 b.q3].
    let x: [__m512; 8] = core::array::from_fn(|j| {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // Lanes i + 4 onto i: each vector holds two rows' 8 lanes.
    let y: [__m512; 4] = core::array::from_fn(|m| {
        let (a, b) = (x[2 * m], x[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // Quarter c of y[m] holds row 4m + c's 4 lanes. Lanes i + 2 onto i.
    let z: [__m512; 2] = core::array::from_fn(|n| {
        let (a, b) = (y[2 * n], y[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        )
    });
    // Quarter c of z[n]: rows 8n + c and 8n + 4 + c, 2 lanes each. Lane 1 onto lane 0.
    let w = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z[0], z[1]),
        _mm512_shuffle_ps::<0xDD>(z[0], z[1]),
    );
    // Lane 4c + j of w is row 4j + c.
    const ROWS: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
    // SAFETY: ROWS is 16 i32.
    let idx = unsafe { _mm512_loadu_si512(ROWS.as_ptr().cast()) };
    _mm512_permutexvar_ps(idx, w)
}

/// Two queries' scores against 8 rows: `[h][l]` has the bits of `(dot(q[h], latent[l]) +
/// dot(q_pe[h], pe[l])) * scale`, each dot in `ops::dot`'s order (lane `i` sums the products
/// of values `i, i + 16, …` from 0.0, each fused into the sum by an FMA; then the tree adds
/// lanes 8 apart, then 4, 2 and 1 apart). Each loaded row piece serves both queries, so a pair of
/// heads loads 10 vectors per 16 multiplies, where a head at a time loads 17; the 8 rows
/// (18 KiB at K3's widths) stay in a 32 KiB L1 while every pair of heads goes over them. The
/// 16 accumulators (independent chains) go through [`reduce16`] together. A lone head passes
/// its query twice.
///
/// # Safety
/// The CPU must have avx512f (every such CPU has fma).
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn scores2x8(
    q: [&[f32]; 2],
    q_pe: [&[f32]; 2],
    latent: &[f32],
    pe: &[f32],
    scale: f32,
) -> [[f32; 8]; 2] {
    let d1 = reduce16(lanes2x8(q, latent));
    let d2 = reduce16(lanes2x8(q_pe, pe));
    let s = _mm512_mul_ps(_mm512_add_ps(d1, d2), _mm512_set1_ps(scale));
    let mut out = [0.0f32; 16];
    // SAFETY: `out` is 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
    std::array::from_fn(|h| std::array::from_fn(|l| out[8 * h + l]))
}

/// Two vectors' 16 partial sums against each of 8 rows, as `[8h + l]`.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn lanes2x8(a: [&[f32]; 2], rows: &[f32]) -> [__m512; 16] {
    let width = a[0].len();
    assert!(width.is_multiple_of(16) && a[1].len() == width && rows.len() == 8 * width);
    let mut acc = [_mm512_setzero_ps(); 16];
    for k in (0..width).step_by(16) {
        // SAFETY: k + 16 <= width = a[h].len().
        let x = unsafe {
            [
                _mm512_loadu_ps(a[0].as_ptr().add(k)),
                _mm512_loadu_ps(a[1].as_ptr().add(k)),
            ]
        };
        for l in 0..8 {
            // SAFETY: l * width + k + 16 <= 8 * width = rows.len() (asserted).
            let y = unsafe { _mm512_loadu_ps(rows.as_ptr().add(l * width + k)) };
            for h in 0..2 {
                acc[8 * h + l] = _mm512_fmadd_ps(x[h], y, acc[8 * h + l]);
            }
        }
    }
    acc
}

/// `weighted_rows` for two heads at once on AVX-512, for columns `start..start + 16 * N` of
/// rows of `width` values: both heads' sums for those columns stay in `2 * N` registers while
/// the block's positions stream past, each loaded row piece serving both (`w · row`
/// fused into the sums by FMAs, in position order per head). The caller runs every pair of heads
/// over one stripe of the block before the next stripe, so the stripe's rows (16 KiB for 32
/// positions of 128 columns) stay in L1 for all of them.
///
/// # Safety
/// The CPU must have avx512f (every such CPU has fma); `latent` must hold `weights[h].len()`
/// rows of `width` values, both heads the same count of weights, and `start + 16 * N` be at
/// most `width` and the length of both `ctx` rows.
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::needless_range_loop)] // k indexes the row's loads and the accumulators alike
pub(super) unsafe fn weighted_stripe2<const N: usize>(
    weights: [&[f32]; 2],
    latent: &[f32],
    ctx: [&mut [f32]; 2],
    width: usize,
    start: usize,
) {
    let [c0, c1] = ctx;
    let end = start + 16 * N;
    assert!(end <= width && end <= c0.len() && end <= c1.len());
    assert!(weights[1].len() == weights[0].len() && latent.len() >= weights[0].len() * width);
    let at = [c0[start..].as_mut_ptr(), c1[start..].as_mut_ptr()];
    let mut acc: [[__m512; N]; 2] = std::array::from_fn(|h| {
        std::array::from_fn(|k| {
            // SAFETY: start + 16 * N <= both rows' lengths (asserted).
            unsafe { _mm512_loadu_ps(at[h].add(16 * k)) }
        })
    });
    for p in 0..weights[0].len() {
        let w = [_mm512_set1_ps(weights[0][p]), _mm512_set1_ps(weights[1][p])];
        let row = latent[p * width + start..].as_ptr();
        for k in 0..N {
            // SAFETY: p * width + start + 16 * N <= latent.len() (asserted).
            let v = unsafe { _mm512_loadu_ps(row.add(16 * k)) };
            for h in 0..2 {
                acc[h][k] = _mm512_fmadd_ps(w[h], v, acc[h][k]);
            }
        }
    }
    for h in 0..2 {
        for (k, sum) in acc[h].iter().enumerate() {
            // SAFETY: start + 16 * N <= both rows' lengths (asserted).
            unsafe { _mm512_storeu_ps(at[h].add(16 * k), *sum) };
        }
    }
}

/// Asks for the `part`-th of `parts` shares of `region`'s cache lines to be brought into L2
/// (`prefetcht1`), so a block of positions the next loop needs arrives while the current one
/// is computed: a hint, which never faults and changes no value.
#[inline(always)]
pub(super) fn prefetch_share(region: &[f32], part: usize, parts: usize) {
    const LINE_FLOATS: usize = 16;
    let lines = region.len().div_ceil(LINE_FLOATS);
    let (first, last) = (lines * part / parts, lines * (part + 1) / parts);
    for line in first..last {
        let at = region.as_ptr().wrapping_add(line * LINE_FLOATS).cast();
        // SAFETY: `prefetcht1` is sse, in every x86_64 CPU's baseline; a prefetch reads
        // nothing the program sees and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at) };
    }
}
