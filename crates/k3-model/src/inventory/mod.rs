//! Every text tensor a K3 checkpoint holds, derived from the config: name, stored shape
//! (`[out, in]`), the release's dtype, class (docs/MODEL.md §3.3, generalised to the config's
//! dimensions) and role, which says what other formats a checkpoint may use for it
//! ([`TensorSpec::role`]: docs/ARCHITECTURE.md contract 3, formats accepted by tensor, not by name).
//!
//! Names are relative to the text model (`model.layers.3.self_attn.q_proj.weight`,
//! `lm_head.weight`); the release prefixes them with `language_model.`. The loader validates a
//! checkpoint against this list, the synthetic generator writes it, and the byte plan sums it,
//! so all three agree by construction. Every name is spelled once, in `names`, which the model's
//! loader reads too.

mod names;

pub use names::{
    A_LOG, EMBED_TOKENS, FINAL_NORM, KdaNames, LM_HEAD, LayerNames, MlaNames, MlpNames, MoeNames,
    OUTPUT_RES_NORM, OUTPUT_RES_PROJ, expert_layout,
};

use crate::config::{AttentionKind, FfnKind, K3Config};

/// What a tensor is, as far as its format goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// A linear layer's weight `[out, in]`: BF16, F16, F32, or MXFP4 stored as
    /// `{base}.weight_packed` + `{base}.weight_scale` in place of `{base}.weight`.
    Linear,
    /// A float vector (norm weight, bias, conv taps, `A_log`, AttnRes projection): F32, BF16
    /// or F16, widened exactly to f32 at load.
    Vector,
    /// One of a routed expert's MXFP4 tensors (U8).
    ExpertPart,
}

impl Role {
    /// The stored formats a checkpoint may use, as errors name them.
    pub fn formats(self) -> &'static str {
        match self {
            Role::Linear => expert_store::checkpoint::LINEAR_FORMATS,
            Role::Vector => expert_store::checkpoint::VECTOR_FORMATS,
            Role::ExpertPart => "U8",
        }
    }
}

/// Stored element type (the release's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16, 2 bytes: the release's linear weights and most vectors.
    Bf16,
    /// f32, 4 bytes: the KDA vectors the state depends on (conv taps, `A_log`, `dt_bias`, `o_norm`)
    /// and the router bias.
    F32,
    /// Packed MXFP4 codes and E8M0 scales (compressed-tensors `weight_packed` / `weight_scale`).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
            DType::U8 => 1,
        }
    }
    /// The safetensors header name.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bf16 => "BF16",
            DType::F32 => "F32",
            DType::U8 => "U8",
        }
    }
}

/// What a tensor is for: the rows of the byte plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// The token embedding table.
    Embedding,
    /// The output projection to the vocabulary.
    LmHead,
    /// Final norm and the output AttnRes vectors.
    OutputNorms,
    /// Per layer: the two layer norms and the four AttnRes vectors.
    LayerNorms,
    /// A KDA layer's projections, conv taps and gate vectors.
    KdaAttention,
    /// A gated-MLA layer's projections and latent norms.
    MlaAttention,
    /// The dense layers' MLPs.
    DenseMlp,
    /// The MoE router's weight and selection bias.
    Router,
    /// Latent down/up projections and the latent norm.
    LatentProjections,
    /// The MoE layers' fused shared-expert MLPs.
    SharedExperts,
    /// The routed experts' packed MXFP4 codes and scales.
    RoutedExperts,
}

