//! A small two-shard checkpoint written by `writer`, read back, then corrupted in every way
//! the loader must catch.

use std::collections::BTreeMap;
use std::path::Path;

use expert_store::checkpoint::{Checkpoint, CheckpointError, Dtype};
use expert_store::layout::{ExpertLayout, MatrixLayout};
use expert_store::writer::{TensorOut, write_safetensors};
use k3_testkit::Scratch;
use proptest::prelude::{ProptestConfig, any, proptest};

pub(crate) const EXPERTS: usize = 12;

/// The layout `write_checkpoint` writes its experts in (K3's names, as test data): gate `w1`,
/// up `w3`, down `w2`, each `[64, 64]` MXFP4.
pub(crate) fn layout() -> ExpertLayout {
    let base = "model.layers.{layer}.block_sparse_moe.experts.{expert}";
    let matrix = |what, w: &str| {
        MatrixLayout::new(
            what,
            &format!("{base}.{w}.weight_packed"),
            &format!("{base}.{w}.weight_scale"),
            64,
            64,
        )
        .unwrap()
    };
    ExpertLayout::new(vec![
        matrix("expert w1 (gate)", "w1"),
        matrix("expert w3 (up)", "w3"),
        matrix("expert w2 (down)", "w2"),
    ])
    .unwrap()
}

