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
//!
//! `--outtype q8_0` is ours, not the converter's (whose q8_0 quantises every matrix, the
//! embedding and lm_head included): only [`Q8_0_SET`], the trunk matrices our engine's Q8_0
//! trunk quantises, become ggml `block_q8_0` (`mxfp4_kernels::codes::quantize_q8_0`, ggml's
//! `quantize_row_q8_0_ref`, of the checkpoint's values widened to f32, row by row); everything
//! else is written as `--outtype bf16` writes it, so llama.cpp and we read the same weights.

mod write;

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use expert_store::{Checkpoint, Dtype};
use k3_model::config::{AttentionKind, FfnKind, K3Config};
use k3_model::inventory::{TensorClass, text_tensors};
use serde_json::Value as Json;

use crate::gguf::{GgmlType, TensorInfo, Value, Writer};
use crate::gguf_k3_meta::{Outtype, merged_hparams, metadata};
use write::{Source, write_source};

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

/// The GGUF leaf names (under `blk.N.`) that a Q8_0 trunk quantises: the KDA and MLA
/// projections (`g_proj` is `ssm_g` on KDA layers, `attn_gate` on MLA layers), the dense MLPs,
/// the shared experts and the latent projections. An interface shared with the engine's own
/// Q8_0 trunk: the embedding, lm_head, router, KDA `f_a`/`f_b`/`beta`, the split `kv_b`
/// (`attn_k_b`, `attn_v_b`) and every vector stay as the BF16 outtype writes them.
pub(crate) const Q8_0_SET: &[&str] = &[
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "ssm_g.weight",
    "attn_output.weight",
    "attn_q_a.weight",
    "attn_q_b.weight",
    "attn_kv_a_mqa.weight",
    "attn_gate.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
    "ffn_routed_down.weight",
    "ffn_routed_up.weight",
];

/// Whether the GGUF tensor `name` (`blk.N.leaf`) is in [`Q8_0_SET`].
pub(crate) fn in_q8_0_set(name: &str) -> bool {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .is_some_and(|(_, leaf)| Q8_0_SET.contains(&leaf))
}

/// Whether the checkpoint tensor `name` (relative to the text model,
/// `model.layers.N.self_attn.q_proj.weight`) becomes a tensor of [`Q8_0_SET`].
pub(crate) fn q8_0_source(name: &str) -> bool {
    let Some(leaf) = name
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split_once('.'))
        .map(|(_, leaf)| leaf)
    else {
        return false;
    };
    // `g_proj` is `ssm_g` or `attn_gate`, both in the set.
    leaf == "self_attn.g_proj.weight"
        || LAYER_NAMES
            .iter()
            .any(|(hf, gguf)| *hf == leaf && Q8_0_SET.contains(gguf))
}

/// The converter's `prepare_tensors` type choice: F32 for vectors, `_norm.weight`, the router,
/// the KDA convolutions and anything not named `.weight`; else the outtype (for `Q8_0`: Q8_0
/// in [`Q8_0_SET`], BF16 elsewhere).
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
        (false, Outtype::Q8_0) if in_q8_0_set(name) => GgmlType::Q8_0,
        (false, Outtype::Bf16 | Outtype::Q8_0) => GgmlType::Bf16,
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
    for p in out.iter().filter(|p| p.info.ty == GgmlType::Q8_0) {
        check_q8_0_source(ckpt, p)?;
    }
    Ok((out, any_mxfp4))
}

/// A Q8_0 tensor must come from a plain BF16 or F32 checkpoint matrix with rows of whole
/// 32-value blocks.
fn check_q8_0_source(ckpt: &Checkpoint, p: &Planned) -> Result<()> {
    let name = &p.info.name;
    let Source::Plain(source) = &p.source else {
        bail!("{name} is in the Q8_0 set but is not a plain checkpoint matrix");
    };
    let t = ckpt.require(source)?;
    ensure!(
        matches!(t.dtype, Dtype::BF16 | Dtype::F32),
        "{name}: {source} is {:?}; only BF16 and F32 matrices quantise to Q8_0",
        t.dtype
    );
    ensure!(
        t.shape.len() == 2 && t.shape[1].is_multiple_of(32),
        "{name}: {source} has shape {:?}; Q8_0 needs a matrix whose rows hold a multiple of 32 values",
        t.shape
    );
    Ok(())
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
        writer.tensor(|o| write_source(o, &ckpt, &p.source, p.info.ty))?;
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

/// `cargo xtask gguf --model DIR --out FILE [--outtype bf16|f32|q8_0]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = crate::Options::parse(args, &["model", "out", "outtype"])?;
    let model = crate::from_root(o.get("model").context("--model DIR is required")?);
    let out = crate::from_root(o.get("out").context("--out FILE is required")?);
    let outtype = match o.get("outtype").unwrap_or("bf16") {
        "bf16" => Outtype::Bf16,
        "f32" => Outtype::F32,
        "q8_0" => Outtype::Q8_0,
        other => bail!("--outtype {other:?} is not bf16, f32 or q8_0"),
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
mod tests;
