//! Synthetic K3 checkpoints in the release's layout (`cargo xtask gen-k3-synth`): a
//! `config.json` with the real config's keys, shards named like the release
//! (`model-00001-of-000096.safetensors`: layer `i` in shard `i + 1`, the globals in the last
//! text shard) with `model.safetensors.index.json`, tensors in lexicographic order, BF16
//! trunk, F32 vectors, `A_log` zero-padded to a power of two, experts quantised to
//! compressed-tensors MXFP4 from random weights, and tokenizer files ([`tokenizer`]).
//! [`generate_with`] stores the same checkpoint in other formats ([`SynthFormats`]): the trunk
//! in F32 (the BF16 values widened, exactly) or F16, the float vectors in BF16 or F16, chosen
//! trunk linears as MXFP4 (or their BF16 twin holding the exact dequantised values).
//!
//! Weights are uniform in `±sqrt(3 / fan_in)` (variance `1 / fan_in`), so every projection keeps
//! its input's scale; norms are 1, so RMSNorm outputs stay O(1) through any number of layers.
//! Deterministic: each tensor's values come from the seed and the tensor's name alone.

mod formats;
pub mod tokenizer;

pub use formats::{FloatFormat, SynthFormats};

use std::path::Path;

use expert_store::ExpertLayout;
use expert_store::checkpoint::{CheckpointError, Dtype};
use expert_store::writer::{TensorOut, write_safetensors};
use std::collections::HashMap;

use mxfp4_kernels::codes::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, quantize_group};
use serde_json::{Value, json};

use crate::config::{ConfigError, K3Config};
use crate::inventory::{DType, Role, TensorSpec, expert_layout, text_tensors};
use formats::{exact_in_bf16_and_f16, mxfp4_round_trip};

/// The release config, the template every preset edits.
pub const RELEASE_CONFIG: &str = include_str!("../../configs/Kimi-K3.config.json");
/// The public 0.40B test model's config.
pub const TINY_040B_CONFIG: &str = include_str!("../../configs/Kimi-K3-0.40B.config.json");

/// Checkpoint shapes to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// A few MB with every K3 feature: KDA with the K3 gate, MLA at every 4th layer and the
    /// last two, three AttnRes snapshots, dense layer 0, latent MoE with a shared expert, and
    /// 3 KDA heads so `A_log` is stored zero-padded (to 4), as in the release.
    Tiny,
    /// The public 0.40B model's shapes (its config, experts as MXFP4).
    K3_040B,
    /// The real K3 widths (hidden 7168, 96 heads, latent 3584, expert FFN 3072) with a chosen
    /// number of layers (default 2) and experts (default 32).
    K3Wide,
}

impl Preset {
    /// Every preset, in the order `--preset` lists them.
    pub const ALL: [Preset; 3] = [Preset::Tiny, Preset::K3_040B, Preset::K3Wide];

    /// The name `--preset` takes.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::K3_040B => "k3-0.40b",
            Preset::K3Wide => "k3-wide",
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown preset {s:?} (tiny, k3-0.40b, k3-wide)"))
    }
}

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthOptions {
    /// The shapes to generate.
    pub preset: Preset,
    /// Seed of every drawn value (each tensor draws from it and its name): the same seed and
    /// options write the same bytes.
    pub seed: u64,
    /// Override the preset's number of layers.
    pub layers: Option<usize>,
    /// Override the preset's number of routed experts per layer.
    pub experts: Option<usize>,
    /// Zipf-like expert popularity through the router's selection bias: expert `e` gets bias
    /// `-skew * ln(1 + e)`. 0 (the default) is flat, like the real router.
    pub router_skew: f32,
    /// Drop `gate_lower_bound`: KDA then uses the Kimi-Linear softplus decay gate (as the
    /// public 0.40B model does) instead of K3's bounded one.
    pub softplus_gate: bool,
}

impl SynthOptions {
    /// `preset` as it comes: seed 0, its layer and expert counts, a flat router, K3's gate.
    pub fn new(preset: Preset) -> Self {
        Self {
            preset,
            seed: 0,
            layers: None,
            experts: None,
            router_skew: 0.0,
            softplus_gate: false,
        }
    }
}

