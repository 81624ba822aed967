//! The metadata of a `kimi-k3` GGUF (see `gguf_k3`): the keys the vendored converter's
//! `TextModel.set_gguf_parameters` and `KimiK3Model.set_gguf_parameters` write for a K3
//! config, with the values and value types gguf-py gives them, and the byte-level vocabulary of
//! `xtask/oracle/llamacpp_convert.py`.

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value as Json;

use crate::gguf::Value;

/// The type of the trunk's matrices (`--outtype`); vectors and norms are F32 either way.
/// `Q8_0` quantises only the set `gguf_k3::q8_0_quantised` names and writes the rest as `Bf16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outtype {
    F32,
    Bf16,
    Q8_0,
}

const ARCH: &str = "kimi-k3";
/// `GGML_QUANT_VERSION`.
const QUANT_VERSION: u32 = 2;
/// `ExpertGatingFuncType.SIGMOID`.
const GATING_SIGMOID: u32 = 2;
/// `LlamaFileType`: ALL_F32, MOSTLY_Q8_0, MOSTLY_BF16, MOSTLY_MXFP4_MOE.
const FTYPE_F32: u32 = 0;
const FTYPE_Q8_0: u32 = 7;
const FTYPE_BF16: u32 = 32;
const FTYPE_MXFP4_MOE: u32 = 38;
/// `TokenType.NORMAL` and `TokenType.UNUSED`.
const TOKEN_NORMAL: i32 = 1;
const TOKEN_UNUSED: i32 = 5;

/// The converter's `hparams`: the root of config.json with `text_config` laid over it.
pub(crate) fn merged_hparams(root: &Json) -> Result<Json> {
    let mut merged = root
        .as_object()
        .context("config.json is not an object")?
        .clone();
    if let Some(text) = root.get("text_config").and_then(Json::as_object) {
        merged.extend(text.clone());
    }
    Ok(Json::Object(merged))
}

/// The first of `keys` present (`find_hparam`).
fn find<'a>(hp: &'a Json, keys: &[&str]) -> Option<&'a Json> {
    keys.iter()
        .find_map(|k| hp.get(*k).filter(|v| !v.is_null()))
}

fn uint(hp: &Json, keys: &[&str]) -> Result<Option<u32>> {
    find(hp, keys)
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| format!("config {} = {v} is not a u32", keys[0]))
        })
        .transpose()
}

fn need_uint(hp: &Json, key: &str) -> Result<u32> {
    uint(hp, &[key])?.with_context(|| format!("config has no {key}"))
}

fn float(hp: &Json, key: &str) -> Result<f32> {
    hp.get(key)
        .and_then(Json::as_f64)
        .map(|v| v as f32)
        .with_context(|| format!("config has no number {key}"))
}

