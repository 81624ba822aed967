//! MLA attention over a sequence's latent cache for consecutive tokens' queries of a run of
//! heads, in the absorbed form (docs/MODEL.md §7.3): per token and head, scores against every
//! cached position, softmax, the weighted sum of the latents, then the head's value rows.
//!
//! Every sum keeps the order of the straightforward loops (`ops::dot` for the scores and the
//! value rows, position order for the weighted latents), so the bits are those of decoding
//! token by token whatever the chunk.

use super::lines::Lines;
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

/// One attention task's buffers, reused for each group of tokens it computes.
#[derive(Default)]
pub(super) struct HeadBuffers {
    /// Each token's and head's `W_UKᵀ q_nope`, `rank` values each (line-aligned as the cache).
    q_abs: Lines,
    /// Each head's scores, then weights, over the token's positions, `positions` per head.
    scores: Vec<f32>,
    /// Each token's and head's weighted latents, `rank` values each (line-aligned as the cache).
    ctx_latent: Lines,
}

/// Positions of the cache one pass over the task's heads reads before the next, where no
/// SIMD kernel applies: 16 rows of K3's 512 + 64 f32 are 36 KiB, read from memory once and
/// then from L1/L2 for every head of the task, where a head at a time read the whole cache
/// once per head (96 times per token at K3's width, from memory once it outgrows the caches).
const POSITION_BLOCK: usize = 16;

/// The scores' block for the SIMD score kernels (AVX-512 and AVX2): 8 rows (18 KiB at K3's
/// widths) stay in a 32 KiB L1 beside a pair of heads' queries, while every pair of heads
/// goes over them; 16 rows (36 KiB) came from L2 for every pair. Zen 3, AVX2, one thread, 48
/// heads over 4096 positions, alternated: 4.3–6.1 ms against 6.4–7.9 (PERFORMANCE.md phase
/// 27); Zen 4, AVX-512, 65,536 positions: PERFORMANCE.md phase 32.
const SCORE_BLOCK: usize = 8;

/// The weighted latents' block on AVX-512: the block's rows go one stripe of columns at a
/// time ([`x86::weighted_stripe2`]), every pair of heads over a stripe before the next, so the
/// stripe (32 positions of 128 columns, 16 KiB) stays in L1 for all of them and each pair's
/// sums are loaded and stored once per 32 positions. With 16-position blocks taken whole per
/// pair, the block (32 KiB at K3's rank) came from L2 for every pair (PERFORMANCE.md phase
/// 32).
const LATENT_BLOCK: usize = 32;