/// The router's selection bias for `--router-skew`: expert `e` gets `-skew * ln(1 + e)`, a
/// Zipf-like popularity (0: flat).
pub fn selection_bias(skew: f32, experts: usize) -> Vec<f32> {
    (0..experts)
        .map(|e| -skew * (1.0 + e as f32).ln())
        .collect()
}

/// What was written.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthReport {
    /// The config written, parsed.
    pub config: K3Config,
    /// Safetensors files written: one per layer and one for the globals, as in the release.
    pub shards: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written (the index's `total_size`).
    pub bytes: usize,
}

/// The config JSON of a preset (the release's keys; the text fields under `text_config`).
pub fn preset_config(preset: Preset, layers: Option<usize>, experts: Option<usize>) -> Value {
    let mut root: Value = serde_json::from_str(match preset {
        Preset::K3_040B => TINY_040B_CONFIG,
        _ => RELEASE_CONFIG,
    })
    .expect("embedded configs are JSON");
    let text = root["text_config"]
        .as_object_mut()
        .expect("embedded configs have text_config");
    let mut set = |key: &str, value: Value| {
        text.insert(key.to_owned(), value);
    };
    let default_layers = match preset {
        Preset::Tiny => {
            set("hidden_size", json!(128));
            set("vocab_size", json!(1024));
            set("intermediate_size", json!(256));
            set("num_attention_heads", json!(2));
            set("num_key_value_heads", json!(2));
            set("q_lora_rank", json!(64));
            set("kv_lora_rank", json!(32));
            set("qk_nope_head_dim", json!(32));
            set("qk_rope_head_dim", json!(16));
            set("v_head_dim", json!(32));
            set("attn_res_block_size", json!(4));
            set("num_experts", json!(8));
            set("num_experts_per_token", json!(2));
            set("num_shared_experts", json!(1));
            set("moe_intermediate_size", json!(64));
            set("routed_expert_hidden_size", json!(96));
            set("max_position_embeddings", json!(4096));
            let linear = text["linear_attn_config"]
                .as_object_mut()
                .expect("linear_attn_config");
            linear.insert("num_heads".into(), json!(3)); // 3 heads: A_log is stored padded to 4
            linear.insert("head_dim".into(), json!(32));
            9
        }
        Preset::K3_040B => {
            // Our synthetic variant stores the experts as MXFP4, like Kimi-K3-0.40B-MXFP4.
            let quantization = serde_json::from_str::<Value>(RELEASE_CONFIG).expect("JSON")["text_config"]
                ["quantization_config"]
                .clone();
            set("quantization_config", quantization);
            8
        }
        Preset::K3Wide => 2,
    };
    let layers = layers.unwrap_or(default_layers);
    // Special-token ids sit in the top 256 ids (docs/MODEL.md §10.1): move them with the vocabulary.
    let vocab = root["text_config"]["vocab_size"]
        .as_u64()
        .expect("vocab_size");
    let first_special = vocab.saturating_sub(tokenizer::SPECIAL_SLOTS as u64);
    shift_special_ids(root.as_object_mut().expect("an object"), first_special);
    shift_special_ids(
        root["text_config"].as_object_mut().expect("text_config"),
        first_special,
    );
    let text = root["text_config"].as_object_mut().expect("text_config");
    if preset != Preset::K3_040B || layers != default_layers {
        // K3's schedule: MLA at every 4th layer (1-based) and at the last one.
        let mla: Vec<usize> = (1..=layers)
            .filter(|l| l % 4 == 0 || *l == layers)
            .collect();
        let kda: Vec<usize> = (1..=layers).filter(|l| !mla.contains(l)).collect();
        let linear = text["linear_attn_config"]
            .as_object_mut()
            .expect("linear_attn_config");
        linear.insert("full_attn_layers".into(), json!(mla));
        linear.insert("kda_layers".into(), json!(kda));
        text.insert("num_hidden_layers".into(), json!(layers));
    }
    if let Some(experts) = experts.or((preset == Preset::K3Wide).then_some(32)) {
        text.insert("num_experts".into(), json!(experts));
        let top_k = text["num_experts_per_token"]
            .as_u64()
            .unwrap_or(1)
            .min(experts as u64);
        text.insert("num_experts_per_token".into(), json!(top_k));
    }
    root
}

