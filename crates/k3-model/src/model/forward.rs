//! The model and its layer loop: embedding, per layer the AttnRes mixes, the token mixer and the
//! MLP or MoE (each in its own file), then the output mix, final norm and lm_head.

use std::sync::Arc;

use expert_store::source::{ExpertSource, MxFp4Matrices};
use expert_store::{Checkpoint, ExpertStore};
use mxfp4_kernels::{Kernels, MAX_TOKENS, Situ, WeightMatrix};
use numa_sched::Pool;

use super::clock::DecodeClock;
use super::error::{ModelError, Result};
use super::session::{KdaState, MlaCache, Session};

use super::trunk::stream::TrunkStream;
use super::weights::{Attention, Ffn, Layer};
use super::wide::wide;
use crate::config::{AttentionKind, K3Config};
use crate::inventory::expert_layout;
use crate::ops::{attn_res_mix, rms_norm};
use crate::plan::Part;
use crate::profile::{Bucket, Profile};

/// The prefill chunk callers should use: the most tokens one kernel call takes, so a prompt of
/// that many tokens reads each weight once and dispatches each layer's work once. Prefill of 64
/// tokens on k3-0.40b at 2 threads: 1430 tokens/s in chunks of 16, 1550 in 32, 1610-1640 in
/// 64 (PERFORMANCE.md, phase 7).
pub const PREFILL_CHUNK: usize = MAX_TOKENS;

/// A K3 model whose weights borrow from a mapped checkpoint.
pub struct Model<'a> {
    /// The validated config the model was built for.
    pub config: K3Config,
    pub(super) kernels: Kernels,
    pub(super) pool: Arc<Pool>,
    /// Work (bytes of weights) below which a dispatch runs on the calling thread.
    pub(super) parallel_min_bytes: usize,
    pub(super) situ: Situ,
    pub(super) embed: WeightMatrix<'a>,
    pub(super) lm_head: WeightMatrix<'a>,
    pub(super) final_norm: Vec<f32>,
    pub(super) output_res_score: Vec<f32>,
    pub(super) layers: Vec<Layer<'a>>,
    /// The trunk as the memory plan places it: resident, or read from disk every step
    /// ([`Model::with_planned_trunk`]).
    pub(super) trunk: Option<TrunkStream>,
    /// Where routed experts come from (the checkpoint's mapping, an expert store, ...): one
    /// indirect call per MoE layer and batch of experts (see [`source`]).
    pub(super) experts: Box<dyn ExpertSource<MxFp4Matrices<3>, ModelError> + 'a>,
    pub(super) expert_placement: ExpertPlacement,
    /// Wall time by bucket, when asked for ([`Model::with_profile`]).
    pub(super) profile: Option<Arc<Profile>>,
    /// Where one-token passes add their compute time, when an engine keeps one
    /// ([`Model::with_decode_clock`]).
    pub(super) clock: Option<Arc<DecodeClock>>,
    /// Nanoseconds this model's passes have waited for reads (routed experts, the stream).
    pub(super) waited_ns: std::sync::atomic::AtomicU64,
    /// Routed experts asked of the source, one per (layer, distinct expert) of each pass.
    pub(super) experts_asked: std::sync::atomic::AtomicU64,
    /// Several ranks: the next id a sequence gets at its first step, and the ids of dropped
    /// sequences the other ranks still mirror ([`super::mirror`]).
    pub(super) mirror_ids: std::sync::atomic::AtomicU64,
    pub(super) gone: super::mirror::Gone,
}

/// Which of a group's tokens need logits in a step (the lm_head is a large share of a step,
/// so only the rows asked for are computed; batch-invariant, so the choice changes no bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// After every token (scoring, and a verify pass of drafted tokens).
    All,
    /// After the group's last token (a decode, a prompt's last chunk).
    Last,
    /// None (prompt chunks before the last).
    None,
}

/// Where a routed expert's work runs when the pool has several domains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPlacement {
    /// Every expert's rows spread over all domains, like the trunk's (the default: each domain
    /// reads 1/D of every selected expert, so no domain waits on an unlucky draw; see
    /// `cargo xtask numa-model` and PERFORMANCE.md).
    #[default]
    Split,
    /// Each expert whole on its home domain (`ExpertStore::place`, else id modulo domains).
    Home,
}

