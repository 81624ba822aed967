//! Every text tensor a K3 checkpoint holds, derived from the config: name, stored shape
//! (`[out, in]`), the release's dtype, class (K3_SPEC §3.3, generalised to the config's
//! dimensions) and role, which says what other formats a checkpoint may use for it
//! ([`TensorSpec::role`]: DESIGN.md contract 3, formats accepted by tensor, not by name).
//!
//! Names are relative to the text model (`model.layers.3.self_attn.q_proj.weight`,
//! `lm_head.weight`); the release prefixes them with `language_model.`. The loader validates a
//! checkpoint against this list, the synthetic generator writes it, and the byte plan sums it,
//! so all three agree by construction.

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
    Bf16,
    F32,
    /// Packed MXFP4 codes and E8M0 scales (compressed-tensors `weight_packed` / `weight_scale`).
    U8,
}

impl DType {
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
    Embedding,
    LmHead,
    /// Final norm and the output AttnRes vectors.
    OutputNorms,
    /// Per layer: the two layer norms and the four AttnRes vectors.
    LayerNorms,
    KdaAttention,
    MlaAttention,
    DenseMlp,
    Router,
    /// Latent down/up projections and the latent norm.
    LatentProjections,
    SharedExperts,
    RoutedExperts,
}

impl TensorClass {
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
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
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
/// and 32 exact zeros, K3_SPEC §6.4); the 0.40B model presumably stores `[8]` for 8 heads.
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
    out.push(global(
        "model.embed_tokens.weight",
        vec![v, d],
        TensorClass::Embedding,
    ));
    out.push(global("lm_head.weight", vec![v, d], TensorClass::LmHead));
    out.push(global(
        "model.norm.weight",
        vec![d],
        TensorClass::OutputNorms,
    ));
    out.push(global(
        "model.output_attn_res_norm.weight",
        vec![d],
        TensorClass::OutputNorms,
    ));
    out.push(global(
        "model.output_attn_res_proj.weight",
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
    let mut push = |suffix: &str, shape: Vec<usize>, dtype: DType, class: TensorClass| {
        out.push(TensorSpec {
            name: format!("model.layers.{i}.{suffix}"),
            shape,
            dtype,
            class,
            layer: Some(i),
            expert: None,
        })
    };
    use DType::{Bf16, F32};
    use TensorClass as C;
    for norm in [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attention_res_norm",
        "mlp_res_norm",
    ] {
        push(&format!("{norm}.weight"), vec![d], Bf16, C::LayerNorms);
    }
    for proj in ["self_attention_res_proj", "mlp_res_proj"] {
        push(&format!("{proj}.weight"), vec![1, d], Bf16, C::LayerNorms);
    }
    match attention {
        AttentionKind::Kda => {
            let k = &c.kda;
            let width = c.kda_width();
            let class = C::KdaAttention;
            for proj in ["q_proj", "k_proj", "v_proj", "g_proj"] {
                push(
                    &format!("self_attn.{proj}.weight"),
                    vec![width, d],
                    Bf16,
                    class,
                );
            }
            push("self_attn.o_proj.weight", vec![d, width], Bf16, class);
            for conv in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                push(
                    &format!("self_attn.{conv}.weight"),
                    vec![width, 1, k.conv_kernel],
                    F32,
                    class,
                );
            }
            // The decay gate's low-rank factor has rank head_dim (128 in K3).
            push(
                "self_attn.f_a_proj.weight",
                vec![k.head_dim, d],
                Bf16,
                class,
            );
            push(
                "self_attn.f_b_proj.weight",
                vec![width, k.head_dim],
                Bf16,
                class,
            );
            push("self_attn.b_proj.weight", vec![k.num_heads, d], Bf16, class);
            push(
                "self_attn.A_log",
                vec![a_log_stored_len(k.num_heads)],
                F32,
                class,
            );
            push("self_attn.dt_bias", vec![width], F32, class);
            push("self_attn.o_norm.weight", vec![k.head_dim], F32, class);
        }
        AttentionKind::Mla => {
            let m = &c.mla;
            let class = C::MlaAttention;
            let qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let v_width = m.num_heads * m.v_head_dim;
            push(
                "self_attn.q_a_proj.weight",
                vec![m.q_lora_rank, d],
                Bf16,
                class,
            );
            push(
                "self_attn.q_a_layernorm.weight",
                vec![m.q_lora_rank],
                Bf16,
                class,
            );
            push(
                "self_attn.q_b_proj.weight",
                vec![m.num_heads * qk_head, m.q_lora_rank],
                Bf16,
                class,
            );
            push(
                "self_attn.kv_a_proj_with_mqa.weight",
                vec![m.kv_lora_rank + m.qk_rope_head_dim, d],
                Bf16,
                class,
            );
            push(
                "self_attn.kv_a_layernorm.weight",
                vec![m.kv_lora_rank],
                Bf16,
                class,
            );
            push(
                "self_attn.kv_b_proj.weight",
                vec![
                    m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                    m.kv_lora_rank,
                ],
                Bf16,
                class,
            );
            if m.output_gate {
                push("self_attn.g_proj.weight", vec![v_width, d], Bf16, class);
            }
            push("self_attn.o_proj.weight", vec![d, v_width], Bf16, class);
        }
    }
    match ffn {
        FfnKind::Dense => {
            let n = c.dense_intermediate;
            push("mlp.gate_proj.weight", vec![n, d], Bf16, C::DenseMlp);
            push("mlp.up_proj.weight", vec![n, d], Bf16, C::DenseMlp);
            push("mlp.down_proj.weight", vec![d, n], Bf16, C::DenseMlp);
        }
        FfnKind::Moe => {
            let moe = &c.moe;
            let p = "block_sparse_moe";
            push(
                &format!("{p}.gate.weight"),
                vec![moe.num_experts, d],
                Bf16,
                C::Router,
            );
            push(
                &format!("{p}.gate.e_score_correction_bias"),
                vec![moe.num_experts],
                F32,
                C::Router,
            );
            if let Some(latent) = moe.latent {
                let class = C::LatentProjections;
                push(
                    &format!("{p}.routed_expert_down_proj.weight"),
                    vec![latent.hidden, d],
                    Bf16,
                    class,
                );
                if latent.use_norm {
                    push(
                        &format!("{p}.routed_expert_norm.weight"),
                        vec![latent.hidden],
                        Bf16,
                        class,
                    );
                }
                push(
                    &format!("{p}.routed_expert_up_proj.weight"),
                    vec![d, latent.hidden],
                    Bf16,
                    class,
                );
            }
            let shared = moe.shared_intermediate();
            if shared > 0 {
                let class = C::SharedExperts;
                push(
                    &format!("{p}.shared_experts.gate_proj.weight"),
                    vec![shared, d],
                    Bf16,
                    class,
                );
                push(
                    &format!("{p}.shared_experts.up_proj.weight"),
                    vec![shared, d],
                    Bf16,
                    class,
                );
                push(
                    &format!("{p}.shared_experts.down_proj.weight"),
                    vec![d, shared],
                    Bf16,
                    class,
                );
            }
            let io = moe.expert_io(d);
            let inter = moe.expert_intermediate;
            for e in 0..moe.num_experts {
                for (w, rows, cols) in [("w1", inter, io), ("w2", io, inter), ("w3", inter, io)] {
                    for (part, shape) in [
                        ("weight_packed", vec![rows, cols / 2]),
                        ("weight_scale", vec![rows, cols / 32]),
                    ] {
                        out.push(TensorSpec {
                            name: format!("model.layers.{i}.{p}.experts.{e}.{w}.{part}"),
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
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    // w1, w3: [inter, io]; w2: [io, inter]; packed = n/2 bytes, scales = n/32 bytes.
    3 * inter * io / 2 + 3 * inter * io / 32
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
    pub text_tensors: usize,
    pub text_bytes: usize,
    /// Weight bytes one decoded token reads: every trunk tensor except the embedding table,
    /// one embedding row, and `top_k` experts in every MoE layer.
    pub bytes_per_token: usize,
}

impl BytePlan {
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
