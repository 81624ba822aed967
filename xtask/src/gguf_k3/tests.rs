//! The GGUF writer's checks: the `kv_b` split, the Q8_0 set on both sides (quantised, kept,
//! refused by name) and which tensors stay F32, on tiny synthetic checkpoints.

use super::write::split_kv_b;
use super::*;
use crate::gguf::tests::{Parsed, parse};
use k3_model::synth::{FloatFormat, Preset, SynthFormats, SynthOptions, generate_with};
use mxfp4_kernels::codes::quantize_q8_0;

#[test]
fn kv_b_splits_per_head_with_k_transposed() {
    // 2 heads, nope 2, v 1, lora 3: rows h0:[k0,k1,v0] h1:[k0,k1,v0], values row*10 + col.
    let kv_b: Vec<f32> = (0..6)
        .flat_map(|r| (0..3).map(move |c| (r * 10 + c) as f32))
        .collect();
    let k = split_kv_b(&kv_b, 2, 2, 1, 3, true);
    assert_eq!(k, [0., 10., 1., 11., 2., 12., 30., 40., 31., 41., 32., 42.]);
    let v = split_kv_b(&kv_b, 2, 2, 1, 3, false);
    assert_eq!(v, [20., 21., 22., 50., 51., 52.]);
}

/// A tiny synthetic checkpoint with its trunk in `trunk`, converted to each outtype.
fn tiny_ggufs(trunk: FloatFormat, outtypes: &[Outtype], tag: &str) -> Vec<Result<Vec<u8>>> {
    let dir = std::env::temp_dir().join(format!("k3-gguf-q8-{tag}-{}", std::process::id()));
    let model = dir.join("tiny");
    let formats = SynthFormats {
        trunk,
        ..SynthFormats::default()
    };
    generate_with(&model, &SynthOptions::new(Preset::Tiny), &formats).unwrap();
    let files = outtypes
        .iter()
        .map(|&outtype| {
            let out = dir.join("t.gguf");
            convert(&model, &out, outtype)?;
            Ok(std::fs::read(&out)?)
        })
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    files
}

#[test]
fn a_q8_0_trunk_quantises_the_set_and_keeps_the_rest() {
    for trunk in [FloatFormat::Bf16, FloatFormat::F32] {
        let outtypes = [Outtype::Q8_0, Outtype::Bf16, Outtype::F32];
        let files: Vec<Vec<u8>> = tiny_ggufs(trunk, &outtypes, &format!("{trunk:?}"))
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let [q8, bf16, f32] = [&files[0], &files[1], &files[2]].map(|b| (b, parse(b)));
        let file_type = |p: &Parsed| {
            p.kv.iter()
                .find(|(k, _, _)| k == "general.file_type")
                .map(|(_, _, v)| v.clone())
        };
        // MOSTLY_Q8_0, with MXFP4 routed experts too (see `gguf_k3_meta::metadata`).
        assert_eq!(file_type(&q8.1), Some(7u32.to_le_bytes().to_vec()));
        let bytes = |(file, p): &(&Vec<u8>, Parsed), i: usize, len: u64| {
            let at = p.data_start + p.tensors[i].3 as usize;
            file[at..at + len as usize].to_vec()
        };
        let mut seen = Vec::new();
        assert_eq!(q8.1.tensors.len(), bf16.1.tensors.len());
        for (i, (name, ne, ty, _)) in q8.1.tensors.iter().enumerate() {
            let (bf16_name, bf16_ne, bf16_ty, _) = &bf16.1.tensors[i];
            assert_eq!((name, ne), (bf16_name, bf16_ne));
            if !in_q8_0_set(name) {
                // Kept: the same type and bytes as the BF16 outtype writes.
                assert_eq!(ty, bf16_ty, "{name}");
                let len = [GgmlType::F32, GgmlType::Bf16, GgmlType::Mxfp4]
                    .into_iter()
                    .find(|t| t.id() == *ty)
                    .unwrap()
                    .nbytes(ne)
                    .unwrap();
                assert_eq!(bytes(&q8, i, len), bytes(&bf16, i, len), "{name}");
                continue;
            }
            assert_eq!(*ty, 8, "{name}");
            assert_eq!(ne.len(), 2, "{name}");
            seen.push(name.split_once('.').unwrap().1.split_once('.').unwrap().1);
            // The blocks are `quantize_q8_0` of the checkpoint's values, row by row: the
            // F32 outtype holds those values exactly.
            let count = ne.iter().product::<u64>();
            assert_eq!(f32.1.tensors[i].2, 0, "{name}");
            let values: Vec<f32> = bytes(&f32, i, count * 4)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let expected: Vec<u8> = values
                .chunks_exact(32)
                .flat_map(|b| quantize_q8_0(b.try_into().unwrap()))
                .collect();
            assert_eq!(expected.len() as u64, count / 32 * 34);
            assert_eq!(bytes(&q8, i, count / 32 * 34), expected, "{name}");
        }
        seen.sort();
        seen.dedup();
        let mut all = Q8_0_SET.to_vec();
        all.sort();
        assert_eq!(seen, all, "the tiny model has every tensor of the set");
    }
}

