//! The weights as the forward pass holds them, and their loading from the checkpoint.

use std::sync::Arc;

use expert_store::Checkpoint;
use mxfp4_kernels::{Kernels, Situ, WeightMatrix};
use numa_sched::Pool;

use super::dispatch::PARALLEL_MIN_BYTES;
use super::source::{ExpertSource, MappedExperts};
use super::{ExpertPlacement, Model, ModelError, Result};
use crate::checkpoint::a_log;
use crate::config::{AttentionKind, FfnKind, K3Config};

pub(super) struct Kda<'a> {
    pub(super) q: WeightMatrix<'a>,
    pub(super) k: WeightMatrix<'a>,
    pub(super) v: WeightMatrix<'a>,
    pub(super) g: WeightMatrix<'a>,
    pub(super) o: WeightMatrix<'a>,
    pub(super) conv: [Vec<f32>; 3],
    pub(super) f_a: WeightMatrix<'a>,
    pub(super) f_b: WeightMatrix<'a>,
    pub(super) b: WeightMatrix<'a>,
    pub(super) a_log: Vec<f32>,
    pub(super) dt_bias: Vec<f32>,
    pub(super) o_norm: Vec<f32>,
}

pub(super) struct Mla<'a> {
    pub(super) q_a: WeightMatrix<'a>,
    pub(super) q_a_norm: Vec<f32>,
    pub(super) q_b: WeightMatrix<'a>,
    pub(super) kv_a: WeightMatrix<'a>,
    pub(super) kv_a_norm: Vec<f32>,
    /// `kv_b_proj` widened to f32, `[heads * (nope + v), kv_lora_rank]` (read transposed).
    pub(super) kv_b: Vec<f32>,
    pub(super) g: Option<WeightMatrix<'a>>,
    pub(super) o: WeightMatrix<'a>,
}

pub(super) struct Mlp<'a> {
    pub(super) gate: WeightMatrix<'a>,
    pub(super) up: WeightMatrix<'a>,
    pub(super) down: WeightMatrix<'a>,
}

pub(super) struct Moe<'a> {
    pub(super) router: WeightMatrix<'a>,
    pub(super) bias: Vec<f32>,
    pub(super) latent: Option<(WeightMatrix<'a>, Option<Vec<f32>>, WeightMatrix<'a>)>,
    pub(super) shared: Option<Mlp<'a>>,
    /// The checkpoint's layer index (the expert source's key).
    pub(super) layer: usize,
}