impl TensorClass {
    /// Every class, in the byte plan's row order.
    pub const ALL: [TensorClass; 11] = [
        TensorClass::Embedding,
        TensorClass::LmHead,
        TensorClass::OutputNorms,
        TensorClass::LayerNorms,
        TensorClass::KdaAttention,
        TensorClass::MlaAttention,
        TensorClass::DenseMlp,
        TensorClass::Router,
        TensorClass::LatentProjections,
        TensorClass::SharedExperts,
        TensorClass::RoutedExperts,
    ];
    /// The class as the byte plan's rows print it.
    pub fn name(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::LmHead => "lm_head",
            TensorClass::OutputNorms => "output norms",
            TensorClass::LayerNorms => "layer norms + AttnRes",
            TensorClass::KdaAttention => "KDA attention",
            TensorClass::MlaAttention => "MLA attention",
            TensorClass::DenseMlp => "dense MLP",
            TensorClass::Router => "router",
            TensorClass::LatentProjections => "latent projections",
            TensorClass::SharedExperts => "shared experts",
            TensorClass::RoutedExperts => "routed experts",
        }
    }
}

/// One stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name relative to the text model (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    /// Stored shape, `[out, in]` for a matrix; an expert part's is in bytes (`[rows, cols / 2]`
    /// codes, `[rows, cols / 32]` scales).
    pub shape: Vec<usize>,
    /// The release's element type.
    pub dtype: DType,
    /// What the tensor is for, the byte plan's row.
    pub class: TensorClass,
    /// Decoder layer, for per-layer tensors.
    pub layer: Option<usize>,
    /// Routed expert id, for expert tensors.
    pub expert: Option<usize>,
}

impl TensorSpec {
    /// The tensor's role: routed-expert parts by dtype, linear weights are the 2-D tensors
    /// (except the AttnRes projections, `[1, d]` vectors), everything else is a vector.
    pub fn role(&self) -> Role {
        match self.dtype {
            DType::U8 => Role::ExpertPart,
            _ if self.shape.len() == 2 && !self.name.contains("res_proj") => Role::Linear,
            _ => Role::Vector,
        }
    }

    /// Bytes in the release's dtype.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bytes()
    }
}

/// Stored length of a KDA layer's `A_log`. The release stores `[128]` for 96 heads (96 values
/// and 32 exact zeros, docs/MODEL.md §6.4); the 0.40B model presumably stores `[8]` for 8 heads.
/// [UNCERTAIN: the padding rule is not documented; the next power of two reproduces both and
/// the release's byte total, so the plan and the generator use it. The loader accepts any
/// length >= num_heads whose tail is zero.]
pub fn a_log_stored_len(num_heads: usize) -> usize {
    num_heads.next_power_of_two()
}

/// The text tensors of a checkpoint for `config`, in no particular order.
pub fn text_tensors(config: &K3Config) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    let d = config.hidden_size;
    let v = config.vocab_size;
    let global = |name: &str, shape: Vec<usize>, class| TensorSpec {
        name: name.to_owned(),
        shape,
        dtype: DType::Bf16,
        class,
        layer: None,
        expert: None,
    };
    out.push(global(EMBED_TOKENS, vec![v, d], TensorClass::Embedding));
    out.push(global(LM_HEAD, vec![v, d], TensorClass::LmHead));
    out.push(global(FINAL_NORM, vec![d], TensorClass::OutputNorms));
    out.push(global(OUTPUT_RES_NORM, vec![d], TensorClass::OutputNorms));
    out.push(global(
        OUTPUT_RES_PROJ,
        vec![1, d],
        TensorClass::OutputNorms,
    ));
    for (i, layer) in config.layers.iter().enumerate() {
        layer_tensors(config, i, layer.attention, layer.ffn, &mut out);
    }
    out
}