/// `ctx[j] += Σ_p weights[p] · latent[p][j]` over the rows of `latent` (`ctx.len()` values
/// each), each sum continuing in position order from the value `ctx[j]` holds (`w ·
/// latent[p][j]` fused into it: `mul_add`, one rounding per position). From `ctx` zeroed, a
/// call per block of positions in order gives the bits of one call over them all. On AVX2
/// ([`x86::weighted_rows_stripes`]) 64 sums at a time (32 where the width is not a multiple
/// of 64) stay in registers while the block's positions stream past; as an `[f32; 32]` array
/// the compiler kept them in memory, each position's add waiting on the last one's store (10
/// GMAC/s on a Zen 3 core, PERFORMANCE.md phase 25).
#[inline(always)]
fn weighted_rows(weights: &[f32], latent: &[f32], ctx: &mut [f32], avx2: bool) {
    const STRIPE: usize = 32;
    let width = ctx.len();
    let mut start = 0;
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        start = width / STRIPE * STRIPE;
        // SAFETY: `avx2` is set only where the kernels' tier proves avx2; `latent` holds
        // `weights.len()` rows of `width` values (the callers' slices); `start` is a multiple
        // of the stripes' width.
        unsafe {
            if width.is_multiple_of(2 * STRIPE) {
                x86::weighted_rows_stripes::<8>(weights, latent, &mut ctx[..start], width)
            } else {
                x86::weighted_rows_stripes::<4>(weights, latent, &mut ctx[..start], width)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;
    while start + STRIPE <= width {
        let mut acc = [0.0f32; STRIPE];
        acc.copy_from_slice(&ctx[start..start + STRIPE]);
        for (p, &w) in weights.iter().enumerate() {
            let row = &latent[p * width + start..p * width + start + STRIPE];
            for j in 0..STRIPE {
                acc[j] = w.mul_add(row[j], acc[j]);
            }
        }
        ctx[start..start + STRIPE].copy_from_slice(&acc);
        start += STRIPE;
    }
    for (j, c) in ctx.iter_mut().enumerate().skip(start) {
        let mut acc = *c;
        for (p, &w) in weights.iter().enumerate() {
            acc = w.mul_add(latent[p * width + j], acc);
        }
        *c = acc;
    }
}

/// Tokens of one sequence that [`heads_context`] takes together: each head's `kv_b` rows
/// (`(nope + v_head_dim) × rank` f32, 50 MB per token at K3's 96 heads) are read once per
/// group instead of once per token, and a group's absorbed queries and weighted latents (8
/// rows of `rank` per head, 16 KiB at K3's rank) stay in L1 beside the row they meet.
pub(super) const TOKEN_GROUP: usize = 8;

/// Consecutive tokens' queries as [`heads_context`] reads them: per token and head, its
/// query (nope then rope parts), and per head its `kv_b` rows (`nope + v_head_dim` rows of
/// `rank`).
pub(super) struct HeadQueries<'a> {
    /// Per token, `heads × (nope + rope)` values.
    pub(super) q: &'a [&'a [f32]],
    /// `heads × (nope + v_head_dim) × rank` values.
    pub(super) rows: &'a [f32],
}

/// The contexts of consecutive heads for consecutive tokens of one sequence (docs/MODEL.md
/// §7.3): token `t` of `queries.q` attends to the first `positions + t` rows of the cache;
/// `out` holds, per token, `v_head_dim` values per head. Each token's and head's arithmetic
/// is the straightforward loops' (module docs), so the bits do not depend on how tokens are
/// grouped: the absorption (`W_UKᵀ q_nope`) and the value rows loop over the tokens inside
/// each `kv_b` row, so a row is read once for the group; the cache is read in blocks of
/// [`SCORE_BLOCK`] positions for the scores and [`LATENT_BLOCK`] for the weighted latents
/// (with the SIMD kernels; [`POSITION_BLOCK`] without), each block for every head before the
/// next, so it is read once per token and task instead of once per head; the scores (AVX2,
/// AVX-512) and the weighted latents (AVX-512) go two heads at a time, each loaded row piece
/// serving both.
/// Inlined into `wide`'s function, with plain loops and reused buffers: as a closure with
/// iterator `collect`s it was compiled outside it at baseline width, and `exp`'s `mul_add`
/// and rounding became libm calls (PERFORMANCE.md, phase 20).
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
    let tokens = queries.q.len();
    let heads = queries.q.first().map_or(0, |q| q.len() / head_q);
    if heads == 0 {
        return;
    }
    let v_dim = out.len() / (tokens * heads);
    let head_rows = (nope + v_dim) * rank;
    // q_abs = W_UKᵀ q_nope, per token and head: [rank], each sum in nope order.
    let q_abs = &mut buf.q_abs;
    q_abs.set_zeros(tokens * heads * rank);
    for h in 0..heads {
        let rows = &queries.rows[h * head_rows..h * head_rows + nope * rank];
        for (i, row) in rows.chunks_exact(rank).enumerate() {
            for (t, q) in queries.q.iter().enumerate() {
                let qi = q[h * head_q + i];
                let at = (t * heads + h) * rank;
                for (a, &wv) in q_abs[at..at + rank].iter_mut().zip(row) {
                    *a += qi * wv;
                }
            }
        }
    }
    let ctx_latent = &mut buf.ctx_latent;
    ctx_latent.set_zeros(tokens * heads * rank);
    for (t, q) in queries.q.iter().enumerate() {
        let span = t * heads * rank..(t + 1) * heads * rank;
        token_latents(
            d,
            cache,
            positions + t,
            (&q_abs[span.clone()], q),
            &mut buf.scores,
            &mut ctx_latent[span],
        );
    }
    // ctx_h = W_UV ctx_latent: [v_head_dim], per token and head.
    for h in 0..heads {
        let rows = &queries.rows[h * head_rows + nope * rank..(h + 1) * head_rows];
        for (j, row) in rows.chunks_exact(rank).enumerate() {
            for t in 0..tokens {
                let at = (t * heads + h) * rank;
                out[(t * heads + h) * v_dim + j] = dot(row, &ctx_latent[at..at + rank]);
            }
        }
    }
}

