//! The dense MLP and the latent MoE block: router, latent down/up projections, shared
//! experts and the weighted sum of the routed experts (which come from the `ExpertSource`).

use expert_store::source::ExpertHooks;

use super::error::Result;
use super::forward::Model;
use super::weights::{Mlp, Moe};
use crate::ops::{rms_norm, route};
use crate::profile::Bucket;

impl Model<'_> {
    pub(super) fn mlp(&self, w: &Mlp<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let [gates, ups]: [Vec<Vec<f32>>; 2] = self
            .gemm_many(&[&w.gate, &w.up], xs)?
            .try_into()
            .expect("two matrices in, two results out");
        let mut hidden = Vec::with_capacity(xs.len());
        for (gate, up) in gates.iter().zip(&ups) {
            let mut h = vec![0.0; gate.len()];
            self.situ.apply(&self.kernels, gate, up, &mut h)?;
            hidden.push(h);
        }
        self.gemm(&w.down, &hidden)
    }

    pub(super) fn moe(&self, w: &Moe<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let r = &c.moe.router;
        // The router and the latent down-projection read the same inputs: one dispatch.
        let (logits, zs) = match &w.latent {
            Some((down, _, _)) => {
                let [logits, zs]: [Vec<Vec<f32>>; 2] = self
                    .timed(Bucket::Latent, || self.gemm_many(&[&w.router, down], xs))?
                    .try_into()
                    .expect("two matrices in, two results out");
                (logits, zs)
            }
            None => (
                self.timed(Bucket::Router, || self.gemm(&w.router, xs))?,
                xs.to_vec(),
            ),
        };
        let routes: Vec<(Vec<usize>, Vec<f32>)> = self.timed(Bucket::Router, || {
            logits
                .iter()
                .map(|logits| {
                    route(
                        logits,
                        &w.bias,
                        r.top_k,
                        r.renormalize,
                        r.routed_scaling_factor,
                    )
                })
                .collect()
        });
        let io = zs.first().map_or(0, Vec::len);
        // Each expert runs once for all the chunk's tokens that chose it (batch-invariant, so
        // every token's output equals its one-token run); outputs[t][k] is token t's k-th pick.
        let mut outputs: Vec<Vec<Vec<f32>>> = routes
            .iter()
            .map(|(ids, _)| vec![vec![0.0; io]; ids.len()])
            .collect();
        let mut needed: Vec<usize> = routes.iter().flat_map(|(ids, _)| ids.clone()).collect();
        needed.sort_unstable();
        needed.dedup();
        self.experts_asked
            .fetch_add(needed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        // The layer's experts from their source, in batches as they are ready; the shared
        // experts overlap the loads when there are any.
        let mut shared = None;
        self.experts.experts(
            w.layer,
            &needed,
            ExpertHooks {
                overlap: &mut || {
                    if let Some(mlp) = &w.shared {
                        shared = Some(self.timed(Bucket::SharedExperts, || self.mlp(mlp, xs))?);
                    }
                    Ok(())
                },
                wait: &|wait| self.timed(Bucket::LoadWait, || self.waiting(wait)),
                run: &mut |experts| {
                    self.timed(Bucket::RoutedExperts, || {
                        self.run_experts(w.layer, experts, &routes, &zs, &mut outputs)
                    })
                },
            },
        )?;
        // Per token, the weighted sum in the router's order.
        let mut routed: Vec<Vec<f32>> = Vec::with_capacity(xs.len());
        for ((_, weights), outs) in routes.iter().zip(&outputs) {
            let mut sum = vec![0.0f32; io];
            for (&weight, y) in weights.iter().zip(outs) {
                for (s, &o) in sum.iter_mut().zip(y) {
                    *s += weight * o;
                }
            }
            routed.push(sum);
        }
        let mut routed = match &w.latent {
            Some((_, norm, up)) => self.timed(Bucket::Latent, || {
                if let Some(norm) = norm {
                    for y in &mut routed {
                        let raw = y.clone();
                        rms_norm(&raw, Some(norm), c.rms_norm_eps, y);
                    }
                }
                self.gemm(up, &routed)
            })?,
            None => routed,
        };
        let shared = match (shared, &w.shared) {
            (Some(done), _) => Some(done),
            (None, Some(mlp)) => Some(self.timed(Bucket::SharedExperts, || self.mlp(mlp, xs))?),
            (None, None) => None,
        };
        if let Some(shared) = shared {
            for (a, b) in routed.iter_mut().zip(shared) {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
            }
        }
        Ok(routed)
    }
}