impl std::fmt::Debug for Model<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("layers", &self.layers.len())
            .field("tier", &self.kernels.tier())
            .finish()
    }
}

impl<'a> Model<'a> {
    /// Builds the model over a checkpoint (validate it first with [`crate::checks::validate::validate`]),
    /// routed experts read through the file mapping.
    pub fn new(ckpt: &'a Checkpoint, config: &K3Config, kernels: Kernels) -> Result<Self> {
        Self::load(ckpt, config, kernels, None)
    }

    /// Builds the model with its routed experts served by `store` (opened over the same
    /// checkpoint with [`expert_layout`]); no expert byte is touched here. Logits are the same
    /// bits as [`Model::new`]'s, whatever the store's capacity, policy or preload.
    pub fn with_expert_store(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        store: Arc<ExpertStore>,
    ) -> Result<Self> {
        let layout = expert_layout(config);
        if *store.layout() != layout {
            return Err(ModelError::StoreLayout {
                store: store.layout().to_string(),
                config: layout.to_string(),
            });
        }
        Self::with_expert_source(ckpt, config, kernels, Box::new(store))
    }

    /// Builds the model with its routed experts supplied by `experts`, which must hold the
    /// experts of this checkpoint in [`expert_layout`]'s layout ([`Model::with_expert_store`]
    /// checks that for a store); no expert byte is touched here.
    pub fn with_expert_source(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        experts: Box<dyn ExpertSource<MxFp4Matrices<3>, ModelError> + 'a>,
    ) -> Result<Self> {
        Self::load(ckpt, config, kernels, Some(experts))
    }

    /// Runs the model's work on `pool` (row blocks of every projection, expert tasks).
    /// Logits are bit-identical for any pool size.
    pub fn with_pool(mut self, pool: Arc<Pool>) -> Self {
        self.pool = pool;
        self
    }

    /// How routed experts are spread over the pool's domains (results do not depend on it).
    pub fn with_expert_placement(mut self, placement: ExpertPlacement) -> Self {
        self.expert_placement = placement;
        self
    }

