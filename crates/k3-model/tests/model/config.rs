//! The two shared configs parse to the documented model; every required field, when removed,
//! gives an error naming it; malformed layer lists and values are rejected.

use k3_model::config::{AttentionKind, ConfigError, FfnKind, K3Config, KdaGate};
use serde_json::Value;

const REAL: &str = include_str!("../../configs/Kimi-K3.config.json");
const TINY: &str = include_str!("../../configs/Kimi-K3-0.40B.config.json");

#[test]
fn real_config_is_the_documented_k3() {
    let c = K3Config::from_json(REAL).unwrap();
    assert_eq!(
        (c.hidden_size, c.vocab_size, c.num_layers()),
        (7168, 163840, 93)
    );
    assert_eq!(c.max_position_embeddings, 1 << 20);
    let mla = c.layers_of(AttentionKind::Mla);
    let expected: Vec<usize> = (0..23).map(|i| 4 * i + 3).chain([92]).collect();
    assert_eq!(
        mla, expected,
        "MLA layers, 0-based: every 4th from 3, plus the last two"
    );
    assert_eq!(c.layers_of(AttentionKind::Kda).len(), 69);
    assert_eq!(c.layers[0].ffn, FfnKind::Dense);
    assert!(c.layers[1..].iter().all(|l| l.ffn == FfnKind::Moe));
    let snapshots: Vec<usize> = (0..93).filter(|&i| c.layers[i].attn_res_snapshot).collect();
    assert_eq!(snapshots, [0, 12, 24, 36, 48, 60, 72, 84]);
    assert_eq!(c.kda.gate, KdaGate::LowerBound(-5.0));
    assert_eq!(
        (
            c.kda.num_heads,
            c.kda.head_dim,
            c.kda.conv_kernel,
            c.kda_width()
        ),
        (96, 128, 4, 12288)
    );
    assert_eq!(
        (
            c.mla.num_heads,
            c.mla.q_lora_rank,
            c.mla.kv_lora_rank,
            c.mla.qk_nope_head_dim,
            c.mla.qk_rope_head_dim,
            c.mla.v_head_dim
        ),
        (96, 1536, 512, 128, 64, 128)
    );
    assert!(c.mla.output_gate);
    assert_eq!(c.dense_intermediate, 33792);
    assert_eq!(
        (
            c.moe.num_experts,
            c.moe.router.top_k,
            c.moe.expert_intermediate
        ),
        (896, 16, 3072)
    );
    assert_eq!(
        (c.moe.shared_intermediate(), c.moe.expert_io(c.hidden_size)),
        (6144, 3584)
    );
    assert!(c.moe.latent.unwrap().use_norm && c.moe.router.renormalize);
    assert_eq!(c.moe.router.routed_scaling_factor, 1.0);
    assert_eq!(
        (c.moe.router.num_expert_group, c.moe.router.topk_group),
        (1, 1)
    );
    assert_eq!((c.situ.beta, c.situ.linear_beta), (4.0, Some(25.0)));
    assert_eq!(c.rms_norm_eps, 1e-5);
    let q = c.quantization.unwrap();
    assert_eq!(
        (q.format.as_str(), q.group_size),
        ("mxfp4-pack-quantized", 32)
    );
    assert!(q.ignore.iter().any(|p| p.contains("self_attn")));
}

#[test]
fn tiny_config_is_the_public_040b_model() {
    let c = K3Config::from_json(TINY).unwrap();
    assert_eq!((c.hidden_size, c.num_layers()), (1024, 8));
    assert_eq!(c.layers_of(AttentionKind::Mla), [3, 7]);
    assert_eq!(
        c.kda.gate,
        KdaGate::Softplus,
        "gate_lower_bound is absent in the 0.40B model"
    );
    assert_eq!((c.kda.num_heads, c.kda.head_dim), (8, 32));
    assert_eq!(
        (
            c.moe.num_experts,
            c.moe.router.top_k,
            c.moe.num_shared_experts
        ),
        (8, 2, 1)
    );
    assert_eq!(c.moe.expert_io(c.hidden_size), 512);
    assert_eq!(c.attn_res_block_size, 4);
    assert!(c.quantization.is_none());
}

