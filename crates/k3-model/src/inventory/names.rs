//! Every K3 text tensor's name, spelled once: the inventory lists them, the loader and the
//! checkpoint checks read them, the synthetic generator writes them. Names are relative to the
//! text model (the release prefixes them with `language_model.`). A block's names come as a
//! struct of strings so a reader sees each weight next to its name.

use expert_store::{ExpertLayout, MatrixLayout};

use crate::config::K3Config;

/// The token embedding `[vocab, hidden]`.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The output projection `[vocab, hidden]`.
pub const LM_HEAD: &str = "lm_head.weight";
/// The final RMSNorm weight.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The output AttnRes mix: its norm and its `[1, hidden]` projection.
pub const OUTPUT_RES_NORM: &str = "model.output_attn_res_norm.weight";
/// The output AttnRes mix's `[1, hidden]` projection (its norm is [`OUTPUT_RES_NORM`]).
pub const OUTPUT_RES_PROJ: &str = "model.output_attn_res_proj.weight";

/// The leaf name of a KDA layer's `A_log` (the one vector stored padded, docs/MODEL.md §6.4).
pub const A_LOG: &str = "self_attn.A_log";

fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// A decoder layer's norms and AttnRes vectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerNames {
    /// RMSNorm before the token mixer (`input_layernorm`, `[hidden]`).
    pub input_norm: String,
    /// RMSNorm before the FFN (`post_attention_layernorm`, `[hidden]`).
    pub post_norm: String,
    /// The AttnRes mix before the token mixer: its norm (`[hidden]`; never read at layer 0).
    pub attn_res_norm: String,
    /// `[1, hidden]`.
    pub attn_res_proj: String,
    /// The AttnRes mix before the FFN: its norm (`[hidden]`).
    pub mlp_res_norm: String,
    /// `[1, hidden]`.
    pub mlp_res_proj: String,
}

impl LayerNames {
    /// The names of decoder layer `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        let p = layer_prefix(layer);
        Self {
            input_norm: format!("{p}input_layernorm.weight"),
            post_norm: format!("{p}post_attention_layernorm.weight"),
            attn_res_norm: format!("{p}self_attention_res_norm.weight"),
            attn_res_proj: format!("{p}self_attention_res_proj.weight"),
            mlp_res_norm: format!("{p}mlp_res_norm.weight"),
            mlp_res_proj: format!("{p}mlp_res_proj.weight"),
        }
    }
}

/// A KDA layer's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdaNames {
    /// Query projection `[heads·head_dim, hidden]`.
    pub q: String,
    /// Key projection `[heads·head_dim, hidden]`.
    pub k: String,
    /// Value projection `[heads·head_dim, hidden]`.
    pub v: String,
    /// Output gate projection `[heads·head_dim, hidden]` (`g_proj`, the name MLA's gate shares).
    pub g: String,
    /// Output projection `[hidden, heads·head_dim]`.
    pub o: String,
    /// The q, k and v short convolutions' taps.
    pub conv: [String; 3],
    /// Decay gate's low-rank down projection `[head_dim, hidden]` (`f = Wfb (Wfa x)`).
    pub f_a: String,
    /// Decay gate's low-rank up projection `[heads·head_dim, head_dim]`.
    pub f_b: String,
    /// β projection `[heads, hidden]` (`β = sigmoid(Wb x)`, one per head).
    pub b: String,
    /// Per-head decay scale `A_log` (F32, stored padded; [`A_LOG`]).
    pub a_log: String,
    /// Per-channel decay gate bias `[heads·head_dim]` (F32).
    pub dt_bias: String,
    /// RMSNorm weight on each head's output `[head_dim]` (F32, shared by all heads).
    pub o_norm: String,
}