fn tensor(name: &str, dtype: Dtype, shape: &[usize]) -> TensorOut {
    TensorOut {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

/// Deterministic bytes for a tensor: scale tensors get bytes 118..125 (never 0xFF).
fn fill(t: &TensorOut, buf: &mut Vec<u8>) {
    let seed = t
        .name
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    for i in 0..t.bytes() {
        let v = seed.wrapping_add(i as u32).wrapping_mul(2_654_435_761) >> 24;
        buf.push(if t.name.ends_with("weight_scale") {
            118 + (v % 7) as u8
        } else {
            v as u8
        });
    }
}

/// Shard 1: a BF16 matrix, an F32 vector; shard 2: 12 experts of layer 1 (3x [64, 64] MXFP4),
/// written in lexicographic order (0, 1, 10, 11, 2, ...), like the release.
pub(crate) fn write_checkpoint(dir: &Path, prefix: &str) -> BTreeMap<String, String> {
    let p = |n: &str| format!("{prefix}{n}");
    let shard1 = vec![
        tensor(&p("model.norm.weight"), Dtype::BF16, &[64]),
        tensor(&p("lm_head.weight"), Dtype::BF16, &[32, 64]),
        tensor(&p("model.layers.0.self_attn.A_log"), Dtype::F32, &[8]),
    ];
    let mut shard2 = Vec::new();
    for e in 0..EXPERTS {
        for w in ["w1", "w2", "w3"] {
            let base = p(&format!("model.layers.1.block_sparse_moe.experts.{e}.{w}"));
            shard2.push(tensor(
                &format!("{base}.weight_packed"),
                Dtype::U8,
                &[64, 32],
            ));
            shard2.push(tensor(&format!("{base}.weight_scale"), Dtype::U8, &[64, 2]));
        }
    }
    let mut map = BTreeMap::new();
    let mut total = 0;
    for (file, tensors) in [
        ("model-00001-of-000002.safetensors", shard1),
        ("model-00002-of-000002.safetensors", shard2),
    ] {
        for t in &tensors {
            map.insert(t.name.clone(), file.to_owned());
        }
        total += write_safetensors(&dir.join(file), tensors, fill).unwrap();
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    map
}

#[test]
fn reads_shards_views_and_expert_table() {
    for prefix in ["language_model.", ""] {
        let scratch = Scratch::new("store-read");
        write_checkpoint(scratch.path(), prefix);
        let ckpt = Checkpoint::open(scratch.path()).unwrap();
        assert_eq!(ckpt.len(), 3 + EXPERTS * 6);
        let norm = ckpt.require("model.norm.weight").unwrap();
        assert_eq!((norm.dtype, norm.shape), (Dtype::BF16, &[64usize][..]));
        assert_eq!(norm.name, format!("{prefix}model.norm.weight"));
        let head = ckpt.bf16_matrix("lm_head.weight", 32, 64).unwrap();
        assert_eq!(head.rows(), 32);
        assert_eq!(
            ckpt.f32_values("model.layers.0.self_attn.A_log", &[8])
                .unwrap()
                .len(),
            8
        );
        let w2 = ckpt
            .mxfp4_matrix("model.layers.1.block_sparse_moe.experts.10.w2", 64, 64)
            .unwrap();
        assert_eq!(w2.groups(), 2);
        // Shape and dtype mismatches name the tensor.
        let err = ckpt
            .bf16_matrix("lm_head.weight", 64, 32)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lm_head.weight") && err.contains("[64, 32]") && err.contains("[32, 64]"),
            "{err}"
        );
        let err = ckpt
            .bf16_matrix("model.layers.0.self_attn.A_log", 1, 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("F32"), "{err}");
        assert!(matches!(
            ckpt.require("model.embed_tokens.weight"),
            Err(CheckpointError::Missing { .. })
        ));

        let table = ckpt.expert_table(&layout()).unwrap();
        assert_eq!(table.len(), EXPERTS);
        let expert_bytes = 3 * (64 * 32 + 64 * 2);
        let mut offsets: Vec<(usize, usize)> = Vec::new();
        for e in 0..EXPERTS {
            let loc = &table[&(1, e)];
            assert!(
                loc.contiguous && loc.len == expert_bytes,
                "expert {e}: {loc:?}"
            );
            assert!(loc.path.ends_with("model-00002-of-000002.safetensors"));
            offsets.push((loc.offset, e));
        }
        offsets.sort_unstable();
        let order: Vec<usize> = offsets.iter().map(|&(_, e)| e).collect();
        assert_eq!(
            order,
            [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9],
            "stored in name order, not id order"
        );
        // The location's bytes are exactly the expert's six tensors.
        let loc = &table[&(1, 10)];
        let packed = ckpt
            .require("model.layers.1.block_sparse_moe.experts.10.w1.weight_packed")
            .unwrap();
        assert_eq!(packed.offset, loc.offset, "w1.weight_packed sorts first");
    }
}

/// An expert with some but not all of the layout's tensors is an error naming what is
/// missing; a layout naming other tensors finds nothing.
#[test]
fn an_expert_missing_a_layout_tensor_is_an_error_naming_it() {
    let scratch = Scratch::new("store-missing");
    write_checkpoint(scratch.path(), "language_model.");
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let mut matrices = layout().matrices().to_vec();
    let base = "model.layers.{layer}.block_sparse_moe.experts.{expert}";
    matrices.push(
        MatrixLayout::new(
            "w4",
            &format!("{base}.w4.weight_packed"),
            &format!("{base}.w4.weight_scale"),
            64,
            64,
        )
        .unwrap(),
    );
    let err = ckpt
        .expert_table(&ExpertLayout::new(matrices).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("8 expert tensors")
            && err.contains("found 6 tensors")
            && err.contains("model.layers.1.block_sparse_moe.experts.0.w4.weight_packed")
            && err.contains("model.layers.1.block_sparse_moe.experts.0.w4.weight_scale"),
        "{err}"
    );
    let other = ExpertLayout::new(vec![
        MatrixLayout::new(
            "up",
            "blk.{layer}.up.{expert}.q",
            "blk.{layer}.up.{expert}.s",
            64,
            64,
        )
        .unwrap(),
    ])
    .unwrap();
    assert!(ckpt.expert_table(&other).unwrap().is_empty());
}

#[test]
fn resident_copies_hand_out_the_same_bytes_from_owned_memory() {
    let scratch = Scratch::new("store-resident");
    write_checkpoint(scratch.path(), "language_model.");
    let mut ckpt = Checkpoint::open(scratch.path()).unwrap();
    let names: Vec<String> = [
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.A_log",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(
        (0..EXPERTS)
            .map(|e| format!("model.layers.1.block_sparse_moe.experts.{e}.w2.weight_packed")),
    )
    .collect();
    let before: Vec<(Vec<u8>, usize, usize)> = names
        .iter()
        .map(|n| {
            let t = ckpt.require(n).unwrap();
            (t.bytes.to_vec(), t.offset, t.bytes.as_ptr() as usize)
        })
        .collect();
    let copied = ckpt
        .make_resident(|stored| !stored.contains(".experts."))
        .unwrap();
    // In file order: lm_head (4096 B), A_log (32 B), then norm (128 B) from the next 64-byte
    // boundary (4160).
    assert_eq!(copied, 4160 + 128);
    for (name, (bytes, offset, old_ptr)) in names.iter().zip(&before) {
        let t = ckpt.require(name).unwrap();
        assert_eq!((t.bytes, t.offset), (&bytes[..], *offset), "{name}");
        let moved = t.bytes.as_ptr() as usize != *old_ptr;
        assert_eq!(moved, !name.contains(".experts."), "{name}");
        if moved {
            assert_eq!(t.bytes.as_ptr() as usize % 64, 0, "{name}");
        }
    }
    // Views read the copies; a second call replaces the first.
    assert_eq!(
        ckpt.bf16_matrix("lm_head.weight", 32, 64).unwrap().rows(),
        32
    );
    assert_eq!(
        ckpt.make_resident(|stored| stored.ends_with("norm.weight"))
            .unwrap(),
        128
    );
    let lm_head = ckpt.require("lm_head.weight").unwrap();
    assert_eq!(
        lm_head.bytes.as_ptr() as usize,
        before[1].2,
        "back on the mapping"
    );
}

#[test]
fn single_file_checkpoint() {
    let scratch = Scratch::new("store-single");
    write_safetensors(
        &scratch.path().join("model.safetensors"),
        vec![tensor("model.norm.weight", Dtype::BF16, &[4])],
        fill,
    )
    .unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    assert_eq!(ckpt.require("model.norm.weight").unwrap().bytes.len(), 8);
}

#[test]
fn float_values_follow_the_header_dtype() {
    let scratch = Scratch::new("store-dtypes");
    // F16: 1, -2, 0.5, the smallest subnormal 2^-24, -0, +inf, 65504; BF16: 1, -3.5; F32: 0.1.
    let f16: [u16; 7] = [0x3C00, 0xC000, 0x3800, 0x0001, 0x8000, 0x7C00, 0x7BFF];
    let bf16: [u16; 2] = [0x3F80, 0xC060];
    let tensors = vec![
        tensor("a.f16", Dtype::F16, &[7]),
        tensor("b.bf16", Dtype::BF16, &[2]),
        tensor("c.f32", Dtype::F32, &[1]),
        tensor("d.u8", Dtype::U8, &[2]),
    ];
    write_safetensors(
        &scratch.path().join("model.safetensors"),
        tensors,
        |t, buf| match t.name.as_str() {
            "a.f16" => buf.extend(f16.iter().flat_map(|h| h.to_le_bytes())),
            "b.bf16" => buf.extend(bf16.iter().flat_map(|h| h.to_le_bytes())),
            "c.f32" => buf.extend(0.1f32.to_le_bytes()),
            _ => buf.extend([1, 2]),
        },
    )
    .unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let got = ckpt.f32_values("a.f16", &[7]).unwrap();
    let want = [1.0, -2.0, 0.5, 2f32.powi(-24), -0.0, f32::INFINITY, 65504.0];
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v: &f32| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(ckpt.f32_values("b.bf16", &[2]).unwrap(), [1.0, -3.5]);
    assert_eq!(ckpt.f32_values("c.f32", &[1]).unwrap(), [0.1]);
    assert!(
        ckpt.f32_values("d.u8", &[2])
            .unwrap_err()
            .to_string()
            .contains("expected F32")
    );
    assert!(ckpt.f32_values("a.f16", &[8]).is_err());
}

#[test]
fn nan_scale_is_rejected_with_its_place() {
    let scratch = Scratch::new("store-nan");
    write_checkpoint(scratch.path(), "language_model.");
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let scale = ckpt
        .require("model.layers.1.block_sparse_moe.experts.3.w3.weight_scale")
        .unwrap();
    let (path, at) = (scale.path.to_owned(), scale.offset + 5);
    drop(ckpt);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] = 0xFF;
    std::fs::write(&path, bytes).unwrap();
    let ckpt = Checkpoint::open(scratch.path()).unwrap();
    let err = ckpt
        .mxfp4_matrix("model.layers.1.block_sparse_moe.experts.3.w3", 64, 64)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("experts.3.w3.weight_scale")
            && err.contains("0xff")
            && err.contains("row 2, group 1"),
        "{err}"
    );
}

