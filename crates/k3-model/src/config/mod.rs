//! The K3 `config.json`, parsed into a typed, validated [`K3Config`].
//!
//! Fields are read from `text_config`, falling back to the root (the release nests them;
//! some repacks do not); `quantization_config` likewise. A field the forward pass needs and the
//! file lacks is an error naming it: a loader that guesses builds a model that runs and is
//! wrong. The only absences with a meaning are the ones the reference code gives one:
//! `gate_lower_bound` (absent: the Kimi-Linear softplus decay gate), `routed_expert_hidden_size`
//! (absent: experts at full width, no latent projection) and `quantization_config` (absent:
//! nothing quantised). `activation_situ_linear_beta` must be present; `null` means "no
//! transform of the up branch".

mod fields;

use serde_json::Value;

use fields::{Fields, invalid, kind, unsupported};

/// What is wrong with a config, naming the field (a dotted path from the text config).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("config is not valid JSON: {0}")]
    Json(String),
    #[error("config field {field} is missing")]
    Missing { field: String },
    #[error("config field {field} should be {expected}, found {found}")]
    WrongType {
        field: String,
        expected: &'static str,
        found: String,
    },
    #[error("config field {field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
    #[error("config field {field} = {value} is not supported: {reason}")]
    Unsupported {
        field: String,
        value: String,
        reason: &'static str,
    },
}

type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// The largest width, count or length a config may give (K3's largest is the 1,048,576-token
/// `max_position_embeddings`): a bigger value is a damaged file, and refusing it here keeps
/// every tensor size the loader computes far from overflow (two such factors fit in 2^48).
pub const MAX_DIM: usize = 1 << 24;

/// The largest `vocab_size` (token ids are `u32`; K3 has 163,840).
pub const MAX_VOCAB: usize = 1 << 24;

/// The most elements a tensor or state derived from three config factors may have.
const MAX_ELEMENTS: u128 = 1 << 40;

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Kimi Delta Attention (linear, recurrent).
    Kda,
    /// Gated multi-head latent attention (NoPE).
    Mla,
}

/// The feed-forward block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// Dense SiTU-GLU MLP of `intermediate_size`.
    Dense,
    /// Routed experts plus shared experts.
    Moe,
}

/// KDA's per-channel decay gate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdaGate {
    /// Kimi-Linear form `g = -exp(A_log[h]) * softplus(f + dt_bias)` (`gate_lower_bound` absent,
    /// as in the public 0.40B model).
    Softplus,
    /// K3's bounded form selected by `gate_lower_bound` (-5.0 in the release); the value is a
    /// parameter of the gate function, not a clamp (docs/MODEL.md §6.3).
    LowerBound(f32),
}

/// One layer's kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub attention: AttentionKind,
    pub ffn: FfnKind,
    /// This layer banks the raw layer input as an AttnRes block snapshot
    /// (`index % attn_res_block_size == 0`).
    pub attn_res_snapshot: bool,
}

/// KDA dimensions (`linear_attn_config`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub gate: KdaGate,
}

/// Gated MLA dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    pub num_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// Stored per head and per token, but never rotated (`mla_use_nope`).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The sigmoid output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
}

/// The routed-expert router.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    pub top_k: usize,
    /// Renormalise the selected weights to sum 1 (`moe_renormalize`).
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    pub num_expert_group: usize,
    pub topk_group: usize,
}

/// Latent MoE: experts run in a narrower space behind shared down/up projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentConfig {
    /// `routed_expert_hidden_size` (3584 in K3).
    pub hidden: usize,
    /// RMSNorm on the weighted expert sum before the up projection (`latent_moe_use_norm`).
    pub use_norm: bool,
}

/// MoE dimensions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Routed expert FFN width (`moe_intermediate_size`).
    pub expert_intermediate: usize,
    pub num_shared_experts: usize,
    pub latent: Option<LatentConfig>,
    pub router: RouterConfig,
}

impl MoeConfig {
    /// The width the routed experts read and write: the latent width, or the hidden size.
    pub fn expert_io(&self, hidden_size: usize) -> usize {
        self.latent.map_or(hidden_size, |l| l.hidden)
    }
    /// Width of the fused shared-expert MLP (`num_shared_experts * moe_intermediate_size`).
    pub fn shared_intermediate(&self) -> usize {
        self.num_shared_experts * self.expert_intermediate
    }
}

/// SiTU-GLU betas: `β1·tanh(g/β1)·sigmoid(g) · β2·tanh(u/β2)`, or `· u` when `linear_beta` is
/// `None`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SituBetas {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