/// One token's weighted latents per head, into `ctx_latent` (zeroed, `rank` per head): its
/// scores against the first `positions` rows of the cache (`q_abs` per head, the rope part
/// of `q`), the softmax, the latents summed in position order.
#[inline(always)]
fn token_latents(
    d: &Dims,
    cache: &MlaCache,
    positions: usize,
    (q_abs, q): (&[f32], &[f32]),
    scores: &mut Vec<f32>,
    ctx_latent: &mut [f32],
) {
    let (nope, rope, rank) = (d.nope, d.rope, d.rank);
    let head_q = nope + rope;
    let heads = q.len() / head_q;
    scores.clear();
    scores.resize(heads * positions, 0.0);
    // The AVX2 score kernels (AVX-512's, where the CPU has it).
    let avx2_scores = d.avx2 && !d.avx512;
    let score_block_len = if avx2_scores || d.avx512 {
        SCORE_BLOCK
    } else {
        POSITION_BLOCK
    };
    let mut block_start = 0;
    while block_start < positions {
        let block_end = (block_start + score_block_len).min(positions);
        let mut h = 0;
        #[cfg(target_arch = "x86_64")]
        if (d.avx512 || avx2_scores) && rank.is_multiple_of(16) && rope.is_multiple_of(16) {
            // The next block's rows, a share before each pair of heads (from memory once the
            // cache outgrows L3; PERFORMANCE.md phase 33).
            let next = block_end..(block_end + score_block_len).min(positions);
            let (next_latent, next_pe) = rows(cache, next, d);
            let pairs = heads / 2;
            while h + 2 <= heads {
                x86::prefetch_share(next_latent, h / 2, pairs);
                x86::prefetch_share(next_pe, h / 2, pairs);
                let q_abs = [
                    &q_abs[h * rank..(h + 1) * rank],
                    &q_abs[(h + 1) * rank..(h + 2) * rank],
                ];
                let q_pe = [
                    &q[h * head_q + nope..(h + 1) * head_q],
                    &q[(h + 1) * head_q + nope..(h + 2) * head_q],
                ];
                let (first, second) =
                    scores[h * positions..(h + 2) * positions].split_at_mut(positions);
                score_pair_block(
                    d,
                    cache,
                    q_abs,
                    q_pe,
                    block_start..block_end,
                    [first, second],
                );
                h += 2;
            }
        }
        for h in h..heads {
            let q_abs = &q_abs[h * rank..(h + 1) * rank];
            let q_pe = &q[h * head_q + nope..(h + 1) * head_q];
            let scores = &mut scores[h * positions..(h + 1) * positions];
            score_block(d, cache, q_abs, q_pe, block_start..block_end, scores);
        }
        block_start = block_end;
    }
    softmax_heads(scores, heads, positions);
    let avx512_latents = cfg!(target_arch = "x86_64") && d.avx512 && rank.is_multiple_of(64);
    let latent_block_len = if avx512_latents {
        LATENT_BLOCK
    } else {
        POSITION_BLOCK
    };
    let mut block_start = 0;
    while block_start < positions {
        let block_end = (block_start + latent_block_len).min(positions);
        let latent = &cache.latent[block_start * rank..block_end * rank];
        let mut h = 0;
        #[cfg(target_arch = "x86_64")]
        if avx512_latents {
            let stripe = if rank.is_multiple_of(128) { 128 } else { 64 };
            let next_end = (block_end + latent_block_len).min(positions);
            let next = &cache.latent[block_end * rank..next_end * rank];
            let shares = rank / stripe * (heads / 2);
            for (s, start) in (0..rank).step_by(stripe).enumerate() {
                for pair in 0..heads / 2 {
                    x86::prefetch_share(next, s * (heads / 2) + pair, shares);
                    let h = 2 * pair;
                    let weights = [
                        &scores[h * positions + block_start..h * positions + block_end],
                        &scores[(h + 1) * positions + block_start..(h + 1) * positions + block_end],
                    ];
                    let (first, second) = ctx_latent[h * rank..(h + 2) * rank].split_at_mut(rank);
                    // SAFETY: `d.avx512` is set only where the kernels' tier proves avx512f;
                    // the block holds `weights[h].len()` rows of `rank` values, and the stripe
                    // `start..start + stripe` lies in them and in both heads' `rank` sums.
                    unsafe {
                        if stripe == 128 {
                            x86::weighted_stripe2::<8>(
                                weights,
                                latent,
                                [first, second],
                                rank,
                                start,
                            );
                        } else {
                            x86::weighted_stripe2::<4>(
                                weights,
                                latent,
                                [first, second],
                                rank,
                                start,
                            );
                        }
                    }
                }
            }
            h = heads / 2 * 2;
        }
        for h in h..heads {
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
}

/// Heads whose sums [`softmax_heads`] runs side by side.
const SOFTMAX_CHAINS: usize = 8;

/// Each head's `positions` scores (rows of `scores`) replaced by their softmax: the max, each
/// `e^(s - max)`, their sum in position order, each divided by it — the straightforward loops'
/// bits. The sum's adds wait on each other one head at a time (65,536 adds of 3 cycles' latency
/// per head at 64k), so [`SOFTMAX_CHAINS`] heads' sums run side by side, each still in position
/// order. The max goes over 16 lanes, then across them: the maximum of the same values, so the
/// same value as one pass in order (NaNs are skipped by `f32::max` either way, and a zero's
/// sign, which may differ, changes no `s - max` for a nonzero `s` and no `e^(s - max)`).
#[inline(always)]
fn softmax_heads(scores: &mut [f32], heads: usize, positions: usize) {
    if positions == 0 {
        return;
    }
    for first in (0..heads).step_by(SOFTMAX_CHAINS) {
        let group = SOFTMAX_CHAINS.min(heads - first);
        let rows = &mut scores[first * positions..(first + group) * positions];
        for row in rows.chunks_exact_mut(positions) {
            let mut lanes = [f32::NEG_INFINITY; 16];
            let (body, tail) = row.split_at(positions / 16 * 16);
            for chunk in body.chunks_exact(16) {
                for (lane, &v) in lanes.iter_mut().zip(chunk) {
                    *lane = lane.max(v);
                }
            }
            let max = lanes
                .iter()
                .chain(tail)
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            for v in row.iter_mut() {
                *v = mxfp4_kernels::vmath::exp(*v - max);
            }
        }
        let mut totals = [0.0f32; SOFTMAX_CHAINS];
        for p in 0..positions {
            for (k, total) in totals[..group].iter_mut().enumerate() {
                *total += rows[k * positions + p];
            }
        }
        for (row, &total) in rows.chunks_exact_mut(positions).zip(&totals) {
            for v in row.iter_mut() {
                *v /= total;
            }
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
    if d.avx512 && block.len() == 8 && rank.is_multiple_of(16) && rope.is_multiple_of(16) {
        let p = block.start;
        let (latent, pe) = rows(cache, p..p + 8, d);
        // SAFETY: `d.avx512` is set only where the kernels' tier proves avx512f; the
        // widths are multiples of 16 and the slices hold 8 rows of each. The head goes as
        // both of the kernel's queries (each query's bits are its own).
        let s = unsafe { x86::scores2x8([q_abs; 2], [q_pe; 2], latent, pe, d.scale) };
        scores[block].copy_from_slice(&s[0]);
        return;
    }
    let mut block = block;
    #[cfg(target_arch = "x86_64")]
    if d.avx2 && rank.is_multiple_of(16) && rope.is_multiple_of(16) {
        while block.len() >= 4 {
            let p = block.start;
            let (latent, pe) = rows(cache, p..p + 4, d);
            // SAFETY: `d.avx2` is set only where the kernels' tier proves avx2; the widths
            // are multiples of 16 and the slices hold 4 rows of each.
            let s = unsafe { x86::scores4(q_abs, q_pe, latent, pe, d.scale) };
            scores[p..p + 4].copy_from_slice(&s);
            block.start += 4;
        }
    }
    for p in block {
        let (c, pe) = rows(cache, p..p + 1, d);
        scores[p] = (dot(q_abs, c) + dot(q_pe, pe)) * d.scale;
    }
}

/// The latent and `k_pe` rows of `positions` in `cache`.
#[inline(always)]
fn rows<'a>(
    cache: &'a MlaCache,
    positions: std::ops::Range<usize>,
    d: &Dims,
) -> (&'a [f32], &'a [f32]) {
    (
        &cache.latent[positions.start * d.rank..positions.end * d.rank],
        &cache.k_pe[positions.start * d.rope..positions.end * d.rope],
    )
}

/// Two heads' scores at positions `block` ([`score_block`]'s, each head's bits its own) on
/// AVX-512 or AVX2 (the caller checked it, and that `rank` and `rope` are multiples of 16):
/// 8 positions at a time in [`x86::scores2x8`] (AVX-512) or 4 in [`x86::scores2x4`], the
/// block's last positions by `dot`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn score_pair_block(
    d: &Dims,
    cache: &MlaCache,
    q_abs: [&[f32]; 2],
    q_pe: [&[f32]; 2],
    block: std::ops::Range<usize>,
    scores: [&mut [f32]; 2],
) {
    let [s0, s1] = scores;
    let step = if d.avx512 { 8 } else { 4 };
    let mut p = block.start;
    while p + step <= block.end {
        let (latent, pe) = rows(cache, p..p + step, d);
        if d.avx512 {
            // SAFETY: `d.avx512` is set only where the kernels' tier proves avx512f; the
            // widths are multiples of 16 and the slices hold 8 rows of each.
            let s = unsafe { x86::scores2x8(q_abs, q_pe, latent, pe, d.scale) };
            s0[p..p + 8].copy_from_slice(&s[0]);
            s1[p..p + 8].copy_from_slice(&s[1]);
        } else {
            // SAFETY: without `d.avx512` the caller runs this only where the kernels' tier
            // proves avx2; the widths are multiples of 16 and the slices hold 4 rows of each.
            let s = unsafe { x86::scores2x4(q_abs, q_pe, latent, pe, d.scale) };
            s0[p..p + 4].copy_from_slice(&s[0]);
            s1[p..p + 4].copy_from_slice(&s[1]);
        }
        p += step;
    }
    for p in p..block.end {
        let (c, pe) = rows(cache, p..p + 1, d);
        for (h, s) in [&mut *s0, &mut *s1].into_iter().enumerate() {
            s[p] = (dot(q_abs[h], c) + dot(q_pe[h], pe)) * d.scale;
        }
    }
}

/// Eight (AVX-512) or four (AVX2) positions' scores at once with `ops::dot`'s bits, and the
/// weighted latents' SIMD loops.
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