fn layer_tensors(
    c: &K3Config,
    i: usize,
    attention: AttentionKind,
    ffn: FfnKind,
    out: &mut Vec<TensorSpec>,
) {
    let d = c.hidden_size;
    let mut push = |name: &str, shape: Vec<usize>, dtype: DType, class: TensorClass| {
        out.push(TensorSpec {
            name: name.to_owned(),
            shape,
            dtype,
            class,
            layer: Some(i),
            expert: None,
        })
    };
    use DType::{Bf16, F32};
    use TensorClass as C;
    let n = LayerNames::new(i);
    for norm in [
        &n.input_norm,
        &n.post_norm,
        &n.attn_res_norm,
        &n.mlp_res_norm,
    ] {
        push(norm, vec![d], Bf16, C::LayerNorms);
    }
    for proj in [&n.attn_res_proj, &n.mlp_res_proj] {
        push(proj, vec![1, d], Bf16, C::LayerNorms);
    }
    match attention {
        AttentionKind::Kda => {
            let k = &c.kda;
            let n = KdaNames::new(i);
            let width = c.kda_width();
            let class = C::KdaAttention;
            for proj in [&n.q, &n.k, &n.v, &n.g] {
                push(proj, vec![width, d], Bf16, class);
            }
            push(&n.o, vec![d, width], Bf16, class);
            for conv in &n.conv {
                push(conv, vec![width, 1, k.conv_kernel], F32, class);
            }
            // The decay gate's low-rank factor has rank head_dim (128 in K3).
            push(&n.f_a, vec![k.head_dim, d], Bf16, class);
            push(&n.f_b, vec![width, k.head_dim], Bf16, class);
            push(&n.b, vec![k.num_heads, d], Bf16, class);
            push(&n.a_log, vec![a_log_stored_len(k.num_heads)], F32, class);
            push(&n.dt_bias, vec![width], F32, class);
            push(&n.o_norm, vec![k.head_dim], F32, class);
        }
        AttentionKind::Mla => {
            let m = &c.mla;
            let n = MlaNames::new(i);
            let class = C::MlaAttention;
            let qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let v_width = m.num_heads * m.v_head_dim;
            push(&n.q_a, vec![m.q_lora_rank, d], Bf16, class);
            push(&n.q_a_norm, vec![m.q_lora_rank], Bf16, class);
            push(
                &n.q_b,
                vec![m.num_heads * qk_head, m.q_lora_rank],
                Bf16,
                class,
            );
            push(
                &n.kv_a,
                vec![m.kv_lora_rank + m.qk_rope_head_dim, d],
                Bf16,
                class,
            );
            push(&n.kv_a_norm, vec![m.kv_lora_rank], Bf16, class);
            push(
                &n.kv_b,
                vec![
                    m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                    m.kv_lora_rank,
                ],
                Bf16,
                class,
            );
            if m.output_gate {
                push(&n.g, vec![v_width, d], Bf16, class);
            }
            push(&n.o, vec![d, v_width], Bf16, class);
        }
    }
    let mlp = |n: &MlpNames, width: usize| {
        [
            (n.gate.clone(), vec![width, d]),
            (n.up.clone(), vec![width, d]),
            (n.down.clone(), vec![d, width]),
        ]
    };
    match ffn {
        FfnKind::Dense => {
            for (name, shape) in mlp(&MlpNames::dense(i), c.dense_intermediate) {
                push(&name, shape, Bf16, C::DenseMlp);
            }
        }
        FfnKind::Moe => {
            let moe = &c.moe;
            let n = MoeNames::new(i);
            push(&n.router, vec![moe.num_experts, d], Bf16, C::Router);
            push(&n.router_bias, vec![moe.num_experts], F32, C::Router);
            if let Some(latent) = moe.latent {
                let class = C::LatentProjections;
                push(&n.latent_down, vec![latent.hidden, d], Bf16, class);
                if latent.use_norm {
                    push(&n.latent_norm, vec![latent.hidden], Bf16, class);
                }
                push(&n.latent_up, vec![d, latent.hidden], Bf16, class);
            }
            let shared = moe.shared_intermediate();
            if shared > 0 {
                for (name, shape) in mlp(&n.shared, shared) {
                    push(&name, shape, Bf16, C::SharedExperts);
                }
            }
            let layout = expert_layout(c);
            for e in 0..moe.num_experts {
                for m in layout.matrices() {
                    for (pattern, shape) in [
                        (&m.codes, vec![m.rows, m.cols / 2]),
                        (&m.scales, vec![m.rows, m.cols / 32]),
                    ] {
                        out.push(TensorSpec {
                            name: pattern.name(i, e),
                            shape,
                            dtype: DType::U8,
                            class: C::RoutedExperts,
                            layer: Some(i),
                            expert: Some(e),
                        });
                    }
                }
            }
        }
    }
}