/// Moves the special-token ids of a config object (K3: 163584 and up) to the same offsets
/// from `first_special`.
fn shift_special_ids(map: &mut serde_json::Map<String, Value>, first_special: u64) {
    for key in [
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "media_placeholder_token_id",
    ] {
        if let Some(id) = map
            .get(key)
            .and_then(Value::as_u64)
            .filter(|&id| id >= 163_584)
        {
            map.insert(key.into(), json!(first_special + id - 163_584));
        }
    }
}

/// Errors of the generator.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// The preset's config, with the options applied, does not validate.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A safetensors file could not be written.
    #[error(transparent)]
    Write(#[from] CheckpointError),
    /// Creating the directory or writing the config, tokenizer or index file failed.
    #[error("{path}: {source}")]
    Io {
        /// The directory or file.
        path: std::path::PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The options ask for a checkpoint that cannot be written (F16-rounded trunk values stored as
    /// BF16, MXFP4 over a width not a multiple of 32); holds why.
    #[error("{0}")]
    Invalid(String),
}

/// Writes a complete checkpoint for `options` into `dir` (created if needed), in the release's
/// formats.
pub fn generate(dir: &Path, options: &SynthOptions) -> Result<SynthReport, SynthError> {
    generate_with(dir, options, &SynthFormats::default())
}

/// How one written tensor is filled from its spec.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// The spec's tensor, in this format.
    Whole(FloatFormat),
    /// An MXFP4 linear's `weight_packed` or (false) `weight_scale`.
    MxFp4(bool),
    /// A routed expert's tensor (U8).
    Expert,
}

/// [`generate`], storing the non-expert tensors in `formats`.
pub fn generate_with(
    dir: &Path,
    options: &SynthOptions,
    formats: &SynthFormats,
) -> Result<SynthReport, SynthError> {
    if formats.trunk_f16_values && formats.trunk == FloatFormat::Bf16 {
        return Err(SynthError::Invalid(
            "trunk values rounded to F16 cannot be stored as BF16 exactly: use trunk f16 or f32"
                .into(),
        ));
    }
    let mut root = preset_config(options.preset, options.layers, options.experts);
    if options.softplus_gate
        && let Some(linear) = root["text_config"]["linear_attn_config"].as_object_mut()
    {
        linear.remove("gate_lower_bound");
    }
    let config = K3Config::from_json(&root.to_string())?;
    for (what, n) in [
        ("hidden_size", config.hidden_size),
        ("moe_intermediate_size", config.moe.expert_intermediate),
    ] {
        if n % 32 != 0 {
            return Err(SynthError::Invalid(format!(
                "{what} {n} is not a multiple of the MXFP4 group 32"
            )));
        }
    }
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| SynthError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&root).expect("a JSON value serialises");
    std::fs::write(&config_path, text).map_err(io(&config_path))?;

    // Layer i -> shard i + 1, the globals -> shard L + 1, as in the release.
    let layers = config.num_layers();
    let shards = layers + 1;
    let shard_name = |k: usize| format!("model-{k:05}-of-{shards:06}.safetensors");
    let mut by_shard: Vec<Vec<TensorSpec>> = vec![Vec::new(); shards];
    for spec in text_tensors(&config) {
        let shard = spec.layer.unwrap_or(layers);
        by_shard[shard].push(spec);
    }
    let mut weight_map = serde_json::Map::new();
    let (mut bytes, mut tensors) = (0, 0);
    let layout = expert_layout(&config);
    let prefix = expert_store::checkpoint::TEXT_PREFIX;
    for (k, specs) in by_shard.into_iter().enumerate() {
        let file = shard_name(k + 1);
        // Each written tensor: its header entry, its spec and how to fill it.
        let mut parts: HashMap<String, (usize, Part)> = HashMap::new();
        let mut outs: Vec<TensorOut> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let mut push = |name: String, dtype, shape, part| {
                parts.insert(name.clone(), (i, part));
                outs.push(TensorOut { name, dtype, shape });
            };
            let release = match spec.dtype {
                DType::Bf16 => FloatFormat::Bf16,
                DType::F32 => FloatFormat::F32,
                DType::U8 => {
                    push(
                        format!("{prefix}{}", spec.name),
                        Dtype::U8,
                        spec.shape.clone(),
                        Part::Expert,
                    );
                    continue;
                }
            };
            let format = match spec.role() {
                Role::Vector => formats.vectors.unwrap_or(release),
                _ if formats.is_mxfp4(spec) && formats.mxfp4_as_bf16 => FloatFormat::Bf16,
                _ if formats.is_mxfp4(spec) => {
                    let (rows, cols) = (spec.shape[0], spec.shape[1]);
                    if !cols.is_multiple_of(32) {
                        return Err(SynthError::Invalid(format!(
                            "{}: {cols} columns is not a multiple of the MXFP4 group 32",
                            spec.name
                        )));
                    }
                    let base = spec.name.strip_suffix(".weight").unwrap_or(&spec.name);
                    push(
                        format!("{prefix}{base}.weight_packed"),
                        Dtype::U8,
                        vec![rows, cols / 2],
                        Part::MxFp4(true),
                    );
                    push(
                        format!("{prefix}{base}.weight_scale"),
                        Dtype::U8,
                        vec![rows, cols / 32],
                        Part::MxFp4(false),
                    );
                    continue;
                }
                _ => formats.trunk,
            };
            push(
                format!("{prefix}{}", spec.name),
                format.dtype(),
                spec.shape.clone(),
                Part::Whole(format),
            );
        }
        for out in &outs {
            weight_map.insert(out.name.clone(), Value::String(file.clone()));
        }
        tensors += outs.len();
        bytes += write_safetensors(&dir.join(&file), outs, |t, buf| {
            let (i, part) = parts[&t.name];
            let spec = &specs[i];
            match part {
                Part::Expert => expert_fill(options.seed, &layout, spec, buf),
                Part::Whole(format) => {
                    let mut values = float_values(&config, options, spec);
                    match spec.role() {
                        Role::Vector if formats.vectors.is_some() => {
                            values
                                .iter_mut()
                                .for_each(|v| *v = exact_in_bf16_and_f16(*v));
                        }
                        Role::Linear if formats.is_mxfp4(spec) => {
                            values = mxfp4_round_trip(&values, spec.shape[1]);
                        }
                        Role::Linear if formats.trunk_f16_values => {
                            values
                                .iter_mut()
                                .for_each(|v| *v = f16_to_f32(f32_to_f16(*v)));
                        }
                        _ => {}
                    }
                    format.encode(&values, buf);
                }
                Part::MxFp4(packed) => {
                    let values = float_values(&config, options, spec);
                    for group in values.chunks_exact(32) {
                        let (codes, scale) = quantize_group(group.try_into().expect("32 values"));
                        if packed {
                            buf.extend_from_slice(&codes);
                        } else {
                            buf.push(scale);
                        }
                    }
                }
            }
        })?;
    }
    // Tokenizer files: a BPE learned from built-in text, K3's specials at the top.
    let vocab = tokenizer::learn_bpe(config.vocab_size - tokenizer::SPECIAL_SLOTS);
    let tiktoken_path = dir.join("tiktoken.model");
    std::fs::write(&tiktoken_path, tokenizer::tiktoken_model(&vocab))
        .map_err(io(&tiktoken_path))?;
    let tokenizer_path = dir.join("tokenizer_config.json");
    let tokenizer_json =
        serde_json::to_string_pretty(&tokenizer::tokenizer_config(config.vocab_size))
            .expect("JSON");
    std::fs::write(&tokenizer_path, tokenizer_json).map_err(io(&tokenizer_path))?;

    let index = json!({ "metadata": { "total_size": bytes }, "weight_map": weight_map });
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index_path,
        serde_json::to_string_pretty(&index).expect("JSON"),
    )
    .map_err(io(&index_path))?;
    Ok(SynthReport {
        config,
        shards,
        tensors,
        bytes,
    })
}

