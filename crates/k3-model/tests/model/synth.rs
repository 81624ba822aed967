//! The generator and the loader agree: a `tiny` checkpoint is written, opened, validated
//! against its own config, and its experts decode; generation is deterministic and fast.

use std::path::Path;
use std::time::Instant;

use expert_store::Checkpoint;
use k3_model::checks::{a_log, validate, validate_expert_scales};
use k3_model::config::{AttentionKind, FfnKind, K3Config, KdaGate};
use k3_model::inventory::text_tensors;
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;

fn tiny(seed: u64) -> SynthOptions {
    SynthOptions {
        preset: Preset::Tiny,
        seed,
        layers: None,
        experts: None,
        router_skew: 0.0,
        softplus_gate: false,
    }
}

#[test]
fn tiny_round_trips_through_the_loader() {
    let scratch = Scratch::new("synth-tiny");
    let start = Instant::now();
    let report = generate(scratch.path(), &tiny(7)).unwrap();
    let elapsed = start.elapsed();
    assert!(elapsed.as_secs_f64() < 5.0, "tiny took {elapsed:?}");
    eprintln!(
        "tiny: {} tensors, {} bytes, {} shards in {elapsed:?}",
        report.tensors, report.bytes, report.shards
    );

    // The written config parses to the config the generator used, with every K3 feature.
    let config =
        K3Config::from_json(&std::fs::read_to_string(scratch.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config, report.config);
    assert_eq!(
        config.layers_of(AttentionKind::Mla),
        [3, 7, 8],
        "every 4th layer and the last two"
    );
    assert!(matches!(config.kda.gate, KdaGate::LowerBound(_)));
    assert_eq!(config.layers[0].ffn, FfnKind::Dense);
    assert!(config.layers.iter().filter(|l| l.attn_res_snapshot).count() >= 2);
    assert!(config.moe.latent.is_some() && config.moe.num_shared_experts > 0);

    // Tokenizer files: ranks 0..n in order, K3's specials at the top 256 ids.
    let tiktoken = std::fs::read_to_string(scratch.path().join("tiktoken.model")).unwrap();
    let ranks: Vec<usize> = tiktoken
        .lines()
        .map(|l| l.split_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert!(
        ranks.len() > 256 + 100 && ranks.iter().enumerate().all(|(i, &r)| i == r),
        "{} ranks",
        ranks.len()
    );
    assert!(ranks.len() <= config.vocab_size - 256);
    let tokenizer: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(scratch.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let first_special = config.vocab_size - 256;
    let special = |id: usize| {
        tokenizer["added_tokens_decoder"][id.to_string()]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(special(first_special), "[BOS]");
    assert_eq!(special(first_special + 2), "<|end_of_msg|>");
    assert_eq!(special(config.vocab_size - 1), "[PAD]");
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scratch.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        raw["text_config"]["eos_token_id"],
        first_special + 2,
        "eos is <|end_of_msg|> as in the release"
    );
    assert_eq!(raw["bos_token_id"], first_special);

    // Shard names like the release: 5-digit index, 6-digit total.
    assert!(
        scratch
            .path()
            .join(format!("model-00001-of-{:06}.safetensors", report.shards))
            .exists()
    );
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    assert_eq!(ckpt.len(), text_tensors(&config).len());
    assert_eq!(ckpt.data_bytes(), report.bytes);
    let validated = validate(&ckpt, &config).unwrap();
    let kda_layers = config.layers_of(AttentionKind::Kda).len();
    assert_eq!(
        validated.truncated_a_log,
        config
            .layers_of(AttentionKind::Kda)
            .iter()
            .map(|&l| (l, 4))
            .collect::<Vec<_>>(),
        "tiny's 3 heads are stored padded to 4 in each of its {kda_layers} KDA layers"
    );

    assert_eq!(validate_expert_scales(&ckpt, &config).unwrap(), 3 * 8 * 8);
    let per_head = a_log(&ckpt, &config, 0).unwrap();
    assert_eq!(per_head.len(), 3);
    assert!(per_head.iter().all(|&v| v != 0.0), "{per_head:?}");
    // Every expert is one contiguous range and decodes (no 0xFF scale).
    let table = ckpt
        .expert_table(&k3_model::model::expert_layout(&config))
        .unwrap();
    let moe_layers: Vec<usize> = (0..config.num_layers())
        .filter(|&i| config.layers[i].ffn == FfnKind::Moe)
        .collect();
    assert_eq!(table.len(), moe_layers.len() * config.moe.num_experts);
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    for (&(layer, expert), loc) in &table {
        assert!(loc.contiguous, "layer {layer} expert {expert}");
        let base = format!("model.layers.{layer}.block_sparse_moe.experts.{expert}");
        ckpt.mxfp4_matrix(&format!("{base}.w1"), inter, io).unwrap();
        ckpt.mxfp4_matrix(&format!("{base}.w2"), io, inter).unwrap();
        ckpt.mxfp4_matrix(&format!("{base}.w3"), inter, io).unwrap();
    }
}

#[test]
fn generation_is_deterministic_per_seed() {
    let (a, b, c) = (
        Scratch::new("synth-det-a"),
        Scratch::new("synth-det-b"),
        Scratch::new("synth-det-c"),
    );
    generate(a.path(), &tiny(3)).unwrap();
    generate(b.path(), &tiny(3)).unwrap();
    generate(c.path(), &tiny(4)).unwrap();
    let read = |dir: &Path| std::fs::read(dir.join("model-00002-of-000010.safetensors")).unwrap();
    assert_eq!(read(a.path()), read(b.path()));
    assert_ne!(read(a.path()), read(c.path()));
}

#[test]
fn validation_names_what_is_wrong() {
    let scratch = Scratch::new("synth-invalid");
    let report = generate(scratch.path(), &tiny(1)).unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    // The same files against a config with another width: a shape mismatch naming the tensor.
    let mut wider = report.config.clone();
    wider.hidden_size = 160;
    let err = validate(&ckpt, &wider).unwrap_err().to_string();
    assert!(
        err.contains("language_model.") && err.contains("expected") && err.contains("160"),
        "{err}"
    );
    // A config with more experts than written: the router's shape is wrong first.
    let mut more = report.config.clone();
    more.moe.num_experts += 1;
    let err = validate(&ckpt, &more).unwrap_err().to_string();
    assert!(
        err.contains("gate.weight") && err.contains("expected [9, 128], found [8, 128]"),
        "{err}"
    );
    // A config with one more layer: its first tensor is named as missing.
    let mut deeper = report.config.clone();
    deeper.layers.push(deeper.layers[1]);
    let err = validate(&ckpt, &deeper).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.9.") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn router_skew_orders_the_selection_bias() {
    let scratch = Scratch::new("synth-skew");
    let options = SynthOptions {
        router_skew: 1.0,
        softplus_gate: false,
        ..tiny(2)
    };
    generate(scratch.path(), &options).unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let bias = ckpt
        .f32_values(
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
            &[8],
        )
        .unwrap();
    assert!(bias.windows(2).all(|w| w[0] > w[1]), "{bias:?}");
    assert_eq!(bias[0], 0.0);
}

/// Tensors the config does not imply (the release's vision tower and projector) are ignored.
#[test]
fn extra_tensors_are_ignored() {
    use expert_store::checkpoint::Dtype;
    use expert_store::writer::{TensorOut, write_safetensors};
    let scratch = Scratch::new("synth-extras");
    let report = generate(scratch.path(), &tiny(5)).unwrap();
    let vision = "model-vision.safetensors";
    let tensors = vec![
        TensorOut {
            name: "vision_tower.patch_embed.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![4, 4],
        },
        TensorOut {
            name: "mm_projector.proj.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![2, 4],
        },
    ];
    let extra_bytes = write_safetensors(&scratch.path().join(vision), tensors, |t, buf| {
        buf.resize(t.bytes(), 0)
    })
    .unwrap();
    let index_path = scratch.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["vision_tower.patch_embed.weight"] = vision.into();
    index["weight_map"]["mm_projector.proj.weight"] = vision.into();
    index["metadata"]["total_size"] = (report.bytes + extra_bytes).into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    assert_eq!(ckpt.len(), report.tensors + 2);
    validate(&ckpt, &report.config).unwrap();
}
