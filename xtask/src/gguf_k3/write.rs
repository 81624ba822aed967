//! How a planned `kimi-k3` GGUF tensor's values are written (see `gguf_k3`): where they come
//! from ([`Source`]), the checkpoint's values widened to f32 where they change type, combined
//! (`-exp`, AttnRes products) or split (`kv_b`), and re-encoded as F32, BF16 or Q8_0; MXFP4
//! experts repacked to ggml's blocks byte for byte.

use std::io::Write;

use anyhow::{Result, bail, ensure};
use expert_store::{Checkpoint, Dtype, TensorRef};
use mxfp4_kernels::codes::{Q8_0_BLOCK, quantize_q8_0};

use crate::gguf::{GgmlType, bf16_from_f32};

/// Where a GGUF tensor's values come from.
#[derive(Debug, Clone)]
pub(super) enum Source {
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
        GgmlType::Q8_0 => {
            ensure!(
                values.len().is_multiple_of(Q8_0_BLOCK),
                "{} values are not whole q8_0 blocks",
                values.len()
            );
            for block in values.chunks_exact(Q8_0_BLOCK) {
                buf.extend_from_slice(&quantize_q8_0(block.try_into().expect("32 values")));
            }
        }
        GgmlType::Mxfp4 => bail!("values are not requantised to mxfp4"),
    }
    Ok(out.write_all(&buf)?)
}

/// Writes a checkpoint tensor as `ty`: its bytes as they are when the type is kept, else
/// converted in bounded chunks of about a million values (whole rows for Q8_0, whose rows
/// `check_q8_0_source` checked hold whole blocks, so no block straddles two rows).
fn put_plain(out: &mut dyn Write, t: &TensorRef<'_>, ty: GgmlType) -> Result<()> {
    match (t.dtype, ty) {
        (Dtype::F32, GgmlType::F32) | (Dtype::BF16, GgmlType::Bf16) => Ok(out.write_all(t.bytes)?),
        (Dtype::F32 | Dtype::BF16, _) => {
            let elem = if t.dtype == Dtype::F32 { 4 } else { 2 };
            let row = t.shape.last().copied().unwrap_or(1).max(1);
            let chunk_values = ((1 << 20) / row).max(1) * row;
            for chunk in t.bytes.chunks(elem * chunk_values) {
                let part = TensorRef { bytes: chunk, ..*t };
                put_values(out, &widen(&part)?, ty)?;
            }
            Ok(())
        }
        (other, _) => bail!("{} is {other:?}; only BF16 and F32 tensors convert", t.name),
    }
}

/// Writes the values of `source` as `ty`.
pub(super) fn write_source(
    out: &mut dyn Write,
    ckpt: &Checkpoint,
    source: &Source,
    ty: GgmlType,
) -> Result<()> {
    match source {
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
pub(super) fn split_kv_b(
    kv_b: &[f32],
    heads: usize,
    nope: usize,
    v: usize,
    lora: usize,
    k: bool,
) -> Vec<f32> {
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
