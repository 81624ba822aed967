//! MLA attention over a sequence's latent cache for one token's queries of a run of heads, in
//! the absorbed form (docs/MODEL.md §7.3): per head, scores against every cached position,
//! softmax, the weighted sum of the latents, then the head's value rows.
//!
//! Every sum keeps the order of the straightforward loops (`ops::dot` for the scores and the
//! value rows, position order for the weighted latents), so the bits are those of decoding
//! token by token whatever the chunk.

use super::session::MlaCache;
use crate::ops::dot;

/// The MLA head shape [`head_context`] needs.
pub(super) struct Dims {
    pub(super) nope: usize,
    pub(super) rope: usize,
    pub(super) rank: usize,
    pub(super) scale: f32,
    /// The CPU has avx512f (`wide::has_avx512`): scores go 16 positions at a time.
    pub(super) avx512: bool,
    /// The kernels' tier is `avx2` (the CPU has avx2): scores go 4 positions at a time.
    pub(super) avx2: bool,
}

/// One attention task's buffers, reused for each token it computes.
#[derive(Default)]
pub(super) struct HeadBuffers {
    /// Each head's `W_UKᵀ q_nope`, `rank` values per head.
    q_abs: Vec<f32>,
    /// Each head's scores, then weights, over the token's positions, `positions` per head.
    scores: Vec<f32>,
    /// Each head's weighted latents, `rank` values per head.
    ctx_latent: Vec<f32>,
}

/// Positions of the cache one pass over the task's heads reads before the next: 16 rows of
/// K3's 512 + 64 f32 are 36 KiB, read from memory once and then from L1/L2 for every head of
/// the task, where a head at a time read the whole cache once per head (96 times per token
/// at K3's width, from memory once it outgrows the caches). A multiple of 16, the AVX-512
/// score kernel's block.
const POSITION_BLOCK: usize = 16;

/// `ctx[j] += Σ_p weights[p] · latent[p][j]` over the rows of `latent` (`ctx.len()` values
/// each), each sum continuing in position order from the value `ctx[j]` holds (a multiply,
/// then an add). From `ctx` zeroed, a call per block of positions in order gives the bits of
/// one call over them all. On AVX2 ([`x86::weighted_rows4`]) 32 sums at a time stay in four
/// registers while the block's positions stream past; as an `[f32; 32]` array the compiler
/// kept them in memory, each position's add waiting on the last one's store (10 GMAC/s on a
/// Zen 3 core, PERFORMANCE.md phase 25).
#[inline(always)]
fn weighted_rows(weights: &[f32], latent: &[f32], ctx: &mut [f32], avx2: bool) {
    const STRIPE: usize = 32;
    let width = ctx.len();
    let mut start = 0;
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        start = width / STRIPE * STRIPE;
        // SAFETY: `avx2` is set only where the kernels' tier proves avx2; `latent` holds
        // `weights.len()` rows of `width` values (the callers' slices).
        unsafe { x86::weighted_rows4(weights, latent, &mut ctx[..start], width) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;
    while start + STRIPE <= width {
        let mut acc = [0.0f32; STRIPE];
        acc.copy_from_slice(&ctx[start..start + STRIPE]);
        for (p, &w) in weights.iter().enumerate() {
            let row = &latent[p * width + start..p * width + start + STRIPE];
            for j in 0..STRIPE {
                acc[j] += w * row[j];
            }
        }
        ctx[start..start + STRIPE].copy_from_slice(&acc);
        start += STRIPE;
    }
    for (j, c) in ctx.iter_mut().enumerate().skip(start) {
        let mut acc = *c;
        for (p, &w) in weights.iter().enumerate() {
            acc += w * latent[p * width + j];
        }
        *c = acc;
    }
}

/// One token's query as [`heads_context`] reads it: per head, its query (nope then rope
/// parts) and its `kv_b` rows (`nope + v_head_dim` rows of `rank`).
pub(super) struct HeadQueries<'a> {
    /// `heads × (nope + rope)` values.
    pub(super) q: &'a [f32],
    /// `heads × (nope + v_head_dim) × rank` values.
    pub(super) rows: &'a [f32],
}

