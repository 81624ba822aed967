//! `config.json` into a [`K3Config`]: each field read where the release or a repack puts it,
//! checked, and the derived sizes bounded.

use serde_json::Value;

use super::error::{ConfigError, MAX_ELEMENTS, MAX_VOCAB, Result};
use super::fields::{Fields, invalid, kind, unsupported};
use super::types::{
    AttentionKind, FfnKind, K3Config, KdaConfig, KdaGate, LatentConfig, LayerSpec, MlaConfig,
    MoeConfig, RouterConfig, SituBetas,
};

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

    /// Decoder layers (`num_hidden_layers`, 93 in K3).
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
            // The gate is `bound · sigmoid(..)`, a log-decay in (bound, 0): a bound of 0 or
            // above would make every decay exp(g) ≥ 1, so the KDA state grows without end and
            // the logits turn NaN a few tokens in, with no error (docs/MODEL.md §6.3).
            Some(bound) if !(bound.is_finite() && bound < 0.0) => {
                return Err(invalid(
                    "linear_attn_config.gate_lower_bound",
                    format!(
                        "{bound}: it bounds the log-decay from below, so it must be a negative \
                         number (K3's is -5.0)"
                    ),
                ));
            }
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
