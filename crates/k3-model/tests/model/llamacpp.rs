//! Parity with llama.cpp's Kimi-K3 (the independent CPU implementation): the `tiny` preset
//! (regenerated here from the manifest's options, so generator drift fails this test) scored
//! by our exact tier, chunked and step by step, against the frozen logits of its dense twin
//! (`cargo xtask oracle-llamacpp`, `tests/data/llamacpp_tiny/`).

use expert_store::Checkpoint;
use k3_model::checks::validate;
use k3_model::model::Model;
use k3_model::synth::{Preset, SynthOptions, generate};
use mxfp4_kernels::Kernels;

use crate::frozen::read_frozen;

/// K3's bounded decay gate (`gate_lower_bound` -5, the release's form).
#[test]
fn tiny_matches_llamacpp_dense_twin() {
    matches_llamacpp("llamacpp_tiny", false);
}

/// The Kimi-Linear softplus decay gate (`gate_lower_bound` absent, as in the 0.40B model).
#[test]
fn tiny_softplus_gate_matches_llamacpp_dense_twin() {
    matches_llamacpp("llamacpp_tiny_softplus", true);
}

fn matches_llamacpp(set: &str, softplus: bool) {
    let manifest: serde_json::Value = serde_json::from_slice(&read_frozen(
        set,
        "manifest.json",
        "cargo xtask oracle-llamacpp",
    ))
    .unwrap();
    let logits_bytes = read_frozen(set, "logits.f32", "cargo xtask oracle-llamacpp");
    let reference: Vec<f32> = logits_bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let tokens: Vec<usize> = manifest["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as usize)
        .collect();
    let checkpoint = &manifest["checkpoint"];
    assert_eq!(checkpoint["preset"], "tiny");
    let seed = checkpoint["seed"].as_u64().unwrap();

    assert_eq!(
        manifest["checkpoint"]["softplus_gate"]
            .as_bool()
            .unwrap_or(false),
        softplus
    );
    let dir = std::env::temp_dir().join(format!("k3-llamacpp-{set}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed,
        layers: None,
        experts: None,
        router_skew: 0.0,
        softplus_gate: manifest["checkpoint"]["softplus_gate"]
            .as_bool()
            .unwrap_or(false),
    };
    let report = generate(&dir, &options).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    validate(&ckpt, &report.config).unwrap();
    assert_eq!(
        matches!(report.config.kda.gate, k3_model::config::KdaGate::Softplus),
        softplus
    );
    let vocab = report.config.vocab_size;
    assert_eq!(reference.len(), tokens.len() * vocab);
    let max_logit = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));

    // The oracle, and the exact SIMD tier this CPU has (avx512, else avx2; scalar again where
    // it has neither).
    for kernels in [Kernels::scalar(), Kernels::detect()] {
        let model = Model::new(&ckpt, &report.config, kernels).unwrap();
        for chunk in [1, tokens.len()] {
            let mut session = model.session();
            let ours = model.score(&mut session, &tokens, chunk).unwrap();
            let mut worst = 0.0f32;
            for (t, row) in ours.iter().enumerate() {
                let want = &reference[t * vocab..(t + 1) * vocab];
                worst = row
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(worst, f32::max);
                let argmax =
                    |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
                assert_eq!(
                    argmax(row),
                    argmax(want),
                    "{}: argmax at position {t} (chunk {chunk})",
                    kernels.tier()
                );
            }
            eprintln!(
                "{set} {} chunk {chunk}: max |ours - llama.cpp| {worst:e} ({:e} of max |logit| {max_logit})",
                kernels.tier(),
                worst / max_logit
            );
            assert!(
                worst <= 1e-4 * max_logit,
                "{}: max |Δ| {worst} > 1e-4 x {max_logit}",
                kernels.tier()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
