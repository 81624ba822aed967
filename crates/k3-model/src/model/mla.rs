//! Gated MLA in the absorbed form over a chunk of several sequences' tokens (docs/MODEL.md §7).

use super::attend::{Dims, HeadBuffers, HeadQueries, TOKEN_GROUP, heads_context};
use super::error::Result;
use super::forward::Model;
use super::mirror::head_share;
use super::session::MlaCache;
use super::weights::Mla;
use super::wide::wide;
use crate::ops::rms_norm;
use crate::profile::Bucket;

/// The MLA low-rank norms use 1e-6 (HF's default), not `rms_norm_eps` (docs/MODEL.md §7.1).
const MLA_NORM_EPS: f32 = 1e-6;

impl Model<'_> {
    /// Gated MLA over the tokens of several sequences (`caches[i]`: a sequence's cache and the
    /// span of `xs` that is its tokens); projections once for all, attention per sequence.
    pub(super) fn mla(
        &self,
        w: &Mla<'_>,
        caches: Vec<(&mut MlaCache, std::ops::Range<usize>)>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let m = &self.config.mla;
        let (nope, rope, vd, rank) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        // One dispatch for the projections of the normed input (q_a, kv_a and the gate).
        let (qs, ckvs, gates) = self.timed(Bucket::Mla, || -> Result<_> {
            let mut matrices = vec![&w.q_a, &w.kv_a];
            matrices.extend(w.g.as_ref());
            let mut projected = self.gemm_many(&matrices, xs)?.into_iter();
            let (q_a, ckvs) = (
                projected.next().expect("q_a"),
                projected.next().expect("kv_a"),
            );
            let gates = projected.next();
            let q_a: Vec<Vec<f32>> = q_a
                .iter()
                .map(|q| {
                    let mut y = vec![0.0; q.len()];
                    rms_norm(q, Some(&w.q_a_norm), MLA_NORM_EPS, &mut y);
                    y
                })
                .collect();
            Ok((self.gemm(&w.q_b, &q_a)?, ckvs, gates))
        })?;
        let scale = ((nope + rope) as f32).powf(-0.5);
        let ranks = self.pool.ranks();
        let mine = head_share(m.num_heads, ranks.size(), ranks.rank());
        // The attention over the caches (and, under several ranks, the gather of the heads'
        // contexts): its own bucket, apart from the projections.
        let mut ctxs = self.timed(Bucket::MlaAttention, || -> Result<_> {
            let mut ctxs = Vec::with_capacity(xs.len());
            for (cache, span) in caches {
                // Append the chunk's latents and k_pe in token order; token t then attends
                // causally to the cache rows before it and itself.
                let first_position = cache.latent.len() / rank;
                for ckv in &ckvs[span.clone()] {
                    let mut latent = vec![0.0; rank];
                    rms_norm(&ckv[..rank], Some(&w.kv_a_norm), MLA_NORM_EPS, &mut latent);
                    cache.latent.extend_from_slice(&latent);
                    cache.k_pe.extend_from_slice(&ckv[rank..rank + rope]);
                }
                let cache = &*cache;
                let dims = Dims {
                    nope,
                    rope,
                    rank,
                    scale,
                    avx512: super::wide::has_avx512(&self.kernels),
                    avx2: self.kernels.tier() == mxfp4_kernels::Tier::Avx2,
                };
                // This rank's heads (all of them with one rank), as tasks over the read-only
                // cache (heads are independent: each head's bits do not depend on its group).
                let work =
                    mine.len() * span.len() * (first_position + span.len()) * (rank + rope) * 4;
                let groups = if work < self.parallel_min_bytes {
                    1
                } else {
                    self.pool.threads().min(mine.len()).max(1)
                };
                let per = mine.len().div_ceil(groups).max(1);
                let group = |g: usize| -> Vec<Vec<f32>> {
                    wide(
                        &self.kernels,
                        #[inline(always)]
                        || {
                            let heads_here =
                                mine.start + g * per..(mine.start + (g + 1) * per).min(mine.end);
                            let mut buf = HeadBuffers::default();
                            let mut ctxs = Vec::with_capacity(span.len());
                            let rows = &w.kv_b[heads_here.start * (nope + vd) * rank
                                ..heads_here.end * (nope + vd) * rank];
                            let width = heads_here.len() * vd;
                            for group in span.clone().step_by(TOKEN_GROUP) {
                                let group = group..(group + TOKEN_GROUP).min(span.end);
                                let q: Vec<&[f32]> = group
                                    .clone()
                                    .map(|t| {
                                        &qs[t][heads_here.start * (nope + rope)
                                            ..heads_here.end * (nope + rope)]
                                    })
                                    .collect();
                                let mut ctx = vec![0.0; group.len() * width];
                                let positions = first_position + (group.start - span.start) + 1;
                                let queries = HeadQueries { q: &q, rows };
                                heads_context(&dims, cache, positions, queries, &mut ctx, &mut buf);
                                ctxs.extend(ctx.chunks_exact(width).map(<[f32]>::to_vec));
                            }
                            ctxs
                        },
                    )
                };
                let count = mine.len().div_ceil(per);
                let parts = self.run_tasks(
                    count > 1,
                    count,
                    |g| self.pool.block_domain(g, count),
                    group,
                )?;
                // Every head's place in each token's row; other ranks' heads come with the
                // gather below.
                let mut span_ctxs = vec![vec![0.0; m.num_heads * vd]; span.len()];
                for (g, part) in parts.into_iter().enumerate() {
                    let at = (mine.start + g * per) * vd;
                    for (ctx, piece) in span_ctxs.iter_mut().zip(part) {
                        ctx[at..at + piece.len()].copy_from_slice(&piece);
                    }
                }
                ctxs.extend(span_ctxs);
            }
            // Under several ranks each computed its heads: every rank gets every head's context.
            self.gather_heads(&mut ctxs, m.num_heads, vd);
            Ok(ctxs)
        })?;
        self.timed(Bucket::Mla, || {
            if let Some(gates) = gates {
                for (ctx, mut gate) in ctxs.iter_mut().zip(gates) {
                    self.kernels.sigmoid_in_place(&mut gate);
                    for (a, &g) in ctx.iter_mut().zip(&gate) {
                        *a *= g;
                    }
                }
            }
            self.gemm(&w.o, &ctxs)
        })
    }
}

impl Model<'_> {
    /// Every head's context on every rank: rank `r` computed heads
    /// [`head_share`]`(heads, ranks, r)` of each token's `ctxs[t]` (`width` values per head);
    /// one all-gather ([`Model::gather_shares`]), each value the bits its rank computed.
    fn gather_heads(&self, ctxs: &mut [Vec<f32>], heads: usize, width: usize) {
        let ranks = self.pool.ranks();
        let shares: Vec<_> = (0..ranks.size())
            .map(|r| {
                let h = head_share(heads, ranks.size(), r);
                h.start * width..h.end * width
            })
            .collect();
        let rows: Vec<&mut [f32]> = ctxs.iter_mut().map(Vec::as_mut_slice).collect();
        self.gather_shares(&mut [rows], &[shares]);
    }
}
