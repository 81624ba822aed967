//! The routed-expert FFN, `down(SiTU(gate·z, up·z))`, over three MXFP4 matrices.

use std::ops::Range;

use crate::activations::Activations;
use crate::error::{Error, Result};
use crate::situ::Situ;
use crate::tier::Kernels;
use crate::view::MxFp4Matrix;

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
    /// (down · SiTU(gate · z_t, up · z_t))[i]`. Gate and up read the same prepared input; the
    /// hidden vector is prepared once for the down projection. Batch-invariant like `matmul`.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_ffn(
        &self,
        gate: &MxFp4Matrix<'_>,
        up: &MxFp4Matrix<'_>,
        down: &MxFp4Matrix<'_>,
        situ: &Situ,
        z: &Activations,
        scratch: &mut ExpertScratch,
        out: &mut [f32],
    ) -> Result<()> {
        check_expert(gate, up, down)?;
        let inter = gate.rows();
        let mut hidden = std::mem::take(&mut scratch.hidden);
        hidden.resize(z.tokens() * inter, 0.0);
        self.expert_gate_up(gate, up, situ, z, 0..inter, scratch, &mut hidden)?;
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
    /// that split one expert across workers: `hidden[t * rows.len() + j] = SiTU(gate · z_t,
    /// up · z_t)[rows.start + j]`.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_gate_up(
        &self,
        gate: &MxFp4Matrix<'_>,
        up: &MxFp4Matrix<'_>,
        situ: &Situ,
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
        situ.apply(self, &scratch.gate, &scratch.up, hidden)
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
