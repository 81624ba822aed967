//! The *dense twin* of a K3 checkpoint for `cargo xtask oracle-llamacpp`: the checkpoint with
//! every routed expert dequantised exactly to F32 (llama.cpp's MXFP4 matmul quantises its
//! activations) and MLA padded with zero heads to the KDA head count (llama.cpp's K3 graph takes
//! both head counts from `num_attention_heads`); see docs/ORACLE_LLAMACPP.md.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use expert_store::Checkpoint;
use expert_store::Dtype;
use expert_store::writer::{TensorOut, write_safetensors};
use k3_model::config::{AttentionKind, K3Config};
use k3_model::inventory::{TensorClass, text_tensors};
use mxfp4_kernels::Kernels;

/// What the dense twin is, for the manifest.
pub(crate) struct DenseTwin {
    pub(crate) vocab_size: usize,
    pub(crate) tensors: usize,
    pub(crate) expert_matrices: usize,
    pub(crate) mla_heads: usize,
    pub(crate) kda_heads: usize,
    pub(crate) mla_note: String,
}

/// Writes to `dst` the checkpoint in `src` with every routed expert dequantised exactly to F32
/// (`...experts.{e}.w{1,2,3}.weight`, the dense names the converter stacks) and MLA padded with
/// zero heads to the KDA head count; config.json loses `quantization_config` and gets the new
/// `num_attention_heads` and `num_key_value_heads`.
/// With `keep_mxfp4` the routed experts are copied as they are (and `quantization_config`
/// kept): only the MLA padding is applied.
pub(crate) fn write_dense_twin(src: &Path, dst: &Path, keep_mxfp4: bool) -> Result<DenseTwin> {
    let text = fs::read_to_string(src.join("config.json")).context("cannot read config.json")?;
    let config = K3Config::from_json(&text)?;
    let checkpoint = Checkpoint::open(src)?;
    let kernels = Kernels::scalar();
    let (mla_heads, kda_heads) = (config.mla.num_heads, config.kda.num_heads);
    if mla_heads > kda_heads {
        bail!(
            "llama.cpp's K3 graph uses one head count for MLA and KDA; this checkpoint has \
             {mla_heads} MLA heads and {kda_heads} KDA heads, and only MLA can be padded"
        );
    }
    let extra_heads = kda_heads - mla_heads;
    let mla = &config.mla;
    // Rows of one head in each MLA tensor laid out head-major along its rows.
    let head_rows: [(&str, usize); 3] = [
        ("q_b_proj", mla.qk_nope_head_dim + mla.qk_rope_head_dim),
        ("kv_b_proj", mla.qk_nope_head_dim + mla.v_head_dim),
        ("g_proj", mla.v_head_dim),
    ];

    let mut outputs: Vec<(TensorOut, Vec<u8>)> = Vec::new();
    let mut expert_matrices = 0;
    for spec in text_tensors(&config) {
        if spec.class == TensorClass::RoutedExperts && !keep_mxfp4 {
            let Some(base) = spec.name.strip_suffix(".weight_packed") else {
                continue; // the scale, consumed with its packed tensor
            };
            let packed = checkpoint.require(&spec.name)?;
            ensure!(packed.shape.len() == 2, "{}: not a matrix", packed.name);
            let (rows, cols) = (packed.shape[0], packed.shape[1] * 2);
            let matrix = checkpoint.mxfp4_matrix(base, rows, cols)?;
            let mut values = vec![0.0f32; rows * cols];
            kernels.dequant_mxfp4(&matrix, 0..rows, &mut values)?;
            let stored = packed.name.strip_suffix(".weight_packed").unwrap_or(base);
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            outputs.push((
                TensorOut {
                    name: format!("{stored}.weight"),
                    dtype: Dtype::F32,
                    shape: vec![rows, cols],
                },
                bytes,
            ));
            expert_matrices += 1;
            continue;
        }
        let tensor = checkpoint.require(&spec.name)?;
        let mut shape = tensor.shape.to_vec();
        let mut bytes = tensor.bytes.to_vec();
        let is_mla = spec
            .layer
            .is_some_and(|l| config.layers[l].attention == AttentionKind::Mla);
        if is_mla && extra_heads > 0 {
            let elem = tensor.dtype.bitsize() / 8;
            let suffix = |p: &str| spec.name.ends_with(&format!(".self_attn.{p}.weight"));
            if let Some(&(_, rows)) = head_rows.iter().find(|(p, _)| suffix(p)) {
                // Zero rows: the new heads' queries, keys, values and gates are all zero.
                bytes.resize(bytes.len() + extra_heads * rows * shape[1] * elem, 0);
                shape[0] += extra_heads * rows;
            } else if suffix("o_proj") {
                // Zero columns: whatever the new heads output is dropped.
                let (old, new) = (
                    shape[1] * elem,
                    (shape[1] + extra_heads * mla.v_head_dim) * elem,
                );
                bytes = bytes
                    .chunks_exact(old)
                    .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, new - old)))
                    .collect();
                shape[1] += extra_heads * mla.v_head_dim;
            }
        }
        outputs.push((
            TensorOut {
                name: tensor.name.to_owned(),
                dtype: tensor.dtype,
                shape,
            },
            bytes,
        ));
    }

    if dst.exists() {
        fs::remove_dir_all(dst).with_context(|| format!("cannot remove {}", dst.display()))?;
    }
    fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
    let tensors = outputs.len();
    let mut data: HashMap<String, Vec<u8>> = HashMap::with_capacity(tensors);
    let mut list = Vec::with_capacity(tensors);
    for (out, bytes) in outputs {
        data.insert(out.name.clone(), bytes);
        list.push(out);
    }
    write_safetensors(&dst.join("model.safetensors"), list, |t, buf| {
        buf.extend_from_slice(&data[&t.name]);
    })?;

    let mut root: serde_json::Value = serde_json::from_str(&text)?;
    let object = root
        .as_object_mut()
        .context("config.json is not an object")?;
    if !keep_mxfp4 {
        object.remove("quantization_config");
    }
    let text_config = object
        .get_mut("text_config")
        .and_then(|t| t.as_object_mut())
        .context("config.json has no text_config")?;
    if !keep_mxfp4 {
        text_config.remove("quantization_config");
    }
    // The converter splits kv_b_proj by `num_key_value_heads` (the release has 96 of each).
    for key in ["num_attention_heads", "num_key_value_heads"] {
        text_config.insert(key.into(), kda_heads.into());
    }
    let mut config_text = serde_json::to_string_pretty(&root)?;
    config_text.push('\n');
    fs::write(dst.join("config.json"), config_text)?;
    for file in ["tiktoken.model", "tokenizer_config.json"] {
        if src.join(file).exists() {
            fs::copy(src.join(file), dst.join(file))
                .with_context(|| format!("cannot copy {file}"))?;
        }
    }

    let mla_note = if extra_heads == 0 {
        "MLA and KDA head counts agree; no padding".to_owned()
    } else {
        format!(
            "llama.cpp's K3 graph takes the MLA and the KDA head count both from \
             num_attention_heads, so MLA was padded from {mla_heads} to {kda_heads} heads with \
             zero q_b/kv_b/g_proj rows and zero o_proj columns (an exact no-op)"
        )
    };
    Ok(DenseTwin {
        vocab_size: config.vocab_size,
        tensors,
        expert_matrices,
        mla_heads,
        kda_heads,
        mla_note,
    })
}