/// Each named corruption gives an error (never a panic) that says what is wrong.
#[test]
fn corruptions_are_clean_errors() {
    type Corrupt = fn(&Path);
    let cases: Vec<(&str, Corrupt, &str)> = vec![
        (
            "truncated shard",
            |d| {
                let p = d.join("model-00002-of-000002.safetensors");
                let bytes = std::fs::read(&p).unwrap();
                std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
            },
            "model-00002-of-000002.safetensors",
        ),
        (
            "extra trailing bytes",
            |d| {
                let p = d.join("model-00001-of-000002.safetensors");
                let mut bytes = std::fs::read(&p).unwrap();
                bytes.push(0);
                std::fs::write(&p, bytes).unwrap();
            },
            "model-00001-of-000002.safetensors",
        ),
        (
            "header length past the end",
            |d| {
                let p = d.join("model-00001-of-000002.safetensors");
                let mut bytes = std::fs::read(&p).unwrap();
                bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
                std::fs::write(&p, bytes).unwrap();
            },
            "header",
        ),
        (
            "overlapping ranges",
            |d| {
                let p = d.join("model-00001-of-000002.safetensors");
                let text = String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned();
                // lm_head's range [0, 4096] is moved to start 2 bytes later (same length).
                let edited =
                    text.replacen("\"data_offsets\":[0,4096]", "\"data_offsets\":[2,4098]", 1);
                assert_ne!(text, edited, "fixture layout changed");
                std::fs::write(&p, edited.as_bytes()).unwrap();
            },
            "offset",
        ),
        (
            "missing shard",
            |d| std::fs::remove_file(d.join("model-00002-of-000002.safetensors")).unwrap(),
            "model-00002",
        ),
        (
            "index names a tensor its shard lacks",
            |d| {
                let p = d.join("model.safetensors.index.json");
                let mut index: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                index["weight_map"]["language_model.model.ghost.weight"] =
                    "model-00001-of-000002.safetensors".into();
                std::fs::write(&p, index.to_string()).unwrap();
            },
            "model.ghost.weight",
        ),
        (
            "index total_size wrong",
            |d| {
                let p = d.join("model.safetensors.index.json");
                let mut index: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                index["metadata"]["total_size"] = 12.into();
                std::fs::write(&p, index.to_string()).unwrap();
            },
            "total_size is 12",
        ),
        (
            "index path escapes the directory",
            |d| {
                let p = d.join("model.safetensors.index.json");
                let mut index: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                index["weight_map"]["language_model.model.norm.weight"] =
                    "../model-00001-of-000002.safetensors".into();
                std::fs::write(&p, index.to_string()).unwrap();
            },
            "not a plain file name",
        ),
        (
            "index not JSON",
            |d| std::fs::write(d.join("model.safetensors.index.json"), "{").unwrap(),
            "not JSON",
        ),
        (
            "no weights at all",
            |d| {
                std::fs::remove_file(d.join("model.safetensors.index.json")).unwrap();
            },
            "no model.safetensors",
        ),
    ];
    for (what, corrupt, needle) in cases {
        let scratch = Scratch::new("store-corrupt");
        write_checkpoint(scratch.path(), "language_model.");
        corrupt(scratch.path());
        let err = Checkpoint::open(scratch.path())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(needle),
            "{what}: expected {needle:?} in {err:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random byte edits anywhere in a shard's first 600 bytes (length prefix, header JSON,
    /// start of data) and random truncations never panic: the checkpoint opens (a benign edit)
    /// or fails with an error, and whatever opens can be read.
    #[test]
    fn random_damage_never_panics(edits in proptest::collection::vec((0usize..600, any::<u8>()), 1..6),
                                   cut in proptest::option::of(0usize..8000)) {
        let scratch = Scratch::new("store-fuzz");
        write_checkpoint(scratch.path(), "language_model.");
        let p = scratch.path().join("model-00001-of-000002.safetensors");
        let mut bytes = std::fs::read(&p).unwrap();
        for (at, value) in edits {
            if at < bytes.len() {
                bytes[at] = value;
            }
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.min(bytes.len()));
        }
        std::fs::write(&p, bytes).unwrap();
        if let Ok(ckpt) = Checkpoint::open(scratch.path()) {
            let _ = ckpt.bf16_matrix("lm_head.weight", 32, 64);
            let _ = ckpt.f32_values("model.layers.0.self_attn.A_log", &[8]);
            let _ = ckpt.expert_table(&layout());
        }
    }
}

