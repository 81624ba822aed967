//! The routed-expert FFN of a gated-linear-unit MoE, `down(act(gate·z, up·z))`, over three MXFP4
//! matrices.
//!
//! Why this shape belongs in a kernel crate: gate, up and down projections with an element-wise
//! gated activation between them is the routed expert of every widely used MoE (Mixtral,
//! DeepSeek, Qwen MoE, Kimi), and fusing it lets gate and up share one prepared input
//! and the hidden vector be prepared once for down. What varies between models is the
//! activation: [`GluActivation`], which K3's [`Situ`] implements (SwiGLU or GeGLU plug in the
//! same way). Nothing here knows K3's shapes or names.

use std::ops::Range;

use crate::activations::Activations;
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::situ::Situ;
use crate::view::MxFp4Matrix;

/// The element-wise activation of a gated linear unit: `out[i] = act(gate[i], up[i])`.
pub trait GluActivation {
    /// Writes `act(gate[i], up[i])` to `out[i]` with `kernels`' tier; the three slices have one
    /// length (else an error).
    fn apply(&self, kernels: &Kernels, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()>;
}

/// SiTU-GLU (K3's).
impl GluActivation for Situ {
    fn apply(&self, kernels: &Kernels, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        Situ::apply(self, kernels, gate, up, out)
    }
}

/// Reusable buffers for [`Kernels::expert_ffn`]; one per worker thread.
#[derive(Debug, Default)]
pub struct ExpertScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
    hidden_act: Option<Activations>,
}

impl Kernels {
    /// One routed expert for every prepared token: `out[t * down.rows() + i] =
    /// (down · act(gate · z_t, up · z_t))[i]`. Gate and up read the same prepared input; the
    /// hidden vector is prepared once for the down projection. Batch-invariant like `matmul`.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_ffn(
        &self,
        gate: &MxFp4Matrix<'_>,
        up: &MxFp4Matrix<'_>,
        down: &MxFp4Matrix<'_>,
        act: &impl GluActivation,
        z: &Activations,
        scratch: &mut ExpertScratch,
        out: &mut [f32],
    ) -> Result<()> {
        check_expert(gate, up, down)?;
        let inter = gate.rows();
        let mut hidden = std::mem::take(&mut scratch.hidden);
        hidden.resize(z.tokens() * inter, 0.0);
        self.expert_gate_up(gate, up, act, z, 0..inter, scratch, &mut hidden)?;
        let h = match scratch.hidden_act.take() {
            Some(mut h) => {
                h.refill(self, &hidden, inter)?;
                h
            }
            None => self.prepare(&hidden, inter)?,
        };
        scratch.hidden = hidden;
        let result = self.matmul_mxfp4(down, &h, 0..down.rows(), out);
        scratch.hidden_act = Some(h);
        result
    }

    /// The first half of the expert for a row range of the intermediate vector, for callers
    /// that split one expert across workers: `hidden[t * rows.len() + j] = act(gate · z_t,
    /// up · z_t)[rows.start + j]`.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_gate_up(
        &self,
        gate: &MxFp4Matrix<'_>,
        up: &MxFp4Matrix<'_>,
        act: &impl GluActivation,
        z: &Activations,
        rows: Range<usize>,
        scratch: &mut ExpertScratch,
        hidden: &mut [f32],
    ) -> Result<()> {
        if gate.rows() != up.rows() || gate.cols() != up.cols() {
            return Err(Error::ExpertShapes(format!(
                "gate is [{}, {}] but up is [{}, {}]",
                gate.rows(),
                gate.cols(),
                up.rows(),
                up.cols()
            )));
        }
        let n = rows.len() * z.tokens();
        if hidden.len() != n {
            return Err(Error::OutputLength {
                expected: n,
                found: hidden.len(),
            });
        }
        scratch.gate.resize(n, 0.0);
        scratch.up.resize(n, 0.0);
        self.matmul_mxfp4(gate, z, rows.clone(), &mut scratch.gate)?;
        self.matmul_mxfp4(up, z, rows, &mut scratch.up)?;
        act.apply(self, &scratch.gate, &scratch.up, hidden)
    }
}

fn check_expert(
    gate: &MxFp4Matrix<'_>,
    up: &MxFp4Matrix<'_>,
    down: &MxFp4Matrix<'_>,
) -> Result<()> {
    if gate.rows() != up.rows() || gate.cols() != up.cols() || down.cols() != gate.rows() {
        return Err(Error::ExpertShapes(format!(
            "gate [{}, {}], up [{}, {}], down [{}, {}]: gate and up must match and down.cols must equal gate.rows",
            gate.rows(),
            gate.cols(),
            up.rows(),
            up.cols(),
            down.rows(),
            down.cols()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gate · up`, a plain bilinear GLU: an activation that is not SiTU.
    struct Bilinear;

    impl GluActivation for Bilinear {
        fn apply(&self, _: &Kernels, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
            for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
                *o = g * u;
            }
            Ok(())
        }
    }

    /// The expert applies the activation it is given: with a bilinear GLU it is the composition
    /// of the scalar tier's matmuls around `gate · up`, bit for bit.
    #[test]
    fn expert_ffn_applies_the_given_activation() {
        let k = Kernels::scalar();
        let (inter, io) = (32, 64);
        let codes = |n: usize, seed: u8| -> Vec<u8> {
            (0..n).map(|i| (i as u8).wrapping_mul(37) ^ seed).collect()
        };
        let (g_codes, u_codes, d_codes) = (
            codes(inter * io / 2, 1),
            codes(inter * io / 2, 2),
            codes(io * inter / 2, 3),
        );
        let scales = |n: usize| vec![126u8; n];
        let (g_scales, u_scales, d_scales) = (
            scales(inter * io / 32),
            scales(inter * io / 32),
            scales(io * inter / 32),
        );
        let gate = MxFp4Matrix::new(&g_codes, &g_scales, inter, io).unwrap();
        let up = MxFp4Matrix::new(&u_codes, &u_scales, inter, io).unwrap();
        let down = MxFp4Matrix::new(&d_codes, &d_scales, io, inter).unwrap();
        let input: Vec<f32> = (0..io).map(|i| (i as f32 * 0.37).sin()).collect();
        let z = k.prepare(&input, io).unwrap();
        let mut out = vec![0.0; io];
        k.expert_ffn(
            &gate,
            &up,
            &down,
            &Bilinear,
            &z,
            &mut ExpertScratch::default(),
            &mut out,
        )
        .unwrap();

        let (mut g, mut u) = (vec![0.0; inter], vec![0.0; inter]);
        k.matmul_mxfp4(&gate, &z, 0..inter, &mut g).unwrap();
        k.matmul_mxfp4(&up, &z, 0..inter, &mut u).unwrap();
        let hidden: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a * b).collect();
        let h = k.prepare(&hidden, inter).unwrap();
        let mut expected = vec![0.0; io];
        k.matmul_mxfp4(&down, &h, 0..io, &mut expected).unwrap();
        assert!(expected.iter().any(|&v| v != 0.0));
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // SiTU gives other values from the same matrices.
        let mut situ = vec![0.0; io];
        k.expert_ffn(
            &gate,
            &up,
            &down,
            &Situ::K3,
            &z,
            &mut ExpertScratch::default(),
            &mut situ,
        )
        .unwrap();
        assert_ne!(situ, out);
    }
}
