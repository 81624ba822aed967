//! Validating a checkpoint against the config: every tensor the config implies (the
//! [`inventory`](crate::inventory)) is present with its shape in a format its role allows
//! (linear weights BF16, F16, F32 or MXFP4; float vectors F32, BF16 or F16; routed experts
//! MXFP4), `A_log` is per head (a longer zero-padded tensor is accepted and truncated), extra
//! tensors (the vision tower and projector) are ignored.
//!
//! Routed-expert scale bytes are checked for 0xFF (NaN) whenever an expert's view is built
//! ([`expert_store::Checkpoint::mxfp4_matrix`]), and for the whole checkpoint by
//! [`validate_expert_scales`] — a separate step, since scanning every scale of the release
//! reads 82 GB, which a streaming engine must not do at load.

use std::collections::HashSet;

use expert_store::checkpoint::{Checkpoint, CheckpointError, Dtype, LinearStorage};

use crate::config::K3Config;
use crate::inventory::{A_LOG, KdaNames, Role, TensorClass, expert_layout, text_tensors};

/// A checkpoint that matches its config.
#[derive(Debug)]
pub struct Validated<'a> {
    /// The checkpoint checked.
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
        if spec.role() == Role::Linear
            && let LinearStorage::MxFp4(base) = checkpoint.linear_format(&spec.name)?
        {
            // The view checks both tensors' dtype and shape and every scale byte, as a load does.
            checkpoint.mxfp4_matrix(&base, spec.shape[0], spec.shape[1])?;
            continue;
        }
        let t = checkpoint.require(&spec.name)?;
        let mismatch = |expected: String, found: String| CheckpointError::Mismatch {
            path: t.path.to_owned(),
            tensor: t.name.to_owned(),
            expected,
            found,
        };
        let accepted = match spec.role() {
            Role::Linear | Role::Vector => matches!(t.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16),
            Role::ExpertPart => t.dtype == Dtype::U8,
        };
        if !accepted {
            return Err(mismatch(
                spec.role().formats().to_owned(),
                format!("{:?}", t.dtype),
            ));
        }
        if spec.name.ends_with(A_LOG) {
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
            let tail_nonzero = checkpoint.f32_values(&spec.name, &[len])?[heads..]
                .iter()
                .any(|&v| v != 0.0);
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
    let layout = expert_layout(config);
    let mut checked = 0;
    for (i, layer) in config.layers.iter().enumerate() {
        if layer.ffn != crate::config::FfnKind::Moe {
            continue;
        }
        for e in 0..config.moe.num_experts {
            for m in layout.matrices() {
                let (codes, scales) = (m.codes.name(i, e), m.scales.name(i, e));
                checkpoint.mxfp4_tensors(&codes, &scales, m.rows, m.cols)?;
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
    let name = KdaNames::new(layer).a_log;
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

/// The stored names (with the checkpoint's prefix) of every trunk tensor — all text tensors
/// but the routed experts — in the format this checkpoint holds them: an MXFP4 linear weight
/// contributes its `weight_packed` and `weight_scale`. The set to keep when copying the trunk
/// into resident memory ([`Checkpoint::make_resident`]). Tensors the checkpoint lacks are left
/// out ([`validate`] reports them).
pub fn trunk_tensor_names(checkpoint: &Checkpoint, config: &K3Config) -> HashSet<String> {
    let stored = |name: &str| checkpoint.tensor(name).map(|t| t.name.to_owned());
    let mut names = HashSet::new();
    for spec in text_tensors(config) {
        if spec.class == TensorClass::RoutedExperts {
            continue;
        }
        if spec.role() == Role::Linear
            && let Ok(LinearStorage::MxFp4(base)) = checkpoint.linear_format(&spec.name)
        {
            names.extend(stored(&format!("{base}.weight_packed")));
            names.extend(stored(&format!("{base}.weight_scale")));
            continue;
        }
        names.extend(stored(&spec.name));
    }
    names
}