/// The shared originals and the committed copies agree (when `../shared` is beside the repo).
#[test]
fn committed_copies_match_shared() {
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/k3");
    for (name, copy) in [
        ("Kimi-K3.config.json", REAL),
        ("Kimi-K3-0.40B.config.json", TINY),
    ] {
        match std::fs::read_to_string(shared.join(name)) {
            Ok(original) => assert_eq!(original, copy, "{name} drifted from ../shared/k3"),
            Err(e) => eprintln!("note: ../shared/k3/{name} not readable ({e}); copy not compared"),
        }
    }
}

/// Removes `path` (dotted, under text_config) from the real config.
fn without(path: &str) -> String {
    let mut root: Value = serde_json::from_str(REAL).unwrap();
    let mut node = root.get_mut("text_config").unwrap();
    let mut parts: Vec<&str> = path.split('.').collect();
    let last = parts.pop().unwrap();
    for part in parts {
        node = node.get_mut(part).unwrap();
    }
    assert!(
        node.as_object_mut().unwrap().remove(last).is_some(),
        "{path} not in the real config"
    );
    root.to_string()
}

fn edited(path: &str, value: Value) -> String {
    let mut root: Value = serde_json::from_str(REAL).unwrap();
    let mut node = root.get_mut("text_config").unwrap();
    for part in path.split('.') {
        node = node.get_mut(part).unwrap();
    }
    *node = value;
    root.to_string()
}

#[test]
fn every_required_field_is_named_when_missing() {
    let required = [
        "hidden_size",
        "vocab_size",
        "max_position_embeddings",
        "num_hidden_layers",
        "rms_norm_eps",
        "hidden_act",
        "linear_attn_config",
        "linear_attn_config.kda_layers",
        "linear_attn_config.full_attn_layers",
        "linear_attn_config.num_heads",
        "linear_attn_config.head_dim",
        "linear_attn_config.short_conv_kernel_size",
        "linear_attn_config.use_full_rank_gate",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "mla_use_nope",
        "mla_use_output_gate",
        "first_k_dense_replace",
        "moe_layer_freq",
        "attn_res_block_size",
        "intermediate_size",
        "num_experts",
        "num_experts_per_token",
        "num_shared_experts",
        "moe_intermediate_size",
        "latent_moe_use_norm",
        "moe_router_activation_func",
        "moe_renormalize",
        "routed_scaling_factor",
        "topk_method",
        "num_expert_group",
        "topk_group",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "quantization_config.config_groups",
        "quantization_config.format",
    ];
    for field in required {
        let err = K3Config::from_json(&without(field)).unwrap_err();
        assert_eq!(
            err,
            ConfigError::Missing {
                field: field.to_owned()
            },
            "removing {field}"
        );
        assert!(err.to_string().contains(field));
    }
}

#[test]
fn optional_fields_have_their_documented_meaning() {
    let c = K3Config::from_json(&without("linear_attn_config.gate_lower_bound")).unwrap();
    assert_eq!(c.kda.gate, KdaGate::Softplus);
    let c = K3Config::from_json(&without("routed_expert_hidden_size")).unwrap();
    assert_eq!((c.moe.latent, c.moe.expert_io(c.hidden_size)), (None, 7168));
    let c = K3Config::from_json(&without("quantization_config")).unwrap();
    assert!(c.quantization.is_none());
    let c = K3Config::from_json(&edited("activation_situ_linear_beta", Value::Null)).unwrap();
    assert_eq!(c.situ.linear_beta, None);
}