/// The contexts of consecutive heads for one token (docs/MODEL.md §7.3), the token attending
/// to the first `positions` rows of the cache; `out` holds `v_head_dim` values per head.
/// Each head's arithmetic is the straightforward loops' (module docs); the cache is read in
/// blocks of [`POSITION_BLOCK`] positions, each block for every head before the next, so it
/// is read once per token and task instead of once per head. Inlined into `wide`'s function,
/// with plain loops and reused buffers: as a closure with iterator `collect`s it was compiled
/// outside it at baseline width, and `exp`'s `mul_add` and rounding became libm calls
/// (PERFORMANCE.md, phase 20).
#[inline(always)]
pub(super) fn heads_context(
    d: &Dims,
    cache: &MlaCache,
    positions: usize,
    queries: HeadQueries<'_>,
    out: &mut [f32],
    buf: &mut HeadBuffers,
) {
    let (nope, rope, rank) = (d.nope, d.rope, d.rank);
    let head_q = nope + rope;
    let heads = queries.q.len() / head_q;
    let v_dim = out.len() / heads;
    let head_rows = (nope + v_dim) * rank;
    // q_abs = W_UKᵀ q_nope, per head: [rank].
    let q_abs = &mut buf.q_abs;
    q_abs.clear();
    q_abs.resize(heads * rank, 0.0);
    for h in 0..heads {
        let q = &queries.q[h * head_q..h * head_q + nope];
        let rows = &queries.rows[h * head_rows..h * head_rows + nope * rank];
        let q_abs = &mut q_abs[h * rank..(h + 1) * rank];
        for (i, &qi) in q.iter().enumerate() {
            for (a, &wv) in q_abs.iter_mut().zip(&rows[i * rank..(i + 1) * rank]) {
                *a += qi * wv;
            }
        }
    }
    let scores = &mut buf.scores;
    scores.clear();
    scores.resize(heads * positions, 0.0);
    let mut block_start = 0;
    while block_start < positions {
        let block_end = (block_start + POSITION_BLOCK).min(positions);
        for h in 0..heads {
            let q_abs = &q_abs[h * rank..(h + 1) * rank];
            let q_pe = &queries.q[h * head_q + nope..(h + 1) * head_q];
            let scores = &mut scores[h * positions..(h + 1) * positions];
            score_block(d, cache, q_abs, q_pe, block_start..block_end, scores);
        }
        block_start = block_end;
    }
    for h in 0..heads {
        let scores = &mut scores[h * positions..(h + 1) * positions];
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in scores.iter_mut() {
            *s = mxfp4_kernels::vmath::exp(*s - max);
        }
        let total = scores.iter().fold(0.0f32, |a, &e| a + e);
        for s in scores.iter_mut() {
            *s /= total;
        }
    }
    let ctx_latent = &mut buf.ctx_latent;
    ctx_latent.clear();
    ctx_latent.resize(heads * rank, 0.0);
    let mut block_start = 0;
    while block_start < positions {
        let block_end = (block_start + POSITION_BLOCK).min(positions);
        let latent = &cache.latent[block_start * rank..block_end * rank];
        for h in 0..heads {
            let weights = &scores[h * positions + block_start..h * positions + block_end];
            weighted_rows(
                weights,
                latent,
                &mut ctx_latent[h * rank..(h + 1) * rank],
                d.avx2,
            );
        }
        block_start = block_end;
    }
    // ctx_h = W_UV ctx_latent: [v_head_dim].
    for h in 0..heads {
        let rows = &queries.rows[h * head_rows + nope * rank..(h + 1) * head_rows];
        let ctx_latent = &ctx_latent[h * rank..(h + 1) * rank];
        for (j, o) in out[h * v_dim..(h + 1) * v_dim].iter_mut().enumerate() {
            *o = dot(&rows[j * rank..(j + 1) * rank], ctx_latent);
        }
    }
}

