//! The validated config's types: the model's shape as the forward pass reads it.

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
