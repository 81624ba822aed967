//! The weights as the forward pass holds them (loaded by `load`).

use std::sync::Arc;

use mxfp4_kernels::WeightMatrix;

pub(super) struct Kda<'a> {
    pub(super) q: WeightMatrix<'a>,
    pub(super) k: WeightMatrix<'a>,
    pub(super) v: WeightMatrix<'a>,
    pub(super) g: WeightMatrix<'a>,
    pub(super) o: WeightMatrix<'a>,
    pub(super) conv: [Arc<[f32]>; 3],
    pub(super) f_a: WeightMatrix<'a>,
    pub(super) f_b: WeightMatrix<'a>,
    pub(super) b: WeightMatrix<'a>,
    pub(super) a_log: Arc<[f32]>,
    pub(super) dt_bias: Arc<[f32]>,
    pub(super) o_norm: Arc<[f32]>,
}

pub(super) struct Mla<'a> {
    pub(super) q_a: WeightMatrix<'a>,
    pub(super) q_a_norm: Arc<[f32]>,
    pub(super) q_b: WeightMatrix<'a>,
    pub(super) kv_a: WeightMatrix<'a>,
    pub(super) kv_a_norm: Arc<[f32]>,
    /// `kv_b_proj` widened to f32, `[heads * (nope + v), kv_lora_rank]` (read transposed).
    pub(super) kv_b: Arc<[f32]>,
    pub(super) g: Option<WeightMatrix<'a>>,
    pub(super) o: WeightMatrix<'a>,
}

pub(super) struct Mlp<'a> {
    pub(super) gate: WeightMatrix<'a>,
    pub(super) up: WeightMatrix<'a>,
    pub(super) down: WeightMatrix<'a>,
}

/// The latent down-projection, the latent norm (if the config has one), the up-projection.
pub(super) type Latent<'a> = (WeightMatrix<'a>, Option<Arc<[f32]>>, WeightMatrix<'a>);

pub(super) struct Moe<'a> {
    pub(super) router: WeightMatrix<'a>,
    pub(super) bias: Arc<[f32]>,
    pub(super) latent: Option<Latent<'a>>,
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
    pub(super) input_norm: Arc<[f32]>,
    pub(super) post_norm: Arc<[f32]>,
    /// `self_attention_res_norm ⊙ self_attention_res_proj`, folded once.
    pub(super) attn_res_score: Arc<[f32]>,
    pub(super) mlp_res_score: Arc<[f32]>,
    pub(super) attention: Attention<'a>,
    pub(super) ffn: Ffn<'a>,
}