/// One head's scores at positions `block` (at most [`POSITION_BLOCK`]), into `scores[p]`:
/// `(dot(q_abs, latent[p]) + dot(q_pe, k_pe[p])) * scale`.
#[inline(always)]
fn score_block(
    d: &Dims,
    cache: &MlaCache,
    q_abs: &[f32],
    q_pe: &[f32],
    block: std::ops::Range<usize>,
    scores: &mut [f32],
) {
    let (rope, rank) = (d.rope, d.rank);
    #[cfg(target_arch = "x86_64")]
    if d.avx512 && block.len() == 16 && rank.is_multiple_of(16) && rope.is_multiple_of(16) {
        let p = block.start;
        // SAFETY: `d.avx512` is set only where the kernels' tier proves avx512f; the
        // widths are multiples of 16 and the slices hold 16 rows of each.
        let s = unsafe {
            x86::scores16(
                q_abs,
                q_pe,
                &cache.latent[p * rank..(p + 16) * rank],
                &cache.k_pe[p * rope..(p + 16) * rope],
                d.scale,
            )
        };
        scores[block].copy_from_slice(&s);
        return;
    }
    let mut block = block;
    #[cfg(target_arch = "x86_64")]
    if d.avx2 && rank.is_multiple_of(16) && rope.is_multiple_of(16) {
        while block.len() >= 4 {
            let p = block.start;
            // SAFETY: `d.avx2` is set only where the kernels' tier proves avx2; the widths
            // are multiples of 16 and the slices hold 4 rows of each.
            let s = unsafe {
                x86::scores4(
                    q_abs,
                    q_pe,
                    &cache.latent[p * rank..(p + 4) * rank],
                    &cache.k_pe[p * rope..(p + 4) * rope],
                    d.scale,
                )
            };
            scores[p..p + 4].copy_from_slice(&s);
            block.start += 4;
        }
    }
    for p in block {
        let c = &cache.latent[p * rank..(p + 1) * rank];
        let pe = &cache.k_pe[p * rope..(p + 1) * rope];
        scores[p] = (dot(q_abs, c) + dot(q_pe, pe)) * d.scale;
    }
}