impl KdaNames {
    /// The names of KDA layer `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        let p = format!("{}self_attn.", layer_prefix(layer));
        Self {
            q: format!("{p}q_proj.weight"),
            k: format!("{p}k_proj.weight"),
            v: format!("{p}v_proj.weight"),
            g: format!("{p}g_proj.weight"),
            o: format!("{p}o_proj.weight"),
            conv: ["q", "k", "v"].map(|x| format!("{p}{x}_conv1d.weight")),
            f_a: format!("{p}f_a_proj.weight"),
            f_b: format!("{p}f_b_proj.weight"),
            b: format!("{p}b_proj.weight"),
            a_log: format!("{}{A_LOG}", layer_prefix(layer)),
            dt_bias: format!("{p}dt_bias"),
            o_norm: format!("{p}o_norm.weight"),
        }
    }
}

/// A gated-MLA layer's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaNames {
    /// Query down projection `[q_lora_rank, hidden]`.
    pub q_a: String,
    /// RMSNorm on the query latent `[q_lora_rank]`.
    pub q_a_norm: String,
    /// Query up projection `[heads·(nope + rope), q_lora_rank]`.
    pub q_b: String,
    /// KV down projection `[kv_lora_rank + rope, hidden]`: the cached latent and the shared `k_pe`.
    pub kv_a: String,
    /// RMSNorm on the KV latent `[kv_lora_rank]`.
    pub kv_a_norm: String,
    /// KV up projection `[heads·(nope + v), kv_lora_rank]`: per head the key rows (W_UK), then the
    /// value rows (W_UV).
    pub kv_b: String,
    /// The output gate (present when the config has one).
    pub g: String,
    /// Output projection `[hidden, heads·v_head_dim]`.
    pub o: String,
}

impl MlaNames {
    /// The names of MLA layer `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        let p = format!("{}self_attn.", layer_prefix(layer));
        Self {
            q_a: format!("{p}q_a_proj.weight"),
            q_a_norm: format!("{p}q_a_layernorm.weight"),
            q_b: format!("{p}q_b_proj.weight"),
            kv_a: format!("{p}kv_a_proj_with_mqa.weight"),
            kv_a_norm: format!("{p}kv_a_layernorm.weight"),
            kv_b: format!("{p}kv_b_proj.weight"),
            g: format!("{p}g_proj.weight"),
            o: format!("{p}o_proj.weight"),
        }
    }
}

/// A SwiGLU-style MLP's three projections: a dense layer's, or a MoE layer's shared experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpNames {
    /// Gate projection `[intermediate, hidden]` (the SiTU gate branch).
    pub gate: String,
    /// Up projection `[intermediate, hidden]`.
    pub up: String,
    /// Down projection `[hidden, intermediate]`.
    pub down: String,
}

impl MlpNames {
    fn under(p: &str) -> Self {
        Self {
            gate: format!("{p}gate_proj.weight"),
            up: format!("{p}up_proj.weight"),
            down: format!("{p}down_proj.weight"),
        }
    }

    /// A dense layer's MLP.
    pub fn dense(layer: usize) -> Self {
        Self::under(&format!("{}mlp.", layer_prefix(layer)))
    }
}

/// A MoE layer's tensors other than the routed experts ([`expert_layout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeNames {
    /// Router weight `[num_experts, hidden]` (`gate.weight`).
    pub router: String,
    /// Selection bias `[num_experts]` (F32, `e_score_correction_bias`): added to the scores for
    /// choosing only.
    pub router_bias: String,
    /// Latent down projection `[latent, hidden]` (present with a latent MoE).
    pub latent_down: String,
    /// Present when the config's latent MoE uses a norm.
    pub latent_norm: String,
    /// Latent up projection `[hidden, latent]` (present with a latent MoE).
    pub latent_up: String,
    /// The shared experts' fused MLP (present when the config has shared experts).
    pub shared: MlpNames,
}