#[test]
fn a_q8_0_tensor_from_an_f16_matrix_is_refused_by_name() {
    let e = tiny_ggufs(FloatFormat::F16, &[Outtype::Q8_0], "f16")
        .remove(0)
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("blk.") && e.contains("F16") && e.contains("Q8_0"),
        "{e}"
    );
}

#[test]
fn the_q8_0_set_is_named_on_both_sides() {
    for (hf, yes) in [
        ("model.layers.0.self_attn.q_proj.weight", true),
        ("model.layers.3.self_attn.g_proj.weight", true),
        ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", true),
        (
            "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
            true,
        ),
        (
            "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
            true,
        ),
        ("model.layers.3.self_attn.kv_b_proj.weight", false),
        ("model.layers.0.self_attn.f_a_proj.weight", false),
        ("model.layers.0.self_attn.b_proj.weight", false),
        ("model.layers.1.block_sparse_moe.gate.weight", false),
        ("model.embed_tokens.weight", false),
        ("lm_head.weight", false),
    ] {
        assert_eq!(q8_0_source(hf), yes, "{hf}");
    }
    let q = Outtype::Q8_0;
    assert_eq!(tensor_type("blk.0.attn_q.weight", 2, q), GgmlType::Q8_0);
    assert_eq!(tensor_type("blk.3.attn_gate.weight", 2, q), GgmlType::Q8_0);
    for kept in [
        "token_embd.weight",
        "output.weight",
        "blk.3.attn_k_b.weight",
        "blk.3.attn_v_b.weight",
        "blk.0.ssm_f_a.weight",
        "blk.0.ssm_beta.weight",
        "blk.1.ffn_gate_exps.weight",
    ] {
        assert_eq!(tensor_type(kept, 2, q), GgmlType::Bf16, "{kept}");
    }
    assert_eq!(
        tensor_type("blk.1.ffn_gate_inp.weight", 2, q),
        GgmlType::F32
    );
}

#[test]
fn vectors_norms_router_and_convolutions_stay_f32() {
    let b = Outtype::Bf16;
    assert_eq!(tensor_type("blk.0.attn_q.weight", 2, b), GgmlType::Bf16);
    assert_eq!(tensor_type("blk.0.attn_k_b.weight", 3, b), GgmlType::Bf16);
    assert_eq!(
        tensor_type("blk.0.attn_q.weight", 2, Outtype::F32),
        GgmlType::F32
    );
    for f32_name in [
        "blk.1.ffn_gate_inp.weight",
        "blk.0.ssm_conv1d_k.weight",
        "blk.2.attn_kv_a_norm.weight",
        "blk.0.ssm_a",
        "blk.1.exp_probs_b.bias",
    ] {
        assert_eq!(tensor_type(f32_name, 4, b), GgmlType::F32, "{f32_name}");
    }
    assert_eq!(tensor_type("output_res_score.weight", 1, b), GgmlType::F32);
}