/// Sixteen (AVX-512) or four (AVX2) positions' scores at once with `ops::dot`'s bits.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    /// As [`scores16`] for 4 rows on AVX2: each row's 16 lanes are two 8-lane halves (lanes
    /// 0..7 and 8..15), summed as `ops::dot` sums them (a multiply, then an add, per lane),
    /// then its tree: the halves added (lanes 8 apart), then 4, 2 and 1 apart. Four rows
    /// share each load of `q`: 8 accumulators, independent chains.
    ///
    /// # Safety
    /// The CPU must have avx2.
    #[target_feature(enable = "avx2")]
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
    #[target_feature(enable = "avx2")]
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
                    *sum = _mm256_add_ps(*sum, _mm256_mul_ps(x[h], y));
                }
            }
        }
        acc
    }

    /// `weighted_rows` on AVX2 for the first `ctx.len()` columns (a multiple of 32) of rows of
    /// `width` values: per stripe of 32 columns, the sums in four registers, each position's
    /// `w · row` multiplied, then added, in position order.
    ///
    /// # Safety
    /// The CPU must have avx2; `latent` must hold `weights.len()` rows of `width >= ctx.len()`
    /// values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn weighted_rows4(
        weights: &[f32],
        latent: &[f32],
        ctx: &mut [f32],
        width: usize,
    ) {
        assert!(ctx.len().is_multiple_of(32) && ctx.len() <= width);
        assert!(latent.len() >= weights.len() * width);
        for start in (0..ctx.len()).step_by(32) {
            let at = ctx[start..].as_mut_ptr();
            // SAFETY: start + 32 <= ctx.len().
            let mut acc: [__m256; 4] =
                std::array::from_fn(|k| unsafe { _mm256_loadu_ps(at.add(8 * k)) });
            for (p, &w) in weights.iter().enumerate() {
                let w = _mm256_set1_ps(w);
                let row = latent[p * width + start..].as_ptr();
                for (k, sum) in acc.iter_mut().enumerate() {
                    // SAFETY: p * width + start + 32 <= latent.len() (asserted).
                    let v = unsafe { _mm256_loadu_ps(row.add(8 * k)) };
                    *sum = _mm256_add_ps(*sum, _mm256_mul_ps(w, v));
                }
            }
            for (k, sum) in acc.iter().enumerate() {
                // SAFETY: start + 32 <= ctx.len().
                unsafe { _mm256_storeu_ps(at.add(8 * k), *sum) };
            }
        }
    }

    /// `ops::dot`'s tree over 16 lanes held as two halves: lanes `i + (i + 8)`, then `i +
    /// (i + 4)`, `i + (i + 2)`, lane 0 + lane 1.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn tree8x2(v: [__m256; 2]) -> f32 {
        let s = _mm256_add_ps(v[0], v[1]);
        let x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        let x = _mm_add_ss(x, _mm_shuffle_ps::<0b01>(x, x));
        _mm_cvtss_f32(x)
    }

    /// `(dot(q, latent[l]) + dot(q_pe, pe[l])) * scale` for the 16 rows `l` of `latent` and
    /// `pe` (widths `q.len()` and `q_pe.len()`, multiples of 16), each dot in `ops::dot`'s
    /// order: per row, lane `i` sums the products of values `i, i + 16, …` from 0.0 (a
    /// multiply, then an add: no fused multiply-add), then the tree adds lanes 8 apart, then
    /// 4, 2 and 1 apart. The rows' 16 accumulators are independent chains (a row at a time
    /// waits on each add), and the tree runs on all 16 at once as a transposition
    /// (`reduce16`).
    ///
    /// # Safety
    /// The CPU must have avx512f.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores16(
        q: &[f32],
        q_pe: &[f32],
        latent: &[f32],
        pe: &[f32],
        scale: f32,
    ) -> [f32; 16] {
        let d1 = reduce16(lanes16(q, latent));
        let d2 = reduce16(lanes16(q_pe, pe));
        let s = _mm512_mul_ps(_mm512_add_ps(d1, d2), _mm512_set1_ps(scale));
        let mut out = [0.0f32; 16];
        // SAFETY: `out` is 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
        out
    }

    /// Each of the 16 rows' 16 partial sums of `a · row` (rows of `a.len()` values).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn lanes16(a: &[f32], rows: &[f32]) -> [__m512; 16] {
        let width = a.len();
        assert!(width.is_multiple_of(16) && rows.len() == 16 * width);
        let mut acc = [_mm512_setzero_ps(); 16];
        for k in (0..width).step_by(16) {
            // SAFETY: k + 16 <= width = a.len().
            let x = unsafe { _mm512_loadu_ps(a.as_ptr().add(k)) };
            for (l, sums) in acc.iter_mut().enumerate() {
                // SAFETY: l * width + k + 16 <= 16 * width = rows.len() (asserted).
                let y = unsafe { _mm512_loadu_ps(rows.as_ptr().add(l * width + k)) };
                *sums = _mm512_add_ps(*sums, _mm512_mul_ps(x, y));
            }
        }
        acc
    }

    /// `[tree(v[0]), …, tree(v[15])]`, where `tree` is `ops::dot`'s: lanes 8 apart added, then
    /// 4, 2, 1. Each level adds the same lane pairs as the tree, for two or four vectors in
    /// one add, and a last permutation puts row `l`'s sum in lane `l`.
    #[target_feature(enable = "avx512f")]
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head's context by the straightforward loops the module docs name: `dot` for each
    /// score, the softmax in position order, the weighted latents summed position by position
    /// from 0.0, `dot` for the value rows.
    fn one_head(d: &Dims, cache: &MlaCache, positions: usize, q: &[f32], rows: &[f32]) -> Vec<f32> {
        let (nope, rope, rank) = (d.nope, d.rope, d.rank);
        let mut q_abs = vec![0.0f32; rank];
        for i in 0..nope {
            for (a, &w) in q_abs.iter_mut().zip(&rows[i * rank..(i + 1) * rank]) {
                *a += q[i] * w;
            }
        }
        let mut scores: Vec<f32> = (0..positions)
            .map(|p| {
                (dot(&q_abs, &cache.latent[p * rank..(p + 1) * rank])
                    + dot(&q[nope..], &cache.k_pe[p * rope..(p + 1) * rope]))
                    * d.scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in scores.iter_mut() {
            *s = mxfp4_kernels::vmath::exp(*s - max);
        }
        let total = scores.iter().fold(0.0f32, |a, &e| a + e);
        let mut latent = vec![0.0f32; rank];
        for (p, s) in scores.iter().enumerate() {
            let weight = s / total;
            for (a, &v) in latent
                .iter_mut()
                .zip(&cache.latent[p * rank..(p + 1) * rank])
            {
                *a += weight * v;
            }
        }
        let v_rows = &rows[nope * rank..];
        (0..v_rows.len() / rank)
            .map(|j| dot(&v_rows[j * rank..(j + 1) * rank], &latent))
            .collect()
    }

    /// `heads_context` gives every head the bits of the straightforward loops (`one_head`),
    /// with the cache read in blocks (positions that fill none, one, and several blocks with
    /// a tail) and with each score path this CPU has (the AVX-512 16-position and the AVX2
    /// 4-position kernels, and plain `dot`), at k3-0.40b's widths and at widths that are not
    /// multiples of 16.
    #[test]
    fn blocked_heads_give_each_heads_straightforward_bits() {
        let mut rng = fastrand::Rng::with_seed(5);
        #[cfg(target_arch = "x86_64")]
        let paths = [
            (false, false),
            (false, std::arch::is_x86_feature_detected!("avx2")),
            (std::arch::is_x86_feature_detected!("avx512f"), false),
        ];
        #[cfg(not(target_arch = "x86_64"))]
        let paths = [(false, false)];
        for (nope, rope, rank, v_dim) in [(64usize, 32usize, 128usize, 64usize), (8, 5, 24, 6)] {
            let heads = 3;
            let total = 41;
            let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-3..3));
            let cache = MlaCache {
                latent: (0..total * rank).map(|_| value()).collect(),
                k_pe: (0..total * rope).map(|_| value()).collect(),
            };
            let q: Vec<f32> = (0..heads * (nope + rope)).map(|_| value()).collect();
            let rows: Vec<f32> = (0..heads * (nope + v_dim) * rank)
                .map(|_| value())
                .collect();
            for (avx512, avx2) in paths {
                let d = Dims {
                    nope,
                    rope,
                    rank,
                    scale: 0.09,
                    avx512,
                    avx2,
                };
                let mut buf = HeadBuffers::default();
                for positions in [1usize, 7, 16, 33, 41] {
                    let mut out = vec![0.0f32; heads * v_dim];
                    let queries = HeadQueries { q: &q, rows: &rows };
                    heads_context(&d, &cache, positions, queries, &mut out, &mut buf);
                    for h in 0..heads {
                        let want = one_head(
                            &d,
                            &cache,
                            positions,
                            &q[h * (nope + rope)..(h + 1) * (nope + rope)],
                            &rows[h * (nope + v_dim) * rank..(h + 1) * (nope + v_dim) * rank],
                        );
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&out[h * v_dim..(h + 1) * v_dim]),
                            bits(&want),
                            "rank {rank}, head {h}, {positions} positions, avx512 {avx512}, avx2 {avx2}"
                        );
                    }
                }
            }
        }
    }

    /// The 16-position scores have `ops::dot`'s bits, for K3's widths (rank 512, rope 64)
    /// and k3-0.40b's (128, 32), values of mixed sign and magnitude.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sixteen_scores_at_once_have_the_dot_bits() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("no avx512f on this CPU: nothing to compare");
            return;
        }
        let mut rng = fastrand::Rng::with_seed(11);
        for (rank, rope) in [(128usize, 32usize), (512, 64), (16, 16)] {
            let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-8..8));
            let q: Vec<f32> = (0..rank).map(|_| value()).collect();
            let q_pe: Vec<f32> = (0..rope).map(|_| value()).collect();
            let latent: Vec<f32> = (0..16 * rank).map(|_| value()).collect();
            let pe: Vec<f32> = (0..16 * rope).map(|_| value()).collect();
            let scale = 0.0723;
            // SAFETY: avx512f was detected above.
            let got = unsafe { x86::scores16(&q, &q_pe, &latent, &pe, scale) };
            for l in 0..16 {
                let want = (dot(&q, &latent[l * rank..(l + 1) * rank])
                    + dot(&q_pe, &pe[l * rope..(l + 1) * rope]))
                    * scale;
                assert_eq!(got[l].to_bits(), want.to_bits(), "rank {rank}, row {l}");
            }
        }
    }

    /// The 4-position AVX2 scores have `ops::dot`'s bits, for K3's widths and k3-0.40b's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_scores_at_once_have_the_dot_bits() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("no avx2 on this CPU: nothing to compare");
            return;
        }
        let mut rng = fastrand::Rng::with_seed(12);
        for (rank, rope) in [(128usize, 32usize), (512, 64), (16, 16)] {
            let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-8..8));
            let q: Vec<f32> = (0..rank).map(|_| value()).collect();
            let q_pe: Vec<f32> = (0..rope).map(|_| value()).collect();
            let latent: Vec<f32> = (0..4 * rank).map(|_| value()).collect();
            let pe: Vec<f32> = (0..4 * rope).map(|_| value()).collect();
            let scale = 0.0723;
            // SAFETY: avx2 was detected above.
            let got = unsafe { x86::scores4(&q, &q_pe, &latent, &pe, scale) };
            for l in 0..4 {
                let want = (dot(&q, &latent[l * rank..(l + 1) * rank])
                    + dot(&q_pe, &pe[l * rope..(l + 1) * rope]))
                    * scale;
                assert_eq!(got[l].to_bits(), want.to_bits(), "rank {rank}, row {l}");
            }
        }
    }

    /// `weighted_rows` sums each value in position order from 0.0, as the loop over positions
    /// with the whole vector per position did: the same bits, for widths that are and are not
    /// multiples of its 32-value stripes (K3: rank 512; k3-0.40b: 128), in one call or a call
    /// per block of positions continuing the sums (`heads_context`'s blocks).
    #[test]
    fn weighted_rows_keep_the_position_order() {
        let mut rng = fastrand::Rng::with_seed(7);
        for width in [128usize, 512, 40, 33, 5] {
            for positions in [1usize, 2, 17, 100] {
                let weights: Vec<f32> = (0..positions).map(|_| rng.f32()).collect();
                let latent: Vec<f32> = (0..positions * width).map(|_| rng.f32() - 0.5).collect();
                let mut plain = vec![0.0f32; width];
                for (p, &w) in weights.iter().enumerate() {
                    for (a, &v) in plain.iter_mut().zip(&latent[p * width..(p + 1) * width]) {
                        *a += w * v;
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                #[cfg(target_arch = "x86_64")]
                let avx2 = std::arch::is_x86_feature_detected!("avx2");
                #[cfg(not(target_arch = "x86_64"))]
                let avx2 = false;
                for (block, avx2) in [
                    (positions, false),
                    (16, false),
                    (3, false),
                    (16, avx2),
                    (3, avx2),
                ] {
                    let mut striped = vec![0.0f32; width];
                    for start in (0..positions).step_by(block) {
                        let end = (start + block).min(positions);
                        weighted_rows(
                            &weights[start..end],
                            &latent[start * width..end * width],
                            &mut striped,
                            avx2,
                        );
                    }
                    assert_eq!(
                        bits(&plain),
                        bits(&striped),
                        "width {width}, {positions} positions in blocks of {block}, avx2 {avx2}"
                    );
                }
            }
        }
    }
}