// Built once per layer at load and matched per layer per step: boxing a variant buys nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Attention<'a> {
    Kda(Kda<'a>),
    Mla(Mla<'a>),
}

#[allow(clippy::large_enum_variant)] // as `Attention`
pub(super) enum Ffn<'a> {
    Dense(Mlp<'a>),
    Moe(Moe<'a>),
}

pub(super) struct Layer<'a> {
    pub(super) input_norm: Vec<f32>,
    pub(super) post_norm: Vec<f32>,
    /// `self_attention_res_norm ⊙ self_attention_res_proj`, folded once.
    pub(super) attn_res_score: Vec<f32>,
    pub(super) mlp_res_score: Vec<f32>,
    pub(super) attention: Attention<'a>,
    pub(super) ffn: Ffn<'a>,
}

impl<'a> Model<'a> {
    /// Loads the trunk's weights; routed experts come from `source`, or when it is `None`
    /// through the checkpoint's mapping (each layer's checked with the layer's other tensors).
    pub(super) fn load(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        source: Option<Box<dyn ExpertSource + 'a>>,
    ) -> Result<Self> {
        let c = config;
        let d = c.hidden_size;
        let vec = |name: &str, n: usize| ckpt.f32_values(name, &[n]);
        let row = |name: &str, n: usize| ckpt.f32_values(name, &[1, n]);
        let linear = |name: &str, rows: usize, cols: usize| ckpt.linear(name, rows, cols);
        let fold = |norm: Vec<f32>, proj: Vec<f32>| {
            norm.iter()
                .zip(&proj)
                .map(|(a, b)| a * b)
                .collect::<Vec<f32>>()
        };
        let mut layers = Vec::with_capacity(c.num_layers());
        // By checkpoint layer: the mapped experts (none for dense layers or with a `source`).
        let mut mapped = Vec::with_capacity(c.num_layers());
        for (i, spec) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let attention = match spec.attention {
                AttentionKind::Kda => {
                    let (h, k) = (c.kda.num_heads, c.kda.head_dim);
                    let w = c.kda_width();
                    let taps = c.kda.conv_kernel;
                    let conv = |name: &str| {
                        ckpt.f32_values(&format!("{p}self_attn.{name}.weight"), &[w, 1, taps])
                    };
                    Attention::Kda(Kda {
                        q: linear(&format!("{p}self_attn.q_proj.weight"), w, d)?,
                        k: linear(&format!("{p}self_attn.k_proj.weight"), w, d)?,
                        v: linear(&format!("{p}self_attn.v_proj.weight"), w, d)?,
                        g: linear(&format!("{p}self_attn.g_proj.weight"), w, d)?,
                        o: linear(&format!("{p}self_attn.o_proj.weight"), d, w)?,
                        conv: [conv("q_conv1d")?, conv("k_conv1d")?, conv("v_conv1d")?],
                        f_a: linear(&format!("{p}self_attn.f_a_proj.weight"), k, d)?,
                        f_b: linear(&format!("{p}self_attn.f_b_proj.weight"), w, k)?,
                        b: linear(&format!("{p}self_attn.b_proj.weight"), h, d)?,
                        a_log: a_log(ckpt, c, i)?,
                        dt_bias: vec(&format!("{p}self_attn.dt_bias"), w)?,
                        o_norm: vec(&format!("{p}self_attn.o_norm.weight"), k)?,
                    })
                }
                AttentionKind::Mla => {
                    let m = &c.mla;
                    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                    let kv_rows = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim);
                    let kv_b_view = linear(
                        &format!("{p}self_attn.kv_b_proj.weight"),
                        kv_rows,
                        m.kv_lora_rank,
                    )?;
                    let mut kv_b = vec![0.0; kv_rows * m.kv_lora_rank];
                    kernels.dequant(&kv_b_view, 0..kv_rows, &mut kv_b)?;
                    let v_width = m.num_heads * m.v_head_dim;
                    Attention::Mla(Mla {
                        q_a: linear(&format!("{p}self_attn.q_a_proj.weight"), m.q_lora_rank, d)?,
                        q_a_norm: vec(
                            &format!("{p}self_attn.q_a_layernorm.weight"),
                            m.q_lora_rank,
                        )?,
                        q_b: linear(
                            &format!("{p}self_attn.q_b_proj.weight"),
                            m.num_heads * qk,
                            m.q_lora_rank,
                        )?,
                        kv_a: linear(
                            &format!("{p}self_attn.kv_a_proj_with_mqa.weight"),
                            m.kv_lora_rank + m.qk_rope_head_dim,
                            d,
                        )?,
                        kv_a_norm: vec(
                            &format!("{p}self_attn.kv_a_layernorm.weight"),
                            m.kv_lora_rank,
                        )?,
                        kv_b,
                        g: if m.output_gate {
                            Some(linear(&format!("{p}self_attn.g_proj.weight"), v_width, d)?)
                        } else {
                            None
                        },
                        o: linear(&format!("{p}self_attn.o_proj.weight"), d, v_width)?,
                    })
                }
            };
            let mlp = |prefix: &str, width: usize| -> Result<Mlp<'a>> {
                Ok(Mlp {
                    gate: linear(&format!("{prefix}gate_proj.weight"), width, d)?,
                    up: linear(&format!("{prefix}up_proj.weight"), width, d)?,
                    down: linear(&format!("{prefix}down_proj.weight"), d, width)?,
                })
            };
            let mut layer_experts = Vec::new();
            let ffn = match spec.ffn {
                FfnKind::Dense => Ffn::Dense(mlp(&format!("{p}mlp."), c.dense_intermediate)?),
                FfnKind::Moe => {
                    let moe = &c.moe;
                    let q = format!("{p}block_sparse_moe.");
                    let io = moe.expert_io(d);
                    let inter = moe.expert_intermediate;
                    let latent = match moe.latent {
                        None => None,
                        Some(l) => Some((
                            linear(&format!("{q}routed_expert_down_proj.weight"), l.hidden, d)?,
                            if l.use_norm {
                                Some(vec(&format!("{q}routed_expert_norm.weight"), l.hidden)?)
                            } else {
                                None
                            },
                            linear(&format!("{q}routed_expert_up_proj.weight"), d, l.hidden)?,
                        )),
                    };
                    let shared = match moe.shared_intermediate() {
                        0 => None,
                        width => Some(mlp(&format!("{q}shared_experts."), width)?),
                    };
                    let count = if source.is_some() { 0 } else { moe.num_experts };
                    layer_experts = (0..count)
                        .map(|e| {
                            let base = format!("{q}experts.{e}.");
                            Ok([
                                ckpt.mxfp4_matrix(&format!("{base}w1"), inter, io)?,
                                ckpt.mxfp4_matrix(&format!("{base}w3"), inter, io)?,
                                ckpt.mxfp4_matrix(&format!("{base}w2"), io, inter)?,
                            ])
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ffn::Moe(Moe {
                        router: linear(&format!("{q}gate.weight"), moe.num_experts, d)?,
                        bias: vec(&format!("{q}gate.e_score_correction_bias"), moe.num_experts)?,
                        latent,
                        shared,
                        layer: i,
                    })
                }
            };
            layers.push(Layer {
                input_norm: vec(&format!("{p}input_layernorm.weight"), d)?,
                post_norm: vec(&format!("{p}post_attention_layernorm.weight"), d)?,
                attn_res_score: fold(
                    vec(&format!("{p}self_attention_res_norm.weight"), d)?,
                    row(&format!("{p}self_attention_res_proj.weight"), d)?,
                ),
                mlp_res_score: fold(
                    vec(&format!("{p}mlp_res_norm.weight"), d)?,
                    row(&format!("{p}mlp_res_proj.weight"), d)?,
                ),
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
            embed: linear("model.embed_tokens.weight", c.vocab_size, d)?,
            lm_head: linear("lm_head.weight", c.vocab_size, d)?,
            final_norm: vec("model.norm.weight", d)?,
            output_res_score: fold(
                vec("model.output_attn_res_norm.weight", d)?,
                row("model.output_attn_res_proj.weight", d)?,
            ),
            layers,
            experts: source.unwrap_or_else(|| Box::new(MappedExperts { layers: mapped })),
            expert_placement: ExpertPlacement::default(),
            profile: None,
        })
    }
}
