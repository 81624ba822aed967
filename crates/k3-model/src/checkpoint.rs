//! Validating a checkpoint against the config: every tensor the config implies (the
//! [`inventory`](crate::inventory)) is present with its shape and dtype, `A_log` is per head
//! (a longer zero-padded tensor is accepted and truncated), extra tensors (the vision tower and
//! projector) are ignored.
//!
//! Routed-expert scale bytes are checked for 0xFF (NaN) whenever an expert's view is built
//! ([`expert_store::Checkpoint::mxfp4_matrix`]), and for the whole checkpoint by
//! [`validate_expert_scales`] — a separate step, since scanning every scale of the release
//! reads 82 GB, which a streaming engine must not do at load.

use expert_store::checkpoint::{Checkpoint, CheckpointError, Dtype};

use crate::config::K3Config;
use crate::inventory::{DType, text_tensors};

/// A checkpoint that matches its config.
#[derive(Debug)]
pub struct Validated<'a> {
    pub checkpoint: &'a Checkpoint,
    /// Per KDA layer whose `A_log` was stored padded: (layer, stored length).
    pub truncated_a_log: Vec<(usize, usize)>,
}

/// Checks `checkpoint` against `config`; the error names the file, the tensor, what was
/// expected and what was found.
pub fn validate<'a>(
    checkpoint: &'a Checkpoint,
    config: &K3Config,
) -> Result<Validated<'a>, CheckpointError> {
    let mut truncated_a_log = Vec::new();
    for spec in text_tensors(config) {
        let t = checkpoint.require(&spec.name)?;
        let mismatch = |expected: String, found: String| CheckpointError::Mismatch {
            path: t.path.to_owned(),
            tensor: t.name.to_owned(),
            expected,
            found,
        };
        let want = match spec.dtype {
            DType::Bf16 => Dtype::BF16,
            DType::F32 => Dtype::F32,
            DType::U8 => Dtype::U8,
        };
        if t.dtype != want {
            return Err(mismatch(format!("{want:?}"), format!("{:?}", t.dtype)));
        }
        if spec.name.ends_with("self_attn.A_log") {
            let heads = config.kda.num_heads;
            let len = match t.shape {
                [len] => *len,
                _ => {
                    return Err(mismatch(
                        format!("[{heads}] (or longer, zero-padded)"),
                        format!("{:?}", t.shape),
                    ));
                }
            };
            if len < heads {
                return Err(mismatch(
                    format!("[{heads}] (or longer, zero-padded)"),
                    format!("[{len}]"),
                ));
            }
            let tail_nonzero = t.bytes[4 * heads..]
                .chunks_exact(4)
                .any(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != 0.0);
            if tail_nonzero {
                return Err(mismatch(
                    format!("A_log[{heads}..{len}] all zero (one value per head, zero padding)"),
                    "non-zero values after the heads".into(),
                ));
            }
            if len > heads {
                truncated_a_log.push((spec.layer.unwrap_or(0), len));
            }
            continue;
        }
        if t.shape != spec.shape.as_slice() {
            return Err(mismatch(
                format!("{:?}", spec.shape),
                format!("{:?}", t.shape),
            ));
        }
    }
    Ok(Validated {
        checkpoint,
        truncated_a_log,
    })
}

/// Builds every routed expert's three MXFP4 views, which checks each scale byte for 0xFF
/// (NaN) and each shape; returns the number of expert matrices checked. This reads every scale
/// byte of the checkpoint (about 5.6% of the expert bytes: 82 GB for the release), so it is a
/// separate, explicit step (`cargo xtask k3-check` runs it), not part of [`validate`].
pub fn validate_expert_scales(
    checkpoint: &Checkpoint,
    config: &K3Config,
) -> Result<usize, CheckpointError> {
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    let mut checked = 0;
    for (i, layer) in config.layers.iter().enumerate() {
        if layer.ffn != crate::config::FfnKind::Moe {
            continue;
        }
        for e in 0..config.moe.num_experts {
            let base = format!("model.layers.{i}.block_sparse_moe.experts.{e}");
            for (w, rows, cols) in [("w1", inter, io), ("w2", io, inter), ("w3", inter, io)] {
                checkpoint.mxfp4_matrix(&format!("{base}.{w}"), rows, cols)?;
                checked += 1;
            }
        }
    }
    Ok(checked)
}

/// A KDA layer's `A_log`, one value per head: a zero-padded stored tensor is truncated to
/// `num_heads` (run [`validate`] first; it checks the padding is zero).
pub fn a_log(
    checkpoint: &Checkpoint,
    config: &K3Config,
    layer: usize,
) -> Result<Vec<f32>, CheckpointError> {
    let name = format!("model.layers.{layer}.self_attn.A_log");
    let stored = checkpoint
        .require(&name)?
        .shape
        .first()
        .copied()
        .unwrap_or(0);
    let mut values = checkpoint.f32_values(&name, &[stored])?;
    values.truncate(config.kda.num_heads);
    Ok(values)
}