/// Bytes of one routed expert (its six tensors).
pub fn expert_bytes(config: &K3Config) -> usize {
    expert_layout(config).expert_bytes()
}

/// Byte accounting of a checkpoint's text tensors (`cargo xtask k3-plan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BytePlan {
    /// Bytes per tensor class, in `TensorClass::ALL` order.
    pub by_class: Vec<(TensorClass, usize)>,
    /// Non-expert bytes of one layer of each (attention, ffn) kind present, with the count
    /// of such layers.
    pub by_layer_kind: Vec<((AttentionKind, FfnKind), usize, usize)>,
    /// Bytes of one routed expert.
    pub expert_bytes: usize,
    /// Layers with a (latent) MoE.
    pub moe_layers: usize,
    /// Routed-expert bytes one decoded token reads: `top_k` experts in every MoE layer.
    pub routed_bytes_per_token: usize,
    /// Text tensors in the checkpoint.
    pub text_tensors: usize,
    /// Their bytes in the release's dtypes.
    pub text_bytes: usize,
    /// Weight bytes one decoded token reads: every trunk tensor except the embedding table,
    /// one embedding row, and `top_k` experts in every MoE layer.
    pub bytes_per_token: usize,
}

impl BytePlan {
    /// The byte plan of a checkpoint for `config`.
    pub fn new(config: &K3Config) -> Self {
        let tensors = text_tensors(config);
        let by_class = TensorClass::ALL
            .iter()
            .map(|&class| {
                (
                    class,
                    tensors
                        .iter()
                        .filter(|t| t.class == class)
                        .map(TensorSpec::bytes)
                        .sum(),
                )
            })
            .collect();
        let mut by_layer_kind: Vec<((AttentionKind, FfnKind), usize, usize)> = Vec::new();
        for (i, layer) in config.layers.iter().enumerate() {
            let kind = (layer.attention, layer.ffn);
            let bytes: usize = tensors
                .iter()
                .filter(|t| t.layer == Some(i) && t.class != TensorClass::RoutedExperts)
                .map(TensorSpec::bytes)
                .sum();
            match by_layer_kind.iter_mut().find(|(k, _, _)| *k == kind) {
                Some(entry) => {
                    assert_eq!(entry.1, bytes, "layers of one kind have one size");
                    entry.2 += 1;
                }
                None => by_layer_kind.push((kind, bytes, 1)),
            }
        }
        let text_bytes: usize = tensors.iter().map(TensorSpec::bytes).sum();
        let expert_bytes = expert_bytes(config);
        let class_bytes = |class| {
            tensors
                .iter()
                .filter(|t| t.class == class)
                .map(TensorSpec::bytes)
                .sum::<usize>()
        };
        let moe_layers = config
            .layers
            .iter()
            .filter(|l| l.ffn == FfnKind::Moe)
            .count();
        let routed_bytes_per_token = moe_layers * config.moe.router.top_k * expert_bytes;
        let bytes_per_token = text_bytes
            - class_bytes(TensorClass::RoutedExperts)
            - class_bytes(TensorClass::Embedding)
            + config.hidden_size * DType::Bf16.bytes()
            + routed_bytes_per_token;
        Self {
            by_class,
            by_layer_kind,
            expert_bytes,
            moe_layers,
            routed_bytes_per_token,
            text_tensors: tensors.len(),
            text_bytes,
            bytes_per_token,
        }
    }
}