/// The compressed-tensors quantisation the checkpoint declares.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizationConfig {
    /// `mxfp4-pack-quantized` (the only format supported).
    pub format: String,
    pub group_size: usize,
    /// Module patterns left unquantised. Informational only: the loader decides each tensor's
    /// format from its own header, never from these regexes.
    pub ignore: Vec<String>,
}

/// A validated K3 text config.
#[derive(Debug, Clone, PartialEq)]
pub struct K3Config {
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// The longest sequence the model was trained for (`max_position_embeddings`): the
    /// server's context may not exceed it, and the memory plan sizes the KV cache from the
    /// context.
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    /// One entry per decoder layer, 0-based.
    pub layers: Vec<LayerSpec>,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    /// Dense MLP width (`intermediate_size`).
    pub dense_intermediate: usize,
    pub moe: MoeConfig,
    pub situ: SituBetas,
    pub attn_res_block_size: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub quantization: Option<QuantizationConfig>,
}

impl K3Config {
    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(root) = root else {
            return Err(ConfigError::WrongType {
                field: "(root)".into(),
                expected: "an object",
                found: kind(&root),
            });
        };
        let text_config = match root.get("text_config") {
            Some(Value::Object(map)) => Some(map),
            Some(other) => {
                return Err(ConfigError::WrongType {
                    field: "text_config".into(),
                    expected: "an object",
                    found: kind(other),
                });
            }
            None => None,
        };
        Self::parse(&Fields {
            text: text_config,
            root: &root,
            prefix: String::new(),
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// 0-based indices of the layers of one attention kind.
    pub fn layers_of(&self, kind: AttentionKind) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&i| self.layers[i].attention == kind)
            .collect()
    }

    /// KDA's `num_heads * head_dim` (12288 in K3).
    pub fn kda_width(&self) -> usize {
        self.kda.num_heads * self.kda.head_dim
    }

    fn parse(f: &Fields<'_>) -> Result<Self> {
        let hidden_act = f.string("hidden_act")?;
        if hidden_act != "situ" {
            return Err(unsupported("hidden_act", &hidden_act, "K3 uses SiTU-GLU"));
        }
        let num_layers = f.positive("num_hidden_layers")?;
        let rms_norm_eps = f.float("rms_norm_eps")?;
        if rms_norm_eps <= 0.0 || !rms_norm_eps.is_finite() {
            return Err(invalid(
                "rms_norm_eps",
                format!("{rms_norm_eps} is not a positive number"),
            ));
        }
        if rms_norm_eps >= 1.0 {
            return Err(invalid(
                "rms_norm_eps",
                format!("{rms_norm_eps} is not below 1 (an epsilon, 1e-5 in K3)"),
            ));
        }

        let linear = f.object("linear_attn_config")?;
        let kda_layers = linear.one_based_layers("kda_layers", num_layers)?;
        let mla_layers = linear.one_based_layers("full_attn_layers", num_layers)?;
        if !linear.boolean("use_full_rank_gate")? {
            return Err(unsupported(
                "linear_attn_config.use_full_rank_gate",
                "false",
                "K3 has one full-rank output gate g_proj",
            ));
        }
        let gate = match linear.optional_float("gate_lower_bound")? {
            None => KdaGate::Softplus,
            Some(bound) => KdaGate::LowerBound(bound),
        };
        let kda = KdaConfig {
            num_heads: linear.positive("num_heads")?,
            head_dim: linear.positive("head_dim")?,
            conv_kernel: linear.positive("short_conv_kernel_size")?,
            gate,
        };

        if !f.boolean("mla_use_nope")? {
            return Err(unsupported(
                "mla_use_nope",
                "false",
                "K3's MLA has no positional rotation",
            ));
        }
        let mla = MlaConfig {
            num_heads: f.positive("num_attention_heads")?,
            q_lora_rank: f.positive("q_lora_rank")?,
            kv_lora_rank: f.positive("kv_lora_rank")?,
            qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: f.positive("qk_rope_head_dim")?,
            v_head_dim: f.positive("v_head_dim")?,
            output_gate: f.boolean("mla_use_output_gate")?,
        };

        let first_k_dense_replace = f.count("first_k_dense_replace")?;
        let moe_layer_freq = f.positive("moe_layer_freq")?;
        let attn_res_block_size = f.positive("attn_res_block_size")?;
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let attention = match (kda_layers.contains(&i), mla_layers.contains(&i)) {
                (true, false) => AttentionKind::Kda,
                (false, true) => AttentionKind::Mla,
                (true, true) => {
                    return Err(invalid(
                        "linear_attn_config",
                        format!(
                            "layer {} (1-based) is in both kda_layers and full_attn_layers",
                            i + 1
                        ),
                    ));
                }
                (false, false) => {
                    return Err(invalid(
                        "linear_attn_config",
                        format!(
                            "layer {} (1-based) is in neither kda_layers nor full_attn_layers",
                            i + 1
                        ),
                    ));
                }
            };
            let moe = i >= first_k_dense_replace && i % moe_layer_freq == 0;
            layers.push(LayerSpec {
                attention,
                ffn: if moe { FfnKind::Moe } else { FfnKind::Dense },
                attn_res_snapshot: i % attn_res_block_size == 0,
            });
        }

