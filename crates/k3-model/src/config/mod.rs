//! The K3 `config.json`, read ([`read_config_text`]) and parsed into a typed, validated
//! [`K3Config`].
//!
//! Fields are read from `text_config`, falling back to the root (the release nests them;
//! some repacks do not); `quantization_config` likewise. A field the forward pass needs and the
//! file lacks is an error naming it: a loader that guesses builds a model that runs and is
//! wrong. The only absences with a meaning are the ones the reference code gives one:
//! `gate_lower_bound` (absent: the Kimi-Linear softplus decay gate), `routed_expert_hidden_size`
//! (absent: experts at full width, no latent projection) and `quantization_config` (absent:
//! nothing quantised). `activation_situ_linear_beta` must be present; `null` means "no
//! transform of the up branch".

mod error;
mod fields;
mod parse;
mod read;
mod types;

pub use error::{ConfigError, MAX_DIM, MAX_VOCAB};
pub use read::{CONFIG_FILE, MAX_CONFIG_BYTES, read_config_text};
pub use types::{
    AttentionKind, FfnKind, K3Config, KdaConfig, KdaGate, LatentConfig, LayerSpec, MlaConfig,
    MoeConfig, QuantizationConfig, RouterConfig, SituBetas,
};
