//! Kimi Delta Attention over a chunk of several sequences' tokens (docs/MODEL.md §6).

use super::error::Result;
use super::forward::Model;
use super::session::{KdaInputs, KdaJournal, KdaState};
use super::weights::Kda;
use super::wide::wide;
use crate::ops::{
    conv_step, kda_decays_in_place, kda_step, l2_norm, rms_norm, sigmoid, silu_in_place,
};

/// One sequence's KDA state in a pass: its state, its journal when a checkpoint is armed (the
/// tokens' recurrence inputs are kept there), and the span of the pass's tokens that is its.
pub(super) type KdaSlot<'s> = (
    &'s mut KdaState,
    Option<&'s mut KdaJournal>,
    std::ops::Range<usize>,
);

impl Model<'_> {
    /// KDA over the tokens of several sequences: `states[i]` is a sequence's state, its
    /// journal if armed, and the span of `xs` that is its tokens (in order). Projections read
    /// their weights once for all tokens; each sequence's recurrence runs on its own state.
    pub(super) fn kda(
        &self,
        w: &Kda<'_>,
        states: Vec<KdaSlot<'_>>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (heads, dim) = (c.kda.num_heads, c.kda.head_dim);
        // One dispatch for the six projections of the normed input.
        let [q, k, v, gates, f_a, beta_logits]: [Vec<Vec<f32>>; 6] = self
            .gemm_many(&[&w.q, &w.k, &w.v, &w.g, &w.f_a, &w.b], xs)?
            .try_into()
            .expect("six matrices in, six results out");
        let projections = [q, k, v];
        let f = self.gemm(&w.f_b, &f_a)?;
        let inputs = RecurrenceInputs {
            projections: &projections,
            decay: &f,
            beta_logits: &beta_logits,
            gates: Some(&gates),
        };
        let mut ys = Vec::with_capacity(xs.len());
        for (s, journal, span) in states {
            if let Some(journal) = journal {
                journal.inputs.extend(span.clone().map(|t| KdaInputs {
                    projections: std::array::from_fn(|j| projections[j][t].clone()),
                    decay: f[t].clone(),
                    beta_logits: beta_logits[t].clone(),
                }));
            }
            ys.extend(self.kda_recurrence(w, s, &inputs, span)?);
        }
        // Under several ranks only rank 0 holds the sequences' states: its outputs go to all.
        self.share_attention(&mut ys, xs.len(), heads * dim);
        self.gemm(&w.o, &ys)
    }

    /// Replays `inputs` (tokens kept in a journal) through `s`'s conv windows and state, as the
    /// pass that fed them did (the same code, so the same bits); no output is made.
    pub(super) fn kda_replay(
        &self,
        w: &Kda<'_>,
        s: &mut KdaState,
        inputs: &[KdaInputs],
    ) -> Result<()> {
        let projections: [Vec<Vec<f32>>; 3] =
            std::array::from_fn(|j| inputs.iter().map(|x| x.projections[j].clone()).collect());
        let decay: Vec<Vec<f32>> = inputs.iter().map(|x| x.decay.clone()).collect();
        let beta_logits: Vec<Vec<f32>> = inputs.iter().map(|x| x.beta_logits.clone()).collect();
        let replay = RecurrenceInputs {
            projections: &projections,
            decay: &decay,
            beta_logits: &beta_logits,
            gates: None,
        };
        self.kda_recurrence(w, s, &replay, 0..inputs.len())?;
        Ok(())
    }

    #[allow(clippy::needless_range_loop)] // `head` indexes several per-head arrays
    /// The conv windows and recurrence of one sequence over the tokens `span` of `inputs`, in
    /// order; the outputs (normed, gated) when `inputs.gates` is given, else empty rows. Reads
    /// only the layer's vectors (conv taps, decays, norm), never its matrices.
    fn kda_recurrence(
        &self,
        w: &Kda<'_>,
        s: &mut KdaState,
        inputs: &RecurrenceInputs<'_>,
        span: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (heads, dim, taps) = (c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel);
        let RecurrenceInputs {
            projections,
            decay: f,
            beta_logits,
            gates,
        } = *inputs;
        let scale = (dim as f32).powf(-0.5);
        let mut ys = Vec::with_capacity(span.len());
        // Head groups as tasks: each owns its heads' conv windows and states and runs the
        // chunk's tokens in order; heads are independent, so grouping cannot change a bit.
        let state_bytes = heads * dim * dim * 4 * span.len();
        let groups = if state_bytes < self.parallel_min_bytes {
            1
        } else {
            self.pool.threads().min(heads)
        };
        let per = heads.div_ceil(groups);
        let hist = taps - 1;
        let [wq, wk, wv] = &mut s.windows;
        let owned: Vec<std::sync::Mutex<[&mut [f32]; 4]>> = wq
            .chunks_mut(per * dim * hist)
            .zip(wk.chunks_mut(per * dim * hist))
            .zip(wv.chunks_mut(per * dim * hist))
            .zip(s.state.chunks_mut(per * dim * dim))
            .map(|(((a, b), c), d)| std::sync::Mutex::new([a, b, c, d]))
            .collect();
        let group = |g: usize| -> Vec<Vec<f32>> {
            wide(
                &self.kernels,
                #[inline(always)]
                || {
                    let mut guard = owned[g].lock().expect("each group is locked by one task");
                    let [wq, wk, wv, state] = &mut *guard;
                    let first = g * per;
                    let count = state.len() / (dim * dim);
                    let channels = first * dim..(first + count) * dim;
                    let mut o = vec![0.0; dim];
                    let mut ys = Vec::with_capacity(span.len());
                    for t in span.clone() {
                        // The conv windows and the recurrent state advance token by token.
                        let mut qkv: [Vec<f32>; 3] =
                            std::array::from_fn(|_| vec![0.0; count * dim]);
                        let windows: [&mut [f32]; 3] = [&mut **wq, &mut **wk, &mut **wv];
                        for (((out, proj), weights), window) in qkv
                            .iter_mut()
                            .zip(projections.iter())
                            .zip(&w.conv)
                            .zip(windows)
                        {
                            let taps_range = channels.start * taps..channels.end * taps;
                            conv_step(
                                &proj[t][channels.clone()],
                                &weights[taps_range],
                                taps,
                                window,
                                out,
                            );
                        }
                        // The group's SiLUs, decays and output gates, 16 channels at a time.
                        for x in &mut qkv {
                            silu_in_place(&self.kernels, x);
                        }
                        let mut alpha: Vec<f32> = channels
                            .clone()
                            .map(|ch| f[t][ch] + w.dt_bias[ch])
                            .collect();
                        let heads_a_log = &w.a_log[first..first + count];
                        kda_decays_in_place(
                            &self.kernels,
                            c.kda.gate,
                            heads_a_log,
                            dim,
                            &mut alpha,
                        );
                        let gate = gates.map(|gates| {
                            let mut gate = gates[t][channels.clone()].to_vec();
                            self.kernels.sigmoid_in_place(&mut gate);
                            gate
                        });
                        let [q, k, v] = &mut qkv;
                        let mut y = vec![0.0; if gate.is_some() { count * dim } else { 0 }];
                        for local in 0..count {
                            let head = first + local;
                            let range = local * dim..(local + 1) * dim;
                            l2_norm(&mut q[range.clone()]);
                            q[range.clone()].iter_mut().for_each(|a| *a *= scale);
                            l2_norm(&mut k[range.clone()]);
                            let head_state = &mut state[local * dim * dim..(local + 1) * dim * dim];
                            let beta = sigmoid(beta_logits[t][head]);
                            kda_step(
                                head_state,
                                &q[range.clone()],
                                &k[range.clone()],
                                &v[range.clone()],
                                &alpha[range.clone()],
                                beta,
                                &mut o,
                            );
                            let Some(gate) = &gate else { continue };
                            let out = &mut y[range.clone()];
                            rms_norm(&o, Some(&w.o_norm), c.rms_norm_eps, out);
                            for (a, &g) in out.iter_mut().zip(&gate[range]) {
                                *a *= g;
                            }
                        }
                        ys.push(y);
                    }
                    ys
                },
            )
        };
        let parts = self.run_tasks(
            owned.len() > 1,
            owned.len(),
            |g| self.pool.block_domain(g, owned.len()),
            group,
        )?;
        let width = if gates.is_some() { heads * dim } else { 0 };
        let mut span_ys = vec![vec![0.0; width]; span.len()];
        if width > 0 {
            for (g, part) in parts.into_iter().enumerate() {
                for (y, piece) in span_ys.iter_mut().zip(part) {
                    y[g * per * dim..g * per * dim + piece.len()].copy_from_slice(&piece);
                }
            }
        }
        ys.extend(span_ys);
        Ok(ys)
    }
}

/// What a KDA recurrence reads per token, indexed by the pass's token: the q, k, v projections,
/// the decay projection, the beta logits, and the output gates (none in a replay).
#[derive(Clone, Copy)]
struct RecurrenceInputs<'i> {
    projections: &'i [Vec<Vec<f32>>; 3],
    decay: &'i [Vec<f32>],
    beta_logits: &'i [Vec<f32>],
    gates: Option<&'i [Vec<f32>]>,
}