        let router_activation = f.string("moe_router_activation_func")?;
        if router_activation != "sigmoid" {
            return Err(unsupported(
                "moe_router_activation_func",
                &router_activation,
                "K3's router is sigmoid",
            ));
        }
        let topk_method = f.string("topk_method")?;
        if topk_method != "noaux_tc" {
            return Err(unsupported(
                "topk_method",
                &topk_method,
                "K3 selects with the bias-corrected noaux_tc",
            ));
        }
        let num_experts = f.positive("num_experts")?;
        let top_k = f.positive("num_experts_per_token")?;
        if top_k > num_experts {
            return Err(invalid(
                "num_experts_per_token",
                format!("{top_k} exceeds num_experts {num_experts}"),
            ));
        }
        let num_expert_group = f.positive("num_expert_group")?;
        let topk_group = f.positive("topk_group")?;
        if num_experts % num_expert_group != 0 || topk_group > num_expert_group {
            return Err(invalid(
                "num_expert_group",
                format!(
                    "{num_expert_group} groups (topk_group {topk_group}) do not divide {num_experts} experts"
                ),
            ));
        }
        let latent = match f.optional_count("routed_expert_hidden_size")? {
            None => None,
            Some(0) => {
                return Err(invalid(
                    "routed_expert_hidden_size",
                    "0 is not a width".into(),
                ));
            }
            Some(hidden) => Some(LatentConfig {
                hidden,
                use_norm: f.boolean("latent_moe_use_norm")?,
            }),
        };
        let moe = MoeConfig {
            num_experts,
            expert_intermediate: f.positive("moe_intermediate_size")?,
            num_shared_experts: f.count("num_shared_experts")?,
            latent,
            router: RouterConfig {
                top_k,
                renormalize: f.boolean("moe_renormalize")?,
                routed_scaling_factor: f.finite_positive("routed_scaling_factor")?,
                num_expert_group,
                topk_group,
            },
        };

        let situ = SituBetas {
            beta: f.float("activation_situ_beta")?,
            linear_beta: f.nullable_float("activation_situ_linear_beta")?,
        };
        for (field, beta) in [
            ("activation_situ_beta", Some(situ.beta)),
            ("activation_situ_linear_beta", situ.linear_beta),
        ] {
            if let Some(b) = beta
                && (b <= 0.0 || !b.is_finite())
            {
                return Err(invalid(field, format!("{b} is not a positive number")));
            }
        }

        // Token ids are u32 and the sampler indexes the vocabulary with them.
        let vocab_size = f.positive("vocab_size")?;
        if vocab_size > MAX_VOCAB {
            return Err(invalid(
                "vocab_size",
                format!("{vocab_size} exceeds {MAX_VOCAB} (token ids are 32-bit)"),
            ));
        }
        // The KDA state of one head is head_dim^2 floats, of a layer num_heads times that.
        let kda_state = kda.num_heads as u128 * kda.head_dim as u128 * kda.head_dim as u128;
        if kda_state > MAX_ELEMENTS {
            return Err(invalid(
                "linear_attn_config.head_dim",
                format!(
                    "{} heads of {}x{} state ({kda_state} floats per layer) exceed {MAX_ELEMENTS}",
                    kda.num_heads, kda.head_dim, kda.head_dim
                ),
            ));
        }
        Ok(Self {
            hidden_size: f.positive("hidden_size")?,
            vocab_size,
            max_position_embeddings: f.positive("max_position_embeddings")?,
            rms_norm_eps,
            layers,
            kda,
            mla,
            dense_intermediate: f.positive("intermediate_size")?,
            moe,
            situ,
            attn_res_block_size,
            first_k_dense_replace,
            moe_layer_freq,
            quantization: f.quantization()?,
        })
    }
}