/// Every key/value the converter writes for this config (`name`: `general.name`).
pub(crate) fn metadata(
    hp: &Json,
    name: &str,
    outtype: Outtype,
    mxfp4: bool,
) -> Result<Vec<(String, Value)>> {
    for key in [
        "rope_parameters",
        "rope_scaling",
        "head_dim",
        "layer_norm_eps",
    ] {
        ensure!(
            hp.get(key).is_none_or(Json::is_null),
            "config has {key}, which the converter would turn into keys this writer does not write"
        );
    }
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut general = |k: &str, v: Value| kv.push((format!("general.{k}"), v));
    general("architecture", Value::Str(ARCH.into()));
    general("type", Value::Str("model".into()));
    general("name", Value::Str(name.into()));
    let mut arch = |k: &str, v: Value| kv.push((format!("{ARCH}.{k}"), v));
    let u = Value::U32;
    let layers = need_uint(hp, "num_hidden_layers")?;
    arch("block_count", u(layers));
    if let Some(n) = uint(hp, &["max_position_embeddings", "n_ctx", "n_positions"])? {
        arch("context_length", u(n));
    }
    arch("embedding_length", u(need_uint(hp, "hidden_size")?));
    if let Some(n) = uint(
        hp,
        &[
            "prefix_dense_intermediate_size",
            "dense_intermediate_size",
            "intermediate_size",
        ],
    )? {
        arch("feed_forward_length", u(n));
    }
    arch(
        "attention.head_count",
        u(need_uint(hp, "num_attention_heads")?),
    );
    // MLA is served as MQA: one KV head on full-attention layers, none on KDA layers.
    let lin = &hp["linear_attn_config"];
    let full: Vec<u64> = lin["full_attn_layers"]
        .as_array()
        .context("config has no linear_attn_config.full_attn_layers")?
        .iter()
        .map(|v| v.as_u64().context("full_attn_layers holds a non-integer"))
        .collect::<Result<_>>()?;
    let kv_heads = (0..u64::from(layers))
        .map(|i| i32::from(full.contains(&(i + 1))))
        .collect();
    arch("attention.head_count_kv", Value::I32s(kv_heads));
    // `rope_theta` (transformers derives it for K3's config; the public 0.40B config carries
    // it) is written as the vendored converter writes it (`add_rope_freq_base`, its base
    // `TextModel`); K3 rotates nothing (MLA is NoPE), so neither engine reads it.
    if let Some(theta) = hp.get("rope_theta").filter(|v| !v.is_null()) {
        let theta = theta
            .as_f64()
            .context("config rope_theta is not a number")?;
        arch("rope.freq_base", Value::F32(theta as f32));
    }
    arch(
        "attention.layer_norm_rms_epsilon",
        Value::F32(float(hp, "rms_norm_eps")?),
    );
    if let Some(n) = uint(
        hp,
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )? {
        arch("expert_count", u(n));
    }
    if let Some(n) = uint(
        hp,
        &[
            "num_experts_per_tok",
            "num_experts_per_token",
            "top_k_experts",
        ],
    )? {
        arch("expert_used_count", u(n));
    }
    if let Some(n) = uint(hp, &["n_group"])? {
        arch("expert_group_count", u(n));
    }
    if let Some(n) = uint(hp, &["topk_group"])? {
        arch("expert_group_used_count", u(n));
    }
    let activation = hp["moe_router_activation_func"].as_str();
    if activation != Some("sigmoid") {
        bail!("moe_router_activation_func is {activation:?}; the K3 converter requires sigmoid");
    }
    arch("expert_gating_func", u(GATING_SIGMOID));
    // The converter's `KimiK3Model.prepare_tensors` labels a file with MXFP4 experts
    // MOSTLY_MXFP4_MOE whatever its `--outtype`, even q8_0. Our q8_0 is not the converter's
    // (see `gguf_k3`): it says MOSTLY_Q8_0, as llama-quantize's Q8_0 of the BF16 file does, so
    // llama-bench's model column tells the two files apart.
    let ftype = match (mxfp4, outtype) {
        (_, Outtype::Q8_0) => FTYPE_Q8_0,
        (true, _) => FTYPE_MXFP4_MOE,
        (false, Outtype::F32) => FTYPE_F32,
        (false, Outtype::Bf16) => FTYPE_BF16,
    };
    kv.push(("general.file_type".into(), u(ftype)));
    let mut arch = |k: &str, v: Value| kv.push((format!("{ARCH}.{k}"), v));
    arch("vocab_size", u(need_uint(hp, "vocab_size")?));
    arch(
        "ssm.conv_kernel",
        u(need_uint(lin, "short_conv_kernel_size")?),
    );
    arch("kda.head_dim", u(need_uint(lin, "head_dim")?));
    if lin.get("gate_lower_bound").is_some_and(|v| !v.is_null()) {
        arch(
            "kda.gate_lower_bound",
            Value::F32(float(lin, "gate_lower_bound")?),
        );
    }
    if let Some(n) = uint(hp, &["q_lora_rank"])? {
        arch("attention.q_lora_rank", u(n));
    }
    let kv_lora = need_uint(hp, "kv_lora_rank")?;
    arch("attention.kv_lora_rank", u(kv_lora));
    let (nope, rope) = (
        need_uint(hp, "qk_nope_head_dim")?,
        need_uint(hp, "qk_rope_head_dim")?,
    );
    ensure!(
        hp["mla_use_nope"].as_bool() == Some(true),
        "config mla_use_nope is not true"
    );
    arch("rope.dimension_count", u(rope));
    arch("attention.key_length", u(kv_lora + rope));
    arch("attention.value_length", u(kv_lora));
    arch("attention.key_length_mla", u(nope + rope));
    arch(
        "attention.value_length_mla",
        u(need_uint(hp, "v_head_dim")?),
    );
    arch(
        "expert_feed_forward_length",
        u(need_uint(hp, "moe_intermediate_size")?),
    );
    arch(
        "expert_shared_count",
        u(need_uint(hp, "num_shared_experts")?),
    );
    arch(
        "leading_dense_block_count",
        u(need_uint(hp, "first_k_dense_replace")?),
    );
    arch(
        "expert_weights_scale",
        Value::F32(float(hp, "routed_scaling_factor")?),
    );
    let renorm = hp["moe_renormalize"]
        .as_bool()
        .context("config has no bool moe_renormalize")?;
    arch("expert_weights_norm", Value::Bool(renorm));
    arch("expert_gating_func", u(GATING_SIGMOID));
    if let Some(n) = uint(hp, &["routed_expert_hidden_size"])? {
        arch("expert_latent_length", u(n));
    }
    ensure!(
        hp["hidden_act"].as_str() == Some("situ"),
        "config hidden_act is not situ"
    );
    arch(
        "activation.situ_beta",
        Value::F32(float(hp, "activation_situ_beta")?),
    );
    arch(
        "activation.situ_linear_beta",
        Value::F32(float(hp, "activation_situ_linear_beta")?),
    );
    arch(
        "attn_res.block_size",
        u(need_uint(hp, "attn_res_block_size")?),
    );
    kv.push(("general.quantization_version".into(), u(QUANT_VERSION)));
    let vocab = need_uint(hp, "vocab_size")? as usize;
    ensure!(
        vocab >= 256,
        "vocab_size {vocab} is below the 256 byte tokens"
    );
    let mut tokens = gpt2_byte_chars();
    tokens.extend((256..vocab).map(|i| format!("[PAD{i}]")));
    let types = (0..vocab)
        .map(|i| if i < 256 { TOKEN_NORMAL } else { TOKEN_UNUSED })
        .collect();
    kv.push(("tokenizer.ggml.model".into(), Value::Str("gpt2".into())));
    kv.push(("tokenizer.ggml.pre".into(), Value::Str("kimi-k2".into())));
    kv.push(("tokenizer.ggml.tokens".into(), Value::Strs(tokens)));
    kv.push(("tokenizer.ggml.token_type".into(), Value::I32s(types)));
    // The converter writes expert_gating_func twice (the base class and K3's); gguf-py keeps
    // the last value in the first key's place.
    let mut seen: Vec<(String, Value)> = Vec::with_capacity(kv.len());
    for (k, v) in kv {
        match seen.iter_mut().find(|(s, _)| *s == k) {
            Some(slot) => slot.1 = v,
            None => seen.push((k, v)),
        }
    }
    Ok(seen)
}

