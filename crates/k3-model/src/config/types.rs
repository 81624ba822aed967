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
    /// Its token mixer: KDA or gated MLA (`linear_attn_config.kda_layers` / `full_attn_layers`).
    pub attention: AttentionKind,
    /// Its feed-forward block: MoE where the index is at least `first_k_dense_replace` and a
    /// multiple of `moe_layer_freq`, else dense.
    pub ffn: FfnKind,
    /// This layer banks the raw layer input as an AttnRes block snapshot
    /// (`index % attn_res_block_size == 0`).
    pub attn_res_snapshot: bool,
}

/// KDA dimensions (`linear_attn_config`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdaConfig {
    /// KDA heads (96 in K3).
    pub num_heads: usize,
    /// Width of one head's key, value and state rows (128 in K3); a head's state is `head_dim ×
    /// head_dim` f32s.
    pub head_dim: usize,
    /// Taps of the short causal convolution on q, k and v (`short_conv_kernel_size`, 4 in K3); a
    /// session keeps the last `conv_kernel - 1` inputs.
    pub conv_kernel: usize,
    /// The decay gate's form.
    pub gate: KdaGate,
}

/// Gated MLA dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Attention heads (`num_attention_heads`, 96 in K3).
    pub num_heads: usize,
    /// Width of the low-rank query projection (1536 in K3).
    pub q_lora_rank: usize,
    /// Width of the compressed KV latent the cache holds per token (512 in K3).
    pub kv_lora_rank: usize,
    /// Per-head query/key width without position encoding (128 in K3).
    pub qk_nope_head_dim: usize,
    /// Stored per head and per token, but never rotated (`mla_use_nope`).
    pub qk_rope_head_dim: usize,
    /// Per-head value width (128 in K3).
    pub v_head_dim: usize,
    /// The sigmoid output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
}

/// The routed-expert router.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Routed experts each token selects (`num_experts_per_token`, 16 in K3).
    pub top_k: usize,
    /// Renormalise the selected weights to sum 1 (`moe_renormalize`).
    pub renormalize: bool,
    /// Multiplies the selected weights after renormalisation (1.0 in K3).
    pub routed_scaling_factor: f32,
    /// Expert groups of grouped top-k (1 in K3); checked to divide `num_experts`, and with one
    /// group the selection is a plain top-k.
    pub num_expert_group: usize,
    /// Groups a token may select from (`topk_group`, 1 in K3); at most `num_expert_group`.
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
    /// Routed experts per MoE layer (896 in K3).
    pub num_experts: usize,
    /// Routed expert FFN width (`moe_intermediate_size`).
    pub expert_intermediate: usize,
    /// Shared experts every token runs (2 in K3), fused into one MLP of
    /// [`MoeConfig::shared_intermediate`] width; 0 for none.
    pub num_shared_experts: usize,
    /// The latent projection around the routed experts; `None` runs them at the hidden size.
    pub latent: Option<LatentConfig>,
    /// How a token picks its routed experts.
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
    /// `β1`, the gate branch's bound (`activation_situ_beta`, 4.0 in K3).
    pub beta: f32,
    /// `β2`, the up branch's bound (`activation_situ_linear_beta`, 25.0 in K3); `None` (`null` in
    /// the file) leaves the up branch linear.
    pub linear_beta: Option<f32>,
}

/// The compressed-tensors quantisation the checkpoint declares.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizationConfig {
    /// `mxfp4-pack-quantized` (the only format supported).
    pub format: String,
    /// Elements per MXFP4 scale group (always 32: other sizes are refused).
    pub group_size: usize,
    /// Module patterns left unquantised. Informational only: the loader decides each tensor's
    /// format from its own header, never from these regexes.
    pub ignore: Vec<String>,
}

/// A validated K3 text config.
#[derive(Debug, Clone, PartialEq)]
pub struct K3Config {
    /// Width of the residual stream (7168 in K3).
    pub hidden_size: usize,
    /// Tokens in the vocabulary, rows of the embedding and the LM head (163,840 in K3; at most
    /// [`MAX_VOCAB`](crate::config::MAX_VOCAB)).
    pub vocab_size: usize,
    /// The longest sequence the model was trained for (`max_position_embeddings`): the
    /// server's context may not exceed it, and the memory plan sizes the KV cache from the
    /// context.
    pub max_position_embeddings: usize,
    /// The epsilon every RMSNorm adds to the mean square (1e-5 in K3; positive and below 1).
    pub rms_norm_eps: f32,
    /// One entry per decoder layer, 0-based.
    pub layers: Vec<LayerSpec>,
    /// KDA dimensions, shared by every KDA layer.
    pub kda: KdaConfig,
    /// Gated MLA dimensions, shared by every MLA layer.
    pub mla: MlaConfig,
    /// Dense MLP width (`intermediate_size`).
    pub dense_intermediate: usize,
    /// MoE dimensions, shared by every MoE layer.
    pub moe: MoeConfig,
    /// The SiTU-GLU activation's betas, shared by the dense MLPs and the experts.
    pub situ: SituBetas,
    /// Layers per AttnRes block (12 in K3): every layer whose index is a multiple of it banks a
    /// block snapshot.
    pub attn_res_block_size: usize,
    /// Leading layers with a dense MLP instead of MoE (1 in K3).
    pub first_k_dense_replace: usize,
    /// Past the first `first_k_dense_replace`, layers whose index is a multiple of this are MoE
    /// (1 in K3: all of them).
    pub moe_layer_freq: usize,
    /// The checkpoint's declared quantisation; `None` when `quantization_config` is absent.
    pub quantization: Option<QuantizationConfig>,
}
