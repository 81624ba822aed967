//! A K3 checkpoint to llama.cpp's `kimi-k3` GGUF, without Python or torch: the same file the
//! vendored `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36, `conversion/kimi_k3.py` and
//! `conversion/base.py`) writes through `xtask/oracle/llamacpp_convert.py`.
//!
//! Mirrored from the converter, step by step (docs/ORACLE_LLAMACPP.md, "Torch-free
//! conversion"): the tensor names its `TensorNameMap` gives K3's names; `kv_b_proj` split per
//! head into `attn_k_b` (transposed) and `attn_v_b`; `-exp(A_log[:num_attention_heads])`; the
//! AttnRes `_norm * _proj` products; the KDA short convolutions as `{d_conv, 1, d_inner, 1}`;
//! `g_proj` as `ssm_g` (KDA) or `attn_gate` (MLA); compressed-tensors MXFP4 experts repacked
//! losslessly to ggml `block_mxfp4` (dense experts stacked instead); which tensors stay F32
//! (vectors, norms, the router, the convolutions, non-`.weight` tensors); the metadata keys of
//! `set_gguf_parameters`; and the byte-level vocabulary of `llamacpp_convert.py`.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use expert_store::{Checkpoint, Dtype, TensorRef};
use k3_model::config::{AttentionKind, FfnKind, K3Config};
use k3_model::inventory::{TensorClass, text_tensors};
use serde_json::Value as Json;

use crate::gguf::{GgmlType, TensorInfo, Value, Writer, bf16_from_f32};
use crate::gguf_k3_meta::{Outtype, merged_hparams, metadata};

/// Where a GGUF tensor's values come from.
#[derive(Debug, Clone)]
enum Source {
    /// A checkpoint tensor, element by element (only the type may change).
    Plain(String),
    /// `-exp(A_log[..n])`.
    NegExp { name: String, n: usize },
    /// The elementwise product of an AttnRes norm and its `[1, d]` projection.
    Product(String, String),
    /// `kv_b_proj` split per head: the first `nope` rows of each head, transposed (`k`), or
    /// the `v` rows after them.
    KvB {
        name: String,
        heads: usize,
        nope: usize,
        v: usize,
        k: bool,
    },
    /// A MoE layer's routed experts, one projection (`w1`, `w2`, `w3`) stacked over experts.
    Experts {
        layer: usize,
        w: &'static str,
        experts: usize,
        mxfp4: bool,
    },
}

/// One planned tensor.
#[derive(Debug, Clone)]
struct Planned {
    info: TensorInfo,
    source: Source,
}

/// What a conversion wrote.
#[derive(Debug)]
pub(crate) struct Converted {
    pub(crate) tensors: usize,
    pub(crate) bytes: u64,
    pub(crate) mxfp4_experts: bool,
}

/// HF leaf name under `model.layers.{l}.` to the GGUF leaf under `blk.{l}.`, as the
/// converter's `TensorNameMap` for `kimi-k3` maps them (checked against gguf-py, see the docs).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_conv1d.weight", "ssm_conv1d_q.weight"),
    ("self_attn.k_conv1d.weight", "ssm_conv1d_k.weight"),
    ("self_attn.v_conv1d.weight", "ssm_conv1d_v.weight"),
    ("self_attn.f_a_proj.weight", "ssm_f_a.weight"),
    ("self_attn.f_b_proj.weight", "ssm_f_b.weight"),
    ("self_attn.b_proj.weight", "ssm_beta.weight"),
    ("self_attn.dt_bias", "ssm_dt.bias"),
    ("self_attn.o_norm.weight", "ssm_norm.weight"),
    ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    (
        "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_mqa.weight",
    ),
    ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    (
        "block_sparse_moe.gate.e_score_correction_bias",
        "exp_probs_b.bias",
    ),
    (
        "block_sparse_moe.routed_expert_down_proj.weight",
        "ffn_routed_down.weight",
    ),
    (
        "block_sparse_moe.routed_expert_up_proj.weight",
        "ffn_routed_up.weight",
    ),
    (
        "block_sparse_moe.routed_expert_norm.weight",
        "ffn_routed_norm.weight",
    ),
    (
        "block_sparse_moe.shared_experts.gate_proj.weight",
        "ffn_gate_shexp.weight",
    ),
    (
        "block_sparse_moe.shared_experts.up_proj.weight",
        "ffn_up_shexp.weight",
    ),
    (
        "block_sparse_moe.shared_experts.down_proj.weight",
        "ffn_down_shexp.weight",
    ),
];