/// A text-only download leaves out the shards holding only vision tensors: the checkpoint
/// opens without them (and says which), while an absent shard holding any text tensor is
/// still an error naming it.
#[test]
fn absent_vision_only_shards_are_skipped_and_absent_text_shards_are_errors() {
    let scratch = Scratch::new("store-vision");
    let dir = scratch.path();
    let mut map = write_checkpoint(dir, "language_model.");
    let vision = "model-00003-of-000003.safetensors";
    for name in [
        "vision_tower.blocks.0.attn.qkv.weight",
        "mm_projector.proj.weight",
    ] {
        map.insert(name.to_owned(), vision.to_owned());
    }
    // No total_size: the absent shard's bytes could not be checked anyway.
    let index = serde_json::json!({ "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    assert_eq!(ckpt.skipped_shards(), [vision]);
    assert!(ckpt.tensor("model.norm.weight").is_some());

    // The same absent file, now also said to hold a text tensor: refused, naming the file.
    map.insert(
        "language_model.model.layers.2.mlp.gate.weight".into(),
        vision.into(),
    );
    let index = serde_json::json!({ "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    match Checkpoint::open(dir) {
        Err(CheckpointError::Io { path, source }) => {
            assert!(path.ends_with(vision), "{}", path.display());
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an error naming {vision}, got {other:?}"),
    }
}

/// A FIFO or a link to `/dev/zero` in place of the index or of a shard: refused at once,
/// naming the file and what it is, neither opened in a way that waits nor read nor mapped.
#[test]
fn a_fifo_or_a_device_in_place_of_the_index_or_a_shard_is_refused_at_once() {
    let shard = "model-00002-of-000002.safetensors";
    for (file, special) in [
        ("model.safetensors.index.json", "fifo"),
        ("model.safetensors.index.json", "/dev/zero"),
        (shard, "fifo"),
        (shard, "/dev/zero"),
    ] {
        let scratch = Scratch::new("store-specials");
        let dir = scratch.path().to_owned();
        write_checkpoint(&dir, "");
        let path = dir.join(file);
        let kind = k3_testkit::replace_with_special(&path, special);
        let case = format!("{file} as {special}");
        let opened = k3_testkit::promptly(&case, std::time::Duration::from_secs(5), move || {
            Checkpoint::open(&dir).map(|_| ())
        });
        let e = opened.expect_err(&case);
        assert!(matches!(e, CheckpointError::File(_)), "{case}: {e:?}");
        assert_eq!(
            e.to_string(),
            format!("{} is {kind}, not a regular file", path.display()),
            "{case}"
        );
    }
}
