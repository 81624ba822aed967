//! MLA attention over a sequence's latent cache for one (token, head) query in the absorbed
//! form (docs/MODEL.md §7.3): scores against every cached position, softmax, the weighted sum
//! of the latents, then the head's value rows.
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
}

/// One attention task's buffers, reused for each (token, head) it computes.
#[derive(Default)]
pub(super) struct HeadBuffers {
    q_abs: Vec<f32>,
    scores: Vec<f32>,
    ctx_latent: Vec<f32>,
}

/// `ctx[j] = Σ_p weights[p] · latent[p][j]` over the rows of `latent` (`ctx.len()` values
/// each), every sum in position order from 0.0: 32 sums at a time held in registers while
/// the positions stream past, instead of the whole vector loaded and stored per position.
#[inline(always)]
fn weighted_rows(weights: &[f32], latent: &[f32], ctx: &mut [f32]) {
    const STRIPE: usize = 32;
    let width = ctx.len();
    let mut start = 0;
    while start + STRIPE <= width {
        let mut acc = [0.0f32; STRIPE];
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
        let mut acc = 0.0f32;
        for (p, &w) in weights.iter().enumerate() {
            acc += w * latent[p * width + j];
        }
        *c = acc;
    }
}

/// One head's context for one token (docs/MODEL.md §7.3): `q` is the head's query (nope then
/// rope parts), `rows` its `kv_b` rows, and the token attends to the first `positions` rows of
/// the cache. Inlined into `wide`'s AVX-512 function, with plain loops and reused buffers: as
/// a closure with iterator `collect`s it was compiled outside it at baseline width, and
/// `exp`'s `mul_add` and rounding became libm calls (PERFORMANCE.md, phase 20).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn head_context(
    d: &Dims,
    cache: &MlaCache,
    positions: usize,
    q: &[f32],
    rows: &[f32],
    out: &mut [f32],
    buf: &mut HeadBuffers,
) {
    let (nope, rope, rank) = (d.nope, d.rope, d.rank);
    // q_abs = W_UKᵀ q_nope: [rank].
    let q_abs = &mut buf.q_abs;
    q_abs.clear();
    q_abs.resize(rank, 0.0);
    for (i, &qi) in q[..nope].iter().enumerate() {
        for (a, &wv) in q_abs.iter_mut().zip(&rows[i * rank..(i + 1) * rank]) {
            *a += qi * wv;
        }
    }
    let q_pe = &q[nope..];
    let scores = &mut buf.scores;
    scores.clear();
    scores.resize(positions, 0.0);
    for (p, s) in scores.iter_mut().enumerate() {
        let c = &cache.latent[p * rank..(p + 1) * rank];
        let pe = &cache.k_pe[p * rope..(p + 1) * rope];
        *s = (dot(q_abs, c) + dot(q_pe, pe)) * d.scale;
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s = mxfp4_kernels::vmath::exp(*s - max);
    }
    let total = scores.iter().fold(0.0f32, |a, &e| a + e);
    for s in scores.iter_mut() {
        *s /= total;
    }
    let ctx_latent = &mut buf.ctx_latent;
    ctx_latent.clear();
    ctx_latent.resize(rank, 0.0);
    weighted_rows(scores, &cache.latent[..positions * rank], ctx_latent);
    // ctx_h = W_UV ctx_latent: [v_head_dim].
    for (j, o) in out.iter_mut().enumerate() {
        let wrow = &rows[(nope + j) * rank..(nope + j + 1) * rank];
        *o = dot(wrow, ctx_latent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `weighted_rows` sums each value in position order from 0.0, as the loop over positions
    /// with the whole vector per position did: the same bits, for widths that are and are not
    /// multiples of its 32-value stripes (K3: rank 512; k3-0.40b: 128).
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
                let mut striped = vec![1.0f32; width];
                weighted_rows(&weights, &latent, &mut striped);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&plain),
                    bits(&striped),
                    "width {width}, {positions} positions"
                );
            }
        }
    }
}