/// The converter's `prepare_tensors` type choice: F32 for vectors, `_norm.weight`, the router,
/// the KDA convolutions and anything not named `.weight`; else the outtype.
fn tensor_type(name: &str, dims: usize, outtype: Outtype) -> GgmlType {
    let forced = dims <= 1
        || name.ends_with("_norm.weight")
        || !name.ends_with(".weight")
        || name.ends_with(".ffn_gate_inp.weight")
        || [
            ".ssm_conv1d_q.weight",
            ".ssm_conv1d_k.weight",
            ".ssm_conv1d_v.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s));
    match (forced, outtype) {
        (true, _) | (false, Outtype::F32) => GgmlType::F32,
        (false, Outtype::Bf16) => GgmlType::Bf16,
    }
}

fn planned(name: String, shape: &[usize], outtype: Outtype, source: Source) -> Planned {
    let ty = tensor_type(&name, shape.len(), outtype);
    Planned {
        info: TensorInfo {
            name,
            ne: shape.iter().rev().map(|&n| n as u64).collect(),
            ty,
        },
        source,
    }
}

/// Every GGUF tensor of `ckpt` for `config` (`hp`: the merged hyperparameters), in the order
/// the converter writes them: the MXFP4 experts first, then the rest.
fn plan(
    ckpt: &Checkpoint,
    config: &K3Config,
    hp: &Json,
    outtype: Outtype,
) -> Result<(Vec<Planned>, bool)> {
    let get = |key: &str| -> Result<usize> {
        hp[key]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("config has no integer {key}"))
    };
    let (n_head, n_head_kv) = (get("num_attention_heads")?, get("num_key_value_heads")?);
    let mut out = Vec::new();
    let mut any_mxfp4 = false;
    let mut experts = Vec::new();
    for (layer, spec) in config.layers.iter().enumerate() {
        if spec.ffn != FfnKind::Moe {
            continue;
        }
        let n = config.moe.num_experts;
        // w1: gate, w2: down, w3: up; the converter writes them sorted by (layer, w).
        for (w, gguf) in [
            ("w1", "ffn_gate_exps"),
            ("w2", "ffn_down_exps"),
            ("w3", "ffn_up_exps"),
        ] {
            let base = format!("model.layers.{layer}.block_sparse_moe.experts.0.{w}");
            let (mxfp4, rows, cols) = match ckpt.tensor(&format!("{base}.weight_packed")) {
                Some(t) => (true, t.shape[0], t.shape[1] * 2),
                None => {
                    let t = ckpt.require(&format!("{base}.weight"))?;
                    ensure!(t.shape.len() == 2, "{}: not a matrix", t.name);
                    (false, t.shape[0], t.shape[1])
                }
            };
            any_mxfp4 |= mxfp4;
            let name = format!("blk.{layer}.{gguf}.weight");
            let source = Source::Experts {
                layer,
                w,
                experts: n,
                mxfp4,
            };
            let mut p = planned(name, &[n, rows, cols], outtype, source);
            if mxfp4 {
                p.info.ty = GgmlType::Mxfp4;
            }
            experts.push(p);
        }
    }
    if any_mxfp4 {
        out.append(&mut experts);
    }
    for spec in text_tensors(config) {
        if spec.class == TensorClass::RoutedExperts {
            continue;
        }
        let Some(t) = ckpt.tensor(&spec.name) else {
            bail!("the checkpoint has no {} (its config lists it)", spec.name);
        };
        let shape = t.shape.to_vec();
        let name = spec.name.clone();
        let Some(layer) = spec.layer else {
            let (gguf, source) = match name.as_str() {
                "model.embed_tokens.weight" => ("token_embd.weight", Source::Plain(name.clone())),
                "lm_head.weight" => ("output.weight", Source::Plain(name.clone())),
                "model.norm.weight" => ("output_norm.weight", Source::Plain(name.clone())),
                "model.output_attn_res_norm.weight" => (
                    "output_res_score.weight",
                    Source::Product(name.clone(), "model.output_attn_res_proj.weight".into()),
                ),
                "model.output_attn_res_proj.weight" => continue,
                other => bail!("no GGUF name for {other}"),
            };
            let dims = if matches!(source, Source::Product(..)) {
                vec![shape[0]]
            } else {
                shape
            };
            out.push(planned(gguf.into(), &dims, outtype, source));
            continue;
        };
        let leaf = name
            .strip_prefix(&format!("model.layers.{layer}."))
            .with_context(|| format!("{name} is not under layer {layer}"))?;
        let blk = |g: &str| format!("blk.{layer}.{g}");
        let kind = config.layers[layer].attention;
        match leaf {
            "self_attention_res_norm.weight" | "mlp_res_norm.weight" => {
                let (part, g) = match leaf.starts_with("self") {
                    true => ("self_attention_res", "attn_res_score.weight"),
                    false => ("mlp_res", "ffn_res_score.weight"),
                };
                let proj = format!("model.layers.{layer}.{part}_proj.weight");
                out.push(planned(
                    blk(g),
                    &[shape[0]],
                    outtype,
                    Source::Product(name.clone(), proj),
                ));
            }
            "self_attention_res_proj.weight" | "mlp_res_proj.weight" => {}
            "self_attn.A_log" => {
                ensure!(
                    shape.iter().product::<usize>() >= n_head,
                    "{name} has fewer than {n_head} values"
                );
                out.push(planned(
                    blk("ssm_a"),
                    &[n_head],
                    outtype,
                    Source::NegExp { name, n: n_head },
                ));
            }
            "self_attn.g_proj.weight" => {
                let g = if kind == AttentionKind::Kda {
                    "ssm_g.weight"
                } else {
                    "attn_gate.weight"
                };
                out.push(planned(blk(g), &shape, outtype, Source::Plain(name)));
            }
            "self_attn.kv_b_proj.weight" => {
                let (nope, v) = (config.mla.qk_nope_head_dim, config.mla.v_head_dim);
                ensure!(
                    shape[0] == n_head_kv * (nope + v),
                    "{name} has {} rows, num_key_value_heads {n_head_kv} x {} expected",
                    shape[0],
                    nope + v
                );
                let lora = shape[1];
                for (k, g, dims) in [
                    (true, "attn_k_b.weight", [n_head_kv, lora, nope]),
                    (false, "attn_v_b.weight", [n_head_kv, v, lora]),
                ] {
                    let source = Source::KvB {
                        name: name.clone(),
                        heads: n_head_kv,
                        nope,
                        v,
                        k,
                    };
                    out.push(planned(blk(g), &dims, outtype, source));
                }
            }
            _ if leaf.ends_with("_conv1d.weight") => {
                let (d_inner, d_conv) = (shape[0], shape[shape.len() - 1]);
                let g = LAYER_NAMES
                    .iter()
                    .find(|(h, _)| *h == leaf)
                    .map(|(_, g)| *g)
                    .context("conv")?;
                out.push(planned(
                    blk(g),
                    &[1, d_inner, 1, d_conv],
                    outtype,
                    Source::Plain(name),
                ));
            }
            _ => {
                let Some((_, g)) = LAYER_NAMES.iter().find(|(h, _)| *h == leaf) else {
                    bail!("no GGUF name for {name}");
                };
                out.push(planned(blk(g), &shape, outtype, Source::Plain(name)));
            }
        }
    }
    if !any_mxfp4 {
        out.append(&mut experts);
    }
    Ok((out, any_mxfp4))
}