/// Appends the bytes of one routed-expert tensor (one of `layout`'s).
fn expert_fill(seed: u64, layout: &ExpertLayout, spec: &TensorSpec, buf: &mut Vec<u8>) {
    let ((layer, expert), tensor) = layout
        .parse(&spec.name)
        .expect("the inventory's expert tensors are the layout's");
    // Quantise whole rows: regenerate the matrix's random weights, group by group. The codes
    // and the scales of one matrix draw the same values (seeded by the codes' name).
    let matrix = &layout.matrices()[tensor / 2];
    let codes = matrix.codes.name(layer, expert);
    let is_codes = tensor % 2 == 0;
    expert_codes(seed, &codes, matrix.rows, matrix.cols, buf, is_codes);
}

/// The values of one float tensor (the release's BF16 ones are BF16-exact), drawn from the seed
/// and the tensor's name alone.
fn float_values(config: &K3Config, options: &SynthOptions, spec: &TensorSpec) -> Vec<f32> {
    let mut rng = Rng::new(options.seed ^ fnv1a(spec.name.as_bytes()));
    let n: usize = spec.shape.iter().product();
    let leaf = spec.name.rsplit('.').nth(1).unwrap_or("");
    let last = spec.name.rsplit('.').next().unwrap_or("");
    match spec.dtype {
        DType::U8 => unreachable!("expert tensors are filled by expert_fill"),
        DType::F32 => {
            let values: Vec<f32> = match last {
                "A_log" => {
                    // One value per head, then zero padding (docs/MODEL.md §6.4): exp(A_log) in [1, 8].
                    let heads = config.kda.num_heads;
                    (0..n)
                        .map(|i| {
                            if i < heads {
                                rng.uniform(0.0, 2.08)
                            } else {
                                0.0
                            }
                        })
                        .collect()
                }
                "dt_bias" => (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect(),
                "e_score_correction_bias" => selection_bias(options.router_skew, n),
                // o_norm weight: ones; conv taps: a smoothing kernel around 1/width.
                _ if leaf == "o_norm" => vec![1.0; n],
                _ => {
                    let width = *spec.shape.last().unwrap_or(&1) as f32;
                    (0..n).map(|_| rng.uniform(0.5, 1.5) / width).collect()
                }
            };
            values
        }
        DType::Bf16 => {
            let is_norm = leaf.ends_with("norm") || leaf.ends_with("layernorm");
            if is_norm {
                vec![1.0; n]
            } else {
                let fan_in = *spec.shape.last().unwrap_or(&1) as f32;
                let bound = (3.0 / fan_in).sqrt();
                (0..n)
                    .map(|_| bf16_to_f32(f32_to_bf16(rng.uniform(-bound, bound))))
                    .collect()
            }
        }
    }
}

/// Random expert weights `[rows, cols]` (variance `1 / cols`), quantised per 32-group; appends
/// the packed codes (`packed = true`) or the scale bytes.
fn expert_codes(
    seed: u64,
    packed_name: &str,
    rows: usize,
    cols: usize,
    buf: &mut Vec<u8>,
    packed: bool,
) {
    let mut rng = Rng::new(seed ^ fnv1a(packed_name.as_bytes()));
    let bound = (3.0 / cols as f32).sqrt();
    let mut group = [0.0f32; 32];
    for _ in 0..rows {
        for _ in 0..cols / 32 {
            group
                .iter_mut()
                .for_each(|v| *v = rng.uniform(-bound, bound));
            let (codes, scale) = quantize_group(&group);
            if packed {
                buf.extend_from_slice(&codes);
            } else {
                buf.push(scale);
            }
        }
    }
}

/// FNV-1a 64 of a name: the per-tensor seed.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// SplitMix64.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }
}