impl MoeNames {
    /// The names of MoE layer `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        let p = format!("{}block_sparse_moe.", layer_prefix(layer));
        Self {
            router: format!("{p}gate.weight"),
            router_bias: format!("{p}gate.e_score_correction_bias"),
            latent_down: format!("{p}routed_expert_down_proj.weight"),
            latent_norm: format!("{p}routed_expert_norm.weight"),
            latent_up: format!("{p}routed_expert_up_proj.weight"),
            shared: MlpNames::under(&format!("{p}shared_experts.")),
        }
    }
}

/// K3's routed expert as the expert store and the mapped model read it: gate (`w1`) and up
/// (`w3`) `[intermediate, io]`, down (`w2`) `[io, intermediate]`, each MXFP4 as
/// compressed-tensors' `weight_packed` + `weight_scale`, in that order (the order
/// [`expert_store::Expert::matrices`] hands them out and the forward pass takes them).
pub fn expert_layout(config: &K3Config) -> ExpertLayout {
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    let matrix = |what, w: &str, rows, cols| {
        let base = format!("model.layers.{{layer}}.block_sparse_moe.experts.{{expert}}.{w}");
        MatrixLayout::new(
            what,
            &format!("{base}.weight_packed"),
            &format!("{base}.weight_scale"),
            rows,
            cols,
        )
        .expect("K3's expert tensor names are valid patterns")
    };
    ExpertLayout::new(vec![
        matrix("expert w1 (gate)", "w1", inter, io),
        matrix("expert w3 (up)", "w3", inter, io),
        matrix("expert w2 (down)", "w2", io, inter),
    ])
    .expect("three matrices under distinct names")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::K3Config;
    use crate::inventory::{TensorClass, text_tensors};
    use crate::synth::{Preset, preset_config};

    /// The release's spelling of a few names (docs/MODEL.md §3), pinned.
    #[test]
    fn names_are_the_releases() {
        assert_eq!(KdaNames::new(3).a_log, "model.layers.3.self_attn.A_log");
        assert_eq!(
            KdaNames::new(0).conv[2],
            "model.layers.0.self_attn.v_conv1d.weight"
        );
        assert_eq!(
            MlaNames::new(4).kv_a,
            "model.layers.4.self_attn.kv_a_proj_with_mqa.weight"
        );
        assert_eq!(
            MlpNames::dense(0).down,
            "model.layers.0.mlp.down_proj.weight"
        );
        let moe = MoeNames::new(5);
        assert_eq!(
            moe.router_bias,
            "model.layers.5.block_sparse_moe.gate.e_score_correction_bias"
        );
        assert_eq!(
            moe.shared.up,
            "model.layers.5.block_sparse_moe.shared_experts.up_proj.weight"
        );
        assert_eq!(
            LayerNames::new(1).mlp_res_proj,
            "model.layers.1.mlp_res_proj.weight"
        );
    }

    /// K3's expert layout: gate w1, up w3, down w2, each codes then scales, and it finds
    /// exactly the inventory's routed-expert tensors.
    #[test]
    fn the_expert_layout_matches_the_inventory() {
        let json = preset_config(Preset::Tiny, None, None).to_string();
        let config = K3Config::from_json(&json).unwrap();
        let layout = expert_layout(&config);
        let names: Vec<String> = layout.tensors().map(|p| p.name(2, 7)).collect();
        let base = "model.layers.2.block_sparse_moe.experts.7";
        assert_eq!(
            names,
            [
                "w1.weight_packed",
                "w1.weight_scale",
                "w3.weight_packed",
                "w3.weight_scale",
                "w2.weight_packed",
                "w2.weight_scale"
            ]
            .map(|t| format!("{base}.{t}"))
        );
        for spec in text_tensors(&config) {
            let parsed = layout.parse(&spec.name);
            if spec.class == TensorClass::RoutedExperts {
                let (key, _) = parsed.unwrap_or_else(|| panic!("{}", spec.name));
                assert_eq!(Some(key), spec.layer.zip(spec.expert), "{}", spec.name);
            } else {
                assert_eq!(parsed, None, "{}", spec.name);
            }
        }
    }
}