/// A tensor's values widened to f32 (BF16 and F32 checkpoints only).
fn widen(t: &TensorRef<'_>) -> Result<Vec<f32>> {
    Ok(match t.dtype {
        Dtype::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        other => bail!("{} is {other:?}; only BF16 and F32 tensors convert", t.name),
    })
}

/// Writes `values` as `ty` (F32 or BF16).
fn put_values(out: &mut dyn Write, values: &[f32], ty: GgmlType) -> Result<()> {
    let mut buf = Vec::with_capacity(values.len() * 4);
    match ty {
        GgmlType::F32 => values
            .iter()
            .for_each(|v| buf.extend_from_slice(&v.to_le_bytes())),
        GgmlType::Bf16 => values
            .iter()
            .for_each(|v| buf.extend_from_slice(&bf16_from_f32(*v).to_le_bytes())),
        GgmlType::Mxfp4 => bail!("values are not requantised to mxfp4"),
    }
    Ok(out.write_all(&buf)?)
}

/// Writes a checkpoint tensor as `ty`: its bytes as they are when the type is kept, else
/// converted in bounded chunks.
fn put_plain(out: &mut dyn Write, t: &TensorRef<'_>, ty: GgmlType) -> Result<()> {
    match (t.dtype, ty) {
        (Dtype::F32, GgmlType::F32) | (Dtype::BF16, GgmlType::Bf16) => Ok(out.write_all(t.bytes)?),
        (Dtype::F32 | Dtype::BF16, _) => {
            let elem = if t.dtype == Dtype::F32 { 4 } else { 2 };
            for chunk in t.bytes.chunks(elem << 20) {
                let part = TensorRef { bytes: chunk, ..*t };
                put_values(out, &widen(&part)?, ty)?;
            }
            Ok(())
        }
        (other, _) => bail!("{} is {other:?}; only BF16 and F32 tensors convert", t.name),
    }
}

