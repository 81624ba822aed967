//! A checkpoint whose routed experts were packed by the independent PyPI package
//! compressed-tensors (`MXFP4PackedCompressor`) loads, validates, and its expert bytes decode
//! bit for bit to what ml_dtypes decoded. The fixture is frozen in `tests/data/ct_tiny` by
//! `cargo xtask oracle-ct-checkpoint`, which records its exact command and package versions.

use expert_store::Checkpoint;
use k3_model::checks::validate;
use k3_model::config::{FfnKind, K3Config};
use mxfp4_kernels::Kernels;

use crate::frozen::{data_dir, read_frozen};

/// Little-endian f32 bit patterns from a hex string.
fn f32_bits(hex: &str) -> Vec<u32> {
    assert!(
        hex.len().is_multiple_of(8),
        "odd f32 hex length {}",
        hex.len()
    );
    hex.as_bytes()
        .chunks_exact(8)
        .map(|word| {
            let word = std::str::from_utf8(word).unwrap();
            let byte = |i: usize| u8::from_str_radix(&word[2 * i..2 * i + 2], 16).unwrap();
            u32::from_le_bytes([byte(0), byte(1), byte(2), byte(3)])
        })
        .collect()
}

#[test]
fn compressed_tensors_checkpoint_loads_and_decodes_bit_for_bit() {
    let dir = data_dir("ct_tiny");
    read_frozen(
        "ct_tiny",
        "model.safetensors",
        "cargo xtask oracle-ct-checkpoint",
    );
    read_frozen(
        "ct_tiny",
        "expected.json",
        "cargo xtask oracle-ct-checkpoint",
    );

    let config =
        K3Config::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    validate(&ckpt, &config).unwrap();

    let moe_layers: Vec<usize> = (0..config.num_layers())
        .filter(|&i| config.layers[i].ffn == FfnKind::Moe)
        .collect();
    assert_eq!(moe_layers, [1], "the fixture has one MoE layer");
    assert_eq!(config.moe.num_experts, 4);
    let table = ckpt
        .expert_table(&k3_model::model::expert_layout(&config))
        .unwrap();
    let keys: Vec<(usize, usize)> = table.keys().copied().collect();
    assert_eq!(keys, [(1, 0), (1, 1), (1, 2), (1, 3)]);
    for (key, location) in &table {
        assert!(
            location.contiguous,
            "expert {key:?} is not stored back to back"
        );
    }

    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    assert!(
        expected["command"]
            .as_str()
            .unwrap()
            .starts_with("cargo xtask oracle-ct-checkpoint"),
        "expected.json records its command"
    );
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    let kernels = Kernels::scalar();
    let mut matrices = Vec::new();
    let mut compared = 0usize;
    for matrix in expected["matrices"].as_array().unwrap() {
        let name = matrix["name"].as_str().unwrap();
        let rows = matrix["rows"].as_u64().unwrap() as usize;
        let cols = matrix["cols"].as_u64().unwrap() as usize;
        let want = f32_bits(matrix["dequant_f32_bits"].as_str().unwrap());
        assert_eq!(want.len(), rows * cols, "{name}");
        let logical = if name.ends_with(".w2") {
            (io, inter)
        } else {
            (inter, io)
        };
        assert_eq!((rows, cols), logical, "{name}: logical shape");

        let view = ckpt.mxfp4_matrix(name, rows, cols).unwrap();
        let mut out = vec![f32::NAN; rows * cols];
        kernels.dequant_mxfp4(&view, 0..rows, &mut out).unwrap();
        for (i, (got, &want)) in out.iter().zip(&want).enumerate() {
            assert_eq!(
                got.to_bits(),
                want,
                "{name}: row {} col {}: decoded {got:e}, ml_dtypes {:e}",
                i / cols,
                i % cols,
                f32::from_bits(want)
            );
        }
        compared += out.len();
        matrices.push(name.to_owned());
    }

    // Every expert matrix, each once: 4 experts x (w1, w2, w3), 64 x 96 values each.
    matrices.sort();
    let mut wanted: Vec<String> = (0..config.moe.num_experts)
        .flat_map(|e| {
            ["w1", "w2", "w3"].map(|w| format!("model.layers.1.block_sparse_moe.experts.{e}.{w}"))
        })
        .collect();
    wanted.sort();
    assert_eq!(matrices, wanted);
    assert_eq!(compared, 4 * 3 * 64 * 96);
}
