//! The model loaded from a checkpoint: the trunk's weights by the inventory's names
//! ([`crate::inventory`] spells every K3 tensor name once), the routed experts through the
//! file mapping unless a source is given.

use std::sync::Arc;

use expert_store::source::{ExpertSource, MxFp4Matrices};
use expert_store::{Checkpoint, ExpertLayout};
use mxfp4_kernels::{Kernels, MxFp4Matrix, Situ};
use numa_sched::Pool;

use super::dispatch::PARALLEL_MIN_BYTES;
use super::error::{ModelError, Result};
use super::forward::{ExpertPlacement, Model};
use super::source::MappedExperts;
use super::weights::{Attention, Ffn, Kda, Layer, Mla, Mlp, Moe};
use crate::checks::validate::a_log;
use crate::config::{AttentionKind, FfnKind, K3Config};
use crate::inventory::{
    EMBED_TOKENS, FINAL_NORM, KdaNames, LM_HEAD, LayerNames, MlaNames, MlpNames, MoeNames,
    OUTPUT_RES_NORM, OUTPUT_RES_PROJ, expert_layout,
};

impl<'a> Model<'a> {
    /// Loads the trunk's weights; routed experts come from `source`, or when it is `None`
    /// through the checkpoint's mapping (each layer's checked with the layer's other tensors).
    pub(super) fn load(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        source: Option<Box<dyn ExpertSource<MxFp4Matrices<3>, ModelError> + 'a>>,
    ) -> Result<Self> {
        let c = config;
        let d = c.hidden_size;
        let vec = |name: &str, n: usize| ckpt.f32_values(name, &[n]).map(Arc::<[f32]>::from);
        let row = |name: &str, n: usize| ckpt.f32_values(name, &[1, n]);
        let linear = |name: &str, rows: usize, cols: usize| ckpt.linear(name, rows, cols);
        let fold = |norm: Arc<[f32]>, proj: Vec<f32>| {
            norm.iter()
                .zip(&proj)
                .map(|(a, b)| a * b)
                .collect::<Arc<[f32]>>()
        };
        let mut layers = Vec::with_capacity(c.num_layers());
        // By checkpoint layer: the mapped experts (none for dense layers or with a `source`).
        let mut mapped = Vec::with_capacity(c.num_layers());
        let expert_layout = expert_layout(c);
        for (i, spec) in c.layers.iter().enumerate() {
            let attention = match spec.attention {
                AttentionKind::Kda => {
                    let n = KdaNames::new(i);
                    let (h, k) = (c.kda.num_heads, c.kda.head_dim);
                    let w = c.kda_width();
                    let taps = c.kda.conv_kernel;
                    let conv =
                        |name: &str| ckpt.f32_values(name, &[w, 1, taps]).map(Arc::<[f32]>::from);
                    Attention::Kda(Kda {
                        q: linear(&n.q, w, d)?,
                        k: linear(&n.k, w, d)?,
                        v: linear(&n.v, w, d)?,
                        g: linear(&n.g, w, d)?,
                        o: linear(&n.o, d, w)?,
                        conv: [conv(&n.conv[0])?, conv(&n.conv[1])?, conv(&n.conv[2])?],
                        f_a: linear(&n.f_a, k, d)?,
                        f_b: linear(&n.f_b, w, k)?,
                        b: linear(&n.b, h, d)?,
                        a_log: a_log(ckpt, c, i)?.into(),
                        dt_bias: vec(&n.dt_bias, w)?,
                        o_norm: vec(&n.o_norm, k)?,
                    })
                }
                AttentionKind::Mla => {
                    let n = MlaNames::new(i);
                    let m = &c.mla;
                    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                    let kv_rows = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim);
                    let kv_b_view = linear(&n.kv_b, kv_rows, m.kv_lora_rank)?;
                    let mut kv_b = vec![0.0; kv_rows * m.kv_lora_rank];
                    kernels.dequant(&kv_b_view, 0..kv_rows, &mut kv_b)?;
                    let v_width = m.num_heads * m.v_head_dim;
                    Attention::Mla(Mla {
                        q_a: linear(&n.q_a, m.q_lora_rank, d)?,
                        q_a_norm: vec(&n.q_a_norm, m.q_lora_rank)?,
                        q_b: linear(&n.q_b, m.num_heads * qk, m.q_lora_rank)?,
                        kv_a: linear(&n.kv_a, m.kv_lora_rank + m.qk_rope_head_dim, d)?,
                        kv_a_norm: vec(&n.kv_a_norm, m.kv_lora_rank)?,
                        kv_b: kv_b.into(),
                        g: if m.output_gate {
                            Some(linear(&n.g, v_width, d)?)
                        } else {
                            None
                        },
                        o: linear(&n.o, d, v_width)?,
                    })
                }
            };
            let mlp = |n: &MlpNames, width: usize| -> Result<Mlp<'a>> {
                Ok(Mlp {
                    gate: linear(&n.gate, width, d)?,
                    up: linear(&n.up, width, d)?,
                    down: linear(&n.down, d, width)?,
                })
            };
            let mut layer_experts = Vec::new();
            let ffn = match spec.ffn {
                FfnKind::Dense => Ffn::Dense(mlp(&MlpNames::dense(i), c.dense_intermediate)?),
                FfnKind::Moe => {
                    let n = MoeNames::new(i);
                    let moe = &c.moe;
                    let latent = match moe.latent {
                        None => None,
                        Some(l) => Some((
                            linear(&n.latent_down, l.hidden, d)?,
                            if l.use_norm {
                                Some(vec(&n.latent_norm, l.hidden)?)
                            } else {
                                None
                            },
                            linear(&n.latent_up, d, l.hidden)?,
                        )),
                    };
                    let shared = match moe.shared_intermediate() {
                        0 => None,
                        width => Some(mlp(&n.shared, width)?),
                    };
                    let count = if source.is_some() { 0 } else { moe.num_experts };
                    layer_experts = (0..count)
                        .map(|e| mapped_expert(ckpt, &expert_layout, i, e))
                        .collect::<Result<Vec<_>>>()?;
                    Ffn::Moe(Moe {
                        router: linear(&n.router, moe.num_experts, d)?,
                        bias: vec(&n.router_bias, moe.num_experts)?,
                        latent,
                        shared,
                        layer: i,
                    })
                }
            };
            let n = LayerNames::new(i);
            layers.push(Layer {
                input_norm: vec(&n.input_norm, d)?,
                post_norm: vec(&n.post_norm, d)?,
                attn_res_score: fold(vec(&n.attn_res_norm, d)?, row(&n.attn_res_proj, d)?),
                mlp_res_score: fold(vec(&n.mlp_res_norm, d)?, row(&n.mlp_res_proj, d)?),
                attention,
                ffn,
            });
            mapped.push(layer_experts);
        }
        Ok(Self {
            config: c.clone(),
            kernels,
            pool: Arc::new(Pool::new(1).map_err(|e| ModelError::Pool(e.to_string()))?),
            parallel_min_bytes: PARALLEL_MIN_BYTES,
            situ: Situ {
                beta: c.situ.beta,
                linear_beta: c.situ.linear_beta,
            },
            embed: linear(EMBED_TOKENS, c.vocab_size, d)?,
            lm_head: linear(LM_HEAD, c.vocab_size, d)?,
            final_norm: vec(FINAL_NORM, d)?.to_vec(),
            output_res_score: fold(vec(OUTPUT_RES_NORM, d)?, row(OUTPUT_RES_PROJ, d)?).to_vec(),
            layers,
            trunk: None,
            experts: source.unwrap_or_else(|| Box::new(MappedExperts { layers: mapped })),
            expert_placement: ExpertPlacement::default(),
            profile: None,
            clock: None,
            waited_ns: Default::default(),
            experts_asked: Default::default(),
            mirror_ids: std::sync::atomic::AtomicU64::new(1),
            gone: Default::default(),
        })
    }
}

/// Routed expert `expert` of checkpoint layer `layer` through the checkpoint's mapping, its
/// matrices in `layout`'s order (gate, up, down for K3's).
fn mapped_expert<'a>(
    ckpt: &'a Checkpoint,
    layout: &ExpertLayout,
    layer: usize,
    expert: usize,
) -> Result<[MxFp4Matrix<'a>; 3]> {
    let view = |m: usize| {
        let m = &layout.matrices()[m];
        ckpt.mxfp4_tensors(
            &m.codes.name(layer, expert),
            &m.scales.name(layer, expert),
            m.rows,
            m.cols,
        )
    };
    Ok([view(0)?, view(1)?, view(2)?])
}