fn write_source(out: &mut dyn Write, ckpt: &Checkpoint, p: &Planned) -> Result<()> {
    let ty = p.info.ty;
    match &p.source {
        Source::Plain(name) => put_plain(out, &ckpt.require(name)?, ty),
        Source::NegExp { name, n } => {
            let v = widen(&ckpt.require(name)?)?;
            put_values(
                out,
                &v[..*n].iter().map(|x| -x.exp()).collect::<Vec<_>>(),
                ty,
            )
        }
        Source::Product(norm, proj) => {
            let (a, b) = (widen(&ckpt.require(norm)?)?, widen(&ckpt.require(proj)?)?);
            ensure!(
                a.len() == b.len(),
                "{norm} has {} values, {proj} {}",
                a.len(),
                b.len()
            );
            put_values(
                out,
                &a.iter().zip(&b).map(|(x, y)| x * y).collect::<Vec<_>>(),
                ty,
            )
        }
        Source::KvB {
            name,
            heads,
            nope,
            v,
            k,
        } => {
            let t = ckpt.require(name)?;
            let values = widen(&t)?;
            put_values(
                out,
                &split_kv_b(&values, *heads, *nope, *v, t.shape[1], *k),
                ty,
            )
        }
        Source::Experts {
            layer,
            w,
            experts,
            mxfp4,
        } => {
            for e in 0..*experts {
                let base = format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{w}");
                if *mxfp4 {
                    let packed = ckpt.require(&format!("{base}.weight_packed"))?;
                    let (rows, cols) = (packed.shape[0], packed.shape[1] * 2);
                    let matrix = ckpt.mxfp4_matrix(&base, rows, cols)?;
                    let blocks = mxfp4_kernels::ggml::to_ggml(&matrix);
                    let mut buf =
                        Vec::with_capacity(blocks.len() * mxfp4_kernels::ggml::BLOCK_BYTES);
                    for b in &blocks {
                        buf.push(b.e);
                        buf.extend_from_slice(&b.qs);
                    }
                    out.write_all(&buf)?;
                } else {
                    put_plain(out, &ckpt.require(&format!("{base}.weight"))?, ty)?;
                }
            }
            Ok(())
        }
    }
}

/// The converter's MLA absorption split of `kv_b` (`[heads * (nope + v), lora]`, row-major):
/// `k` gives `[heads, lora, nope]` (each head's first `nope` rows, transposed), else
/// `[heads, v, lora]` (the `v` rows after them).
fn split_kv_b(kv_b: &[f32], heads: usize, nope: usize, v: usize, lora: usize, k: bool) -> Vec<f32> {
    let row = |h: usize, r: usize| &kv_b[(h * (nope + v) + r) * lora..][..lora];
    let mut out = Vec::with_capacity(heads * lora * if k { nope } else { v });
    for h in 0..heads {
        if k {
            for c in 0..lora {
                out.extend((0..nope).map(|r| row(h, r)[c]));
            }
        } else {
            (nope..nope + v).for_each(|r| out.extend_from_slice(row(h, r)));
        }
    }
    out
}

/// Converts the checkpoint in `model` to `out` (written beside as `.partial`, then renamed).
pub(crate) fn convert(model: &Path, out: &Path, outtype: Outtype) -> Result<Converted> {
    let text = std::fs::read_to_string(model.join("config.json")).context("reading config.json")?;
    let config = K3Config::from_json(&text)?;
    let hp = merged_hparams(&serde_json::from_str(&text)?)?;
    let ckpt = Checkpoint::open(model)?;
    let (plan, mxfp4) = plan(&ckpt, &config, &hp, outtype)?;
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model");
    let kv: Vec<(String, Value)> = metadata(&hp, name, outtype, mxfp4)?;
    let partial = out.with_extension("gguf.partial");
    let infos: Vec<TensorInfo> = plan.iter().map(|p| p.info.clone()).collect();
    let mut writer = Writer::create(&partial, &kv, infos)?;
    for p in &plan {
        writer.tensor(|o| write_source(o, &ckpt, p))?;
    }
    writer.finish()?;
    std::fs::rename(&partial, out)
        .with_context(|| format!("cannot move the gguf to {}", out.display()))?;
    Ok(Converted {
        tensors: plan.len(),
        bytes: std::fs::metadata(out)?.len(),
        mxfp4_experts: mxfp4,
    })
}

/// `cargo xtask gguf --model DIR --out FILE [--outtype bf16|f32]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = crate::Options::parse(args, &["model", "out", "outtype"])?;
    let model = crate::from_root(o.get("model").context("--model DIR is required")?);
    let out = crate::from_root(o.get("out").context("--out FILE is required")?);
    let outtype = match o.get("outtype").unwrap_or("bf16") {
        "bf16" => Outtype::Bf16,
        "f32" => Outtype::F32,
        other => bail!("--outtype {other:?} is not bf16 or f32"),
    };
    let started = std::time::Instant::now();
    let c = convert(&model, &out, outtype)?;
    println!(
        "{}: {} tensors, {:.3} GB, experts {}, {:.1} s",
        out.display(),
        c.tensors,
        c.bytes as f64 / 1e9,
        if c.mxfp4_experts {
            "ggml mxfp4"
        } else {
            "dense"
        },
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