    /// Adds the compute time of every one-token pass (its wall time less its waits for
    /// reads) to `clock` (timing only: the logits are the same bits).
    pub fn with_decode_clock(mut self, clock: Arc<DecodeClock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Charges the wall time of every forward pass's phases to `profile`'s buckets (timing
    /// only: the logits are the same bits).
    pub fn with_profile(mut self, profile: Arc<Profile>) -> Self {
        self.profile = Some(profile);
        self
    }

    /// Runs `f`, charging its wall time to `bucket` when profiling.
    pub(super) fn timed<T>(&self, bucket: Bucket, f: impl FnOnce() -> T) -> T {
        match &self.profile {
            Some(p) => p.time(bucket, f),
            None => f(),
        }
    }

    /// Sets the work size (bytes of weights) below which a dispatch stays on the calling
    /// thread (default 128 KiB). Results do not depend on it; tests set 0 to split everything.
    pub fn with_parallel_threshold(mut self, bytes: usize) -> Self {
        self.parallel_min_bytes = bytes;
        self
    }

    /// A fresh sequence.
    pub fn session(&self) -> Session {
        let c = &self.config;
        let taps = c.kda.conv_kernel;
        let width = c.kda_width();
        Session {
            position: 0,
            kda: c
                .layers
                .iter()
                .map(|l| {
                    (l.attention == AttentionKind::Kda).then(|| KdaState {
                        windows: std::array::from_fn(|_| vec![0.0; width * (taps - 1)]),
                        state: vec![0.0; c.kda.num_heads * c.kda.head_dim * c.kda.head_dim],
                    })
                })
                .collect(),
            mla: c
                .layers
                .iter()
                .map(|l| (l.attention == AttentionKind::Mla).then(MlaCache::default))
                .collect(),
            journal: None,
            spare: None,
            mirror: Default::default(),
        }
    }

    /// Consumes `token` and returns the logits for the next position.
    pub fn decode_step(&self, session: &mut Session, token: usize) -> Result<Vec<f32>> {
        Ok(self
            .forward(session, &[token], Want::All)?
            .pop()
            .expect("one token in, one row out"))
    }

    /// Consumes a prompt in chunks of `chunk` tokens and returns the logits after its last
    /// token (bit-identical to decoding it token by token).
    pub fn prefill(
        &self,
        session: &mut Session,
        tokens: &[usize],
        chunk: usize,
    ) -> Result<Vec<f32>> {
        // Only the final token's logits are wanted: earlier chunks skip the lm_head, the last
        // runs it for its last token alone (batch-invariant: the same bits as in a chunk).
        let parts: Vec<&[usize]> = tokens.chunks(chunk.max(1)).collect();
        let mut last = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let wanted = if i + 1 == parts.len() {
                Want::Last
            } else {
                Want::None
            };
            last = self
                .forward(session, part, wanted)?
                .pop()
                .unwrap_or_default();
        }
        Ok(last)
    }

    /// Teacher-forced scoring: consumes `tokens` in chunks of `chunk` (layer-major, each weight
    /// and expert read once per chunk) and returns the logits after every token. Bit-identical
    /// to calling [`Model::decode_step`] token by token, whatever the chunk size.
    pub fn score(
        &self,
        session: &mut Session,
        tokens: &[usize],
        chunk: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let mut logits = Vec::with_capacity(tokens.len());
        for part in tokens.chunks(chunk.max(1)) {
            logits.extend(self.forward(session, part, Want::All)?);
        }
        Ok(logits)
    }

    /// Layer-major forward of a chunk of tokens: per-token state (conv windows, KDA states,
    /// the MLA cache, AttnRes banks) advances in token order; projections, MLPs and experts
    /// run as batch-invariant GEMMs over the chunk.
    /// One chunk through the whole model, run on one of the pool's workers so that every
    /// dispatch inside starts on that worker at once while the others join (from an outside
    /// thread, each dispatch would wake all workers and sleep): 6-8% faster on k3-0.40b with
    /// 2 threads, same bits (PERFORMANCE.md, phase 3).
    pub(super) fn forward(
        &self,
        session: &mut Session,
        tokens: &[usize],
        wanted: Want,
    ) -> Result<Vec<Vec<f32>>> {
        let mut groups = [(session, tokens)];
        Ok(self.run_step(&mut groups, &[wanted])?.concat())
    }

    /// One decode step for several sequences at once: `steps[i]` feeds one token to its own
    /// session; returns each sequence's logits. Weights (projections of the MLPs and experts,
    /// lm_head) are read once for all of them through the batch-invariant GEMM, attention runs
    /// on each sequence's own state, so every sequence's logits are bit-identical to its
    /// [`Model::decode_step`] alone, whoever shares the step.
    pub fn decode_batch(&self, steps: &mut [(&mut Session, usize)]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<[usize; 1]> = steps.iter().map(|(_, t)| [*t]).collect();
        let mut groups: Vec<(&mut Session, &[usize])> = steps
            .iter_mut()
            .zip(&tokens)
            .map(|((session, _), token)| (&mut **session, &token[..]))
            .collect();
        let wanted = vec![Want::All; groups.len()];
        Ok(self
            .run_step(&mut groups, &wanted)?
            .into_iter()
            .map(|mut rows| rows.pop().expect("one token in, one row out"))
            .collect())
    }

    /// One step of a scheduler over a mixed batch: `groups[g]` feeds its tokens (one decode
    /// token, or a chunk of a prompt) to its own session, all in one layer-major pass that
    /// reads each weight once for every token of the step. Returns, for each group, the logits
    /// after its last token where `want[g]` (a decode, or a prompt's last chunk) and `None`
    /// elsewhere. Bit-identical to each group's own [`Model::prefill`] or
    /// [`Model::decode_step`] alone, whoever shares the step and however a prompt is cut.
    ///
    /// # Errors
    /// A token outside the vocabulary, or a failure of the pass (an expert that cannot be
    /// read): the step's sessions may then be half-advanced and should be dropped.
    ///
    /// # Panics
    /// If `want` is not one entry per group, or a group has no token.
    pub fn step(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        want: &[bool],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let wants: Vec<Want> = want
            .iter()
            .map(|&w| if w { Want::Last } else { Want::None })
            .collect();
        Ok(self
            .step_rows(groups, &wants)?
            .into_iter()
            .map(|mut rows| rows.pop())
            .collect())
    }

    /// [`Model::step`] with each group's logits rows chosen by `wants[g]`: none, after its last
    /// token, or after every token (a verify pass of drafted tokens: the last sampled token and
    /// the drafts go in one group, and row `i` is what decoding them one by one would give
    /// after the `i`-th). Returns each group's rows in token order. The same bits as
    /// [`Model::decode_step`] token by token, whoever shares the step.
    ///
    /// # Errors
    /// As [`Model::step`].
    ///
    /// # Panics
    /// If `wants` is not one entry per group, or a group has no token.
    pub fn step_rows(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        wants: &[Want],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        assert_eq!(wants.len(), groups.len(), "one logits wish per group");
        assert!(
            groups.iter().all(|(_, t)| !t.is_empty()),
            "every group of a step feeds at least one token"
        );
        self.run_step(groups, wants)
    }

    /// Layer-major forward of several sequences' chunks (`groups[g]`: a session and the tokens
    /// it consumes): per-token state advances in each sequence's token order, weights are read
    /// once for all tokens. Returns each group's logits, one row per token.
    pub(super) fn forward_on_worker(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        wanted: &[Want],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let timer = self.pass_timer(groups.iter().map(|(_, t)| t.len()).sum());
        let out = self.forward_pass(groups, wanted)?;
        if let Some(timer) = timer {
            self.pass_done(timer);
        }
        Ok(out)
    }

    pub(super) fn forward_pass(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        wanted: &[Want],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let c = &self.config;
        let d = c.hidden_size;
        let eps = c.rms_norm_eps;
        let tokens: Vec<usize> = groups.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let mut spans = Vec::with_capacity(groups.len());
        let mut at = 0;
        for (_, t) in groups.iter() {
            spans.push(at..at + t.len());
            at += t.len();
        }
        let tokens = &tokens[..];
        let mut h: Vec<Vec<f32>> = Vec::with_capacity(tokens.len());
        if let Some(&token) = tokens.iter().find(|&&t| t >= c.vocab_size) {
            return Err(ModelError::Token {
                token,
                vocab: c.vocab_size,
            });
        }
        // The embedding is mapped and, under a memory budget, mostly not in memory: every
        // row's read is asked for first, one request each, so a cold row costs a read of its
        // own pages (0.3-0.4 ms) instead of a fault's read-around (4-15 ms), and a prefill's rows
        // are read together.
        for &token in tokens {
            for bytes in self.embed.row_storage(token) {
                expert_store::checkpoint::read_ahead(bytes);
            }
        }
        for &token in tokens {
            let mut row = vec![0.0; d];
            self.kernels
                .dequant(&self.embed, token..token + 1, &mut row)?;
            h.push(row);
        }
        let mut banks: Vec<Vec<Vec<f32>>> = vec![Vec::new(); tokens.len()];
        let norm = |x: &[f32], w: &[f32]| {
            let mut y = vec![0.0; x.len()];
            rms_norm(x, Some(w), eps, &mut y);
            y
        };
        // Each layer's weights from where they are: as loaded, the plan's resident buffer, or
        // the stream's.
        let mut pass = self.trunk_pass();
        for i in 0..self.layers.len() {
            // The layer's vectors as loaded; its matrices step by step from the stream.
            let layer = &self.layers[i];
            let held = self.trunk_unit(&mut pass, i, Part::Attention)?;
            let attention = self.attention_weights(i, held.as_ref())?;
            let restart = c.layers[i].attn_res_snapshot;
            let mut raw = Vec::with_capacity(tokens.len());
            let mut normed = Vec::with_capacity(tokens.len());
            wide(
                &self.kernels,
                #[inline(always)]
                || {
                    for (t, bank) in banks.iter_mut().enumerate() {
                        // (a) attention-side mix over [bank..., h] (skipped while the bank is
                        // empty); (b) at a block boundary, bank the RAW layer input and
                        // restart the stream.
                        let input = std::mem::take(&mut h[t]);
                        let mut mixed = input.clone();
                        if !bank.is_empty() {
                            mix(bank, &input, &layer.attn_res_score, eps, &mut mixed);
                        }
                        if restart {
                            bank.push(input.clone());
                        }
                        normed.push(norm(&mixed, &layer.input_norm));
                        raw.push(input);
                    }
                },
            );
            // Projections once for all tokens; attention on each sequence's own state.
            let attn = match &*attention {
                Attention::Kda(kda) => {
                    let states = groups
                        .iter_mut()
                        .zip(&spans)
                        .filter_map(|((session, _), span)| {
                            let Session { kda, journal, .. } = &mut **session;
                            let journal = journal.as_mut().and_then(|j| j.kda[i].as_mut());
                            Some((kda[i].as_mut()?, journal, span.clone()))
                        })
                        .collect();
                    self.timed(Bucket::Kda, || self.kda(kda, states, &normed))?
                }
                Attention::Mla(mla) => {
                    let caches = groups
                        .iter_mut()
                        .zip(&spans)
                        .filter_map(|((session, _), span)| {
                            Some((session.mla[i].as_mut()?, span.clone()))
                        })
                        .collect();
                    // Timed inside: projections and attention over the cache apart.
                    self.mla(mla, caches, &normed)?
                }
            };
            // The attention's buffer goes back before the FFN's is asked for.
            drop(attention);
            drop(held);
            let mut prefix = Vec::with_capacity(tokens.len());
            let mut post = Vec::with_capacity(tokens.len());
            wide(
                &self.kernels,
                #[inline(always)]
                || {
                    for (t, a) in attn.into_iter().enumerate() {
                        let p: Vec<f32> = if restart {
                            a
                        } else {
                            raw[t].iter().zip(&a).map(|(x, y)| x + y).collect()
                        };
                        // (c) mlp-side mix over [bank..., prefix] (never empty here).
                        let mut m = vec![0.0; d];
                        mix(&banks[t], &p, &layer.mlp_res_score, eps, &mut m);
                        post.push(norm(&m, &layer.post_norm));
                        prefix.push(p);
                    }
                },
            );
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => self.timed(Bucket::DenseMlp, || {
                    self.planned_mlp(&mut pass, i, mlp, &post)
                })?,
                Ffn::Moe(moe) => {
                    let held = self.trunk_unit(&mut pass, i, Part::Moe)?;
                    let moe = self.moe_weights(moe, held.as_ref())?;
                    self.moe(&moe, &post)?
                }
            };
            h = prefix
                .into_iter()
                .zip(f)
                .map(|(p, f)| p.iter().zip(&f).map(|(a, b)| a + b).collect())
                .collect();
        }
        // The tokens whose logits are wanted: per group all, its last, or none.
        let rows: Vec<usize> = spans
            .iter()
            .zip(wanted)
            .flat_map(|(span, want)| match want {
                Want::All => span.clone(),
                Want::Last => span.end - 1..span.end,
                Want::None => 0..0,
            })
            .collect();
        let mut finals = Vec::with_capacity(rows.len());
        for &t in &rows {
            let mut out = vec![0.0; d];
            mix(&banks[t], &h[t], &self.output_res_score, eps, &mut out);
            finals.push(norm(&out, &self.final_norm));
        }
        let mut logits = if finals.is_empty() {
            Vec::new().into_iter()
        } else {
            let head = self.layers.len();
            self.timed(Bucket::LmHead, || {
                self.planned_gemm(&mut pass, head, Part::Head, &self.lm_head, &finals)
            })?
            .into_iter()
        };
        Ok(groups
            .iter_mut()
            .zip(&spans)
            .map(|((session, t), span)| {
                session.position += t.len();
                let here = rows.iter().filter(|&&r| span.contains(&r)).count();
                logits.by_ref().take(here).collect()
            })
            .collect())
    }
}

/// The AttnRes mix of `[bank..., current]`.
#[inline(always)]
pub(super) fn mix(bank: &[Vec<f32>], current: &[f32], score: &[f32], eps: f32, out: &mut [f32]) {
    let mut candidates: Vec<&[f32]> = bank.iter().map(Vec::as_slice).collect();
    candidates.push(current);
    attn_res_mix(&candidates, score, eps, out);
}

/// FNV-1a 64 of the little-endian bytes of `logits`: the fingerprint the determinism tests and
/// the decode bench compare.
pub fn fingerprint(logits: &[f32]) -> u64 {
    logits
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}