#[test]
fn fields_fall_back_to_the_root() {
    // A flat repack: the text fields at the root, no text_config.
    let mut root: Value = serde_json::from_str(REAL).unwrap();
    let text = root["text_config"].take();
    let flat = Value::Object(text.as_object().unwrap().clone());
    let nested = K3Config::from_json(REAL).unwrap();
    assert_eq!(K3Config::from_json(&flat.to_string()).unwrap(), nested);
    // quantization_config only at the root of a nested config.
    let mut moved: Value = serde_json::from_str(REAL).unwrap();
    let q = moved["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("quantization_config")
        .unwrap();
    moved
        .as_object_mut()
        .unwrap()
        .insert("quantization_config".into(), q);
    assert_eq!(K3Config::from_json(&moved.to_string()).unwrap(), nested);
}

#[test]
fn bad_layer_lists_and_values_are_rejected_with_reasons() {
    let kda: Vec<u64> = (1..=93).filter(|i| i % 4 != 0 && *i != 93).collect();
    let cases: Vec<(String, &str)> = vec![
        (
            edited(
                "linear_attn_config.full_attn_layers",
                serde_json::json!([4, 8]),
            ),
            "in neither",
        ),
        (
            edited(
                "linear_attn_config.kda_layers",
                serde_json::json!([1, 2, 3, 4]),
            ),
            "in both",
        ),
        (
            edited("linear_attn_config.kda_layers", serde_json::json!([0, 1])),
            "outside 1..=93",
        ),
        (
            edited("linear_attn_config.kda_layers", serde_json::json!([94])),
            "outside 1..=93",
        ),
        (
            edited("linear_attn_config.kda_layers", serde_json::json!([1, 1])),
            "listed twice",
        ),
        (
            edited("linear_attn_config.kda_layers", serde_json::json!("1,2")),
            "a list",
        ),
        (
            edited(
                "linear_attn_config.full_attn_layers",
                serde_json::json!(kda.iter().chain(&[4u64]).collect::<Vec<_>>()),
            ),
            "both",
        ),
        (edited("hidden_size", serde_json::json!(0)), "at least 1"),
        (
            edited("hidden_size", serde_json::json!("7168")),
            "non-negative integer",
        ),
        (
            edited("hidden_size", serde_json::json!(-1)),
            "non-negative integer",
        ),
        (edited("rms_norm_eps", serde_json::json!(0.0)), "positive"),
        // A log-decay bound of 0 or above makes every decay ≥ 1: the state blows up to NaN.
        (
            edited(
                "linear_attn_config.gate_lower_bound",
                serde_json::json!(5.0),
            ),
            "gate_lower_bound is invalid: 5: it bounds the log-decay from below",
        ),
        (
            edited(
                "linear_attn_config.gate_lower_bound",
                serde_json::json!(0.0),
            ),
            "must be a negative number",
        ),
        (
            edited("rms_norm_eps", serde_json::json!(1e30)),
            "not below 1",
        ),
        (
            edited("max_position_embeddings", serde_json::json!(0)),
            "max_position_embeddings is invalid: must be at least 1",
        ),
        (
            edited("max_position_embeddings", serde_json::json!(1u64 << 40)),
            "exceeds the limit 16777216",
        ),
        (
            edited("vocab_size", serde_json::json!(u64::MAX)),
            "vocab_size is invalid",
        ),
        (
            edited("linear_attn_config.head_dim", serde_json::json!(1 << 20)),
            "exceed",
        ),
        (
            edited("routed_scaling_factor", serde_json::json!(0.0)),
            "routed_scaling_factor is invalid: 0 is not a positive number",
        ),
        (
            edited("first_k_dense_replace", serde_json::json!(1u64 << 30)),
            "first_k_dense_replace is invalid: 1073741824 exceeds",
        ),
        (
            edited("num_experts_per_token", serde_json::json!(897)),
            "exceeds",
        ),
        (edited("hidden_act", serde_json::json!("silu")), "SiTU"),
        (
            edited("mla_use_nope", serde_json::json!(false)),
            "not supported",
        ),
        (
            edited("moe_router_activation_func", serde_json::json!("softmax")),
            "not supported",
        ),
        (
            edited("activation_situ_beta", serde_json::json!(-4.0)),
            "positive",
        ),
        (
            edited(
                "quantization_config.format",
                serde_json::json!("nvfp4-pack-quantized"),
            ),
            "not supported",
        ),
        (
            edited(
                "quantization_config.config_groups.group_0.weights.group_size",
                serde_json::json!(16),
            ),
            "groups are 32",
        ),
        ("[1, 2]".to_owned(), "an object"),
        ("{ not json".to_owned(), "not valid JSON"),
    ];
    for (text, needle) in cases {
        let err = K3Config::from_json(&text).unwrap_err().to_string();
        assert!(err.contains(needle), "expected {needle:?} in {err:?}");
    }
}