/// GGPT-2's printable stand-in for each byte (the byte-level BPE alphabet).
fn gpt2_byte_chars() -> Vec<String> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).expect("a valid scalar").to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `xtask/oracle/llamacpp_gguf_keys.py --llama-cpp DIR
    /// crates/k3-model/tests/data/ct_tiny/config.json 38` printed (the vendored converter's own
    /// `set_gguf_parameters`), in its order.
    fn converter_keys() -> Vec<(&'static str, Value)> {
        let u = Value::U32;
        vec![
            ("general.architecture", Value::Str("kimi-k3".into())),
            ("kimi-k3.block_count", u(2)),
            ("kimi-k3.context_length", u(4096)),
            ("kimi-k3.embedding_length", u(128)),
            ("kimi-k3.feed_forward_length", u(256)),
            ("kimi-k3.attention.head_count", u(2)),
            ("kimi-k3.attention.head_count_kv", Value::I32s(vec![0, 1])),
            ("kimi-k3.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("kimi-k3.expert_count", u(4)),
            ("kimi-k3.expert_used_count", u(2)),
            ("kimi-k3.expert_group_used_count", u(1)),
            ("kimi-k3.expert_gating_func", u(2)),
            ("general.file_type", u(38)),
            ("kimi-k3.vocab_size", u(1024)),
            ("kimi-k3.ssm.conv_kernel", u(4)),
            ("kimi-k3.kda.head_dim", u(32)),
            ("kimi-k3.kda.gate_lower_bound", Value::F32(-5.0)),
            ("kimi-k3.attention.q_lora_rank", u(64)),
            ("kimi-k3.attention.kv_lora_rank", u(32)),
            ("kimi-k3.rope.dimension_count", u(16)),
            ("kimi-k3.attention.key_length", u(48)),
            ("kimi-k3.attention.value_length", u(32)),
            ("kimi-k3.attention.key_length_mla", u(48)),
            ("kimi-k3.attention.value_length_mla", u(32)),
            ("kimi-k3.expert_feed_forward_length", u(64)),
            ("kimi-k3.expert_shared_count", u(1)),
            ("kimi-k3.leading_dense_block_count", u(1)),
            ("kimi-k3.expert_weights_scale", Value::F32(1.0)),
            ("kimi-k3.expert_weights_norm", Value::Bool(true)),
            ("kimi-k3.expert_latent_length", u(96)),
            ("kimi-k3.activation.situ_beta", Value::F32(4.0)),
            ("kimi-k3.activation.situ_linear_beta", Value::F32(25.0)),
            ("kimi-k3.attn_res.block_size", u(4)),
        ]
    }

    #[test]
    fn metadata_is_what_the_vendored_converter_writes() {
        let path = crate::from_root("crates/k3-model/tests/data/ct_tiny/config.json");
        let root: Json = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let hp = merged_hparams(&root).unwrap();
        let kv = metadata(&hp, "ct_tiny", Outtype::Bf16, true).unwrap();
        // Ours adds what the converter writes elsewhere: general.type/name and the quantization
        // version (prepare_metadata), and the wrapper's byte-level vocabulary.
        let extra = [
            "general.type",
            "general.name",
            "general.quantization_version",
        ];
        let converter: Vec<(&str, Value)> = kv
            .iter()
            .filter(|(k, _)| !extra.contains(&k.as_str()) && !k.starts_with("tokenizer."))
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        assert_eq!(converter, converter_keys());
        let find = |key: &str| kv.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        assert_eq!(find("general.quantization_version"), Some(Value::U32(2)));
        let Some(Value::Strs(tokens)) = find("tokenizer.ggml.tokens") else {
            panic!("no tokens")
        };
        assert_eq!((tokens.len(), tokens[256].as_str()), (1024, "[PAD256]"));
        // Without MXFP4 experts the file type follows the outtype.
        let f32_kv = metadata(&hp, "x", Outtype::F32, false).unwrap();
        assert!(f32_kv.contains(&("general.file_type".into(), Value::U32(0))));
        let q8_kv = metadata(&hp, "x", Outtype::Q8_0, false).unwrap();
        assert!(q8_kv.contains(&("general.file_type".into(), Value::U32(7))));
        // With them too (the converter would say MOSTLY_MXFP4_MOE, llama-quantize MOSTLY_Q8_0).
        let q8_kv = metadata(&hp, "x", Outtype::Q8_0, true).unwrap();
        assert!(q8_kv.contains(&("general.file_type".into(), Value::U32(7))));
    }

    #[test]
    fn a_config_the_writer_does_not_cover_is_refused() {
        let mut root: Json = serde_json::from_str(
            &std::fs::read_to_string(crate::from_root(
                "crates/k3-model/tests/data/ct_tiny/config.json",
            ))
            .unwrap(),
        )
        .unwrap();
        let mut scaled = root.clone();
        scaled["text_config"]["rope_scaling"] = serde_json::json!({"type": "yarn"});
        let e = metadata(&merged_hparams(&scaled).unwrap(), "x", Outtype::Bf16, true).unwrap_err();
        assert!(e.to_string().contains("rope_scaling"), "{e}");
        // `rope_theta` (the public 0.40B config's) becomes the converter's rope.freq_base.
        root["text_config"]["rope_theta"] = 10000.0.into();
        let kv = metadata(&merged_hparams(&root).unwrap(), "x", Outtype::Bf16, true).unwrap();
        let base = kv.iter().find(|(k, _)| k == "kimi-k3.rope.freq_base");
        assert_eq!(base.map(|(_, v)| v), Some(&Value::F32(10000.0)));
    }

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let chars = gpt2_byte_chars();
        assert_eq!(chars[b'A' as usize], "A");
        assert_eq!(chars[0], "\u{100}");
        assert_eq!(chars[b' ' as usize], "\u{120}");
        assert_eq!(chars[0xad], "\u{143}");
        let mut unique = chars.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 256);
    }
}
