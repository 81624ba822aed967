//! The forward pass's side of the stream: a layer's attention or MoE block relocated into
//! the buffer of its step, and the matrices read in row blocks (a dense MLP's, the lm_head)
//! multiplied block by block, each output row computed as in the whole matrix (same bits).

use std::ops::{Deref, Range};

use mxfp4_kernels::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, WeightMatrix};

use super::super::error::Result;
use super::super::forward::Model;
use super::super::weights::{Attention, Kda, Mla, Mlp, Moe};
use super::stream::{Held, Pass, TrunkStream};
use crate::plan::{BLOCK_ROWS, Part};

/// Weights for the pass that asked: borrowed as loaded, or relocated (into the resident
/// buffer or a stream buffer the caller holds).
pub(in crate::model) enum WeightsRef<'l, T> {
    Loaded(&'l T),
    Relocated(T),
}

impl<T> Deref for WeightsRef<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            WeightsRef::Loaded(w) => w,
            WeightsRef::Relocated(w) => w,
        }
    }
}

impl<'a> Model<'a> {
    /// Layer `i`'s attention weights: as loaded, or relocated into the resident buffer and
    /// `held` (the buffer of its step).
    pub(in crate::model) fn attention_weights<'l>(
        &'l self,
        i: usize,
        held: Option<&'l Held<'_>>,
    ) -> Result<WeightsRef<'l, Attention<'l>>> {
        let attention = &self.layers[i].attention;
        let Some(trunk) = &self.trunk else {
            return Ok(WeightsRef::Loaded(attention));
        };
        let m = |w: &'l WeightMatrix<'_>| relocated_matrix(w, trunk, held);
        Ok(WeightsRef::Relocated(match attention {
            Attention::Kda(w) => Attention::Kda(Kda {
                q: m(&w.q)?,
                k: m(&w.k)?,
                v: m(&w.v)?,
                g: m(&w.g)?,
                o: m(&w.o)?,
                conv: w.conv.clone(),
                f_a: m(&w.f_a)?,
                f_b: m(&w.f_b)?,
                b: m(&w.b)?,
                a_log: w.a_log.clone(),
                dt_bias: w.dt_bias.clone(),
                o_norm: w.o_norm.clone(),
            }),
            Attention::Mla(w) => Attention::Mla(Mla {
                q_a: m(&w.q_a)?,
                q_a_norm: w.q_a_norm.clone(),
                q_b: m(&w.q_b)?,
                kv_a: m(&w.kv_a)?,
                kv_a_norm: w.kv_a_norm.clone(),
                kv_b: w.kv_b.clone(),
                g: w.g.as_ref().map(m).transpose()?,
                o: m(&w.o)?,
            }),
        }))
    }

    /// A MoE block's weights (`w`, of layer `i`) as [`Model::attention_weights`] gives them.
    pub(in crate::model) fn moe_weights<'l>(
        &'l self,
        w: &'l Moe<'_>,
        held: Option<&'l Held<'_>>,
    ) -> Result<WeightsRef<'l, Moe<'l>>> {
        let Some(trunk) = &self.trunk else {
            return Ok(WeightsRef::Loaded(w));
        };
        let m = |x: &'l WeightMatrix<'_>| relocated_matrix(x, trunk, held);
        Ok(WeightsRef::Relocated(Moe {
            router: m(&w.router)?,
            bias: w.bias.clone(),
            latent: match &w.latent {
                Some((down, norm, up)) => Some((m(down)?, norm.clone(), m(up)?)),
                None => None,
            },
            shared: match &w.shared {
                Some(s) => Some(Mlp {
                    gate: m(&s.gate)?,
                    up: m(&s.up)?,
                    down: m(&s.down)?,
                }),
                None => None,
            },
            layer: w.layer,
        }))
    }

    /// `w · x_t` for every token of `xs`, where `w` is `part` of layer `layer` (the layer
    /// count for the head): where the plan streams it in row blocks, block by block from the
    /// stream, each followed by a chunk of its resident leading rows (each block's rows land
    /// at their place: the same bits as one call), else as loaded or resident.
    pub(in crate::model) fn planned_gemm<'m>(
        &'m self,
        pass: &mut Pass<'m>,
        layer: usize,
        part: Part,
        w: &WeightMatrix<'_>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let Some(trunk) = &self.trunk else {
            return self.gemm(w, xs);
        };
        let steps = self.trunk_steps(layer, part);
        if steps.is_empty() {
            return self.gemm(&relocated_matrix(w, trunk, None)?, xs);
        }
        let mut out = vec![vec![0.0; w.rows()]; xs.len()];
        // The leading rows the plan keeps resident (the steps stream the rest, in order), cut
        // into as many chunks as there are steps, in whole row blocks: each streamed step is
        // taken first and then one resident chunk computes, so the buffer the step gives back
        // is refilled with the step after next while that chunk computes.
        let first = steps[0].0.as_ref().map_or(0, |r| r.start);
        let n = steps.len();
        let cut = |k: usize| match k {
            k if k >= n => first,
            k => first * k / n / BLOCK_ROWS * BLOCK_ROWS,
        };
        for (k, (rows, step)) in steps.iter().enumerate() {
            let rows = rows.clone().expect("a part read in row blocks has rows");
            let held = self.trunk_step(pass, *step)?;
            let block = sub_rows(w, rows.clone())?;
            let block = relocated_matrix(&block, trunk, Some(&held))?;
            for (o, y) in out.iter_mut().zip(self.gemm(&block, xs)?) {
                o[rows.clone()].copy_from_slice(&y);
            }
            drop(held);
            let resident = cut(k)..cut(k + 1);
            if !resident.is_empty() {
                let block = sub_rows(w, resident.clone())?;
                let block = relocated_matrix(&block, trunk, None)?;
                for (o, y) in out.iter_mut().zip(self.gemm(&block, xs)?) {
                    o[resident.clone()].copy_from_slice(&y);
                }
            }
        }
        Ok(out)
    }

    /// Layer `i`'s dense MLP (`w`): as [`Model::mlp`] where nothing is planned, else gate, up
    /// and down each through [`Model::planned_gemm`] (row for row the same bits).
    pub(in crate::model) fn planned_mlp<'m>(
        &'m self,
        pass: &mut Pass<'m>,
        i: usize,
        w: &Mlp<'_>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        if self.trunk.is_none() {
            return self.mlp(w, xs);
        }
        let gates = self.planned_gemm(pass, i, Part::Gate, &w.gate, xs)?;
        let ups = self.planned_gemm(pass, i, Part::Up, &w.up, xs)?;
        let mut hidden = Vec::with_capacity(xs.len());
        for (gate, up) in gates.iter().zip(&ups) {
            let mut h = vec![0.0; gate.len()];
            self.situ.apply(&self.kernels, gate, up, &mut h)?;
            hidden.push(h);
        }
        self.planned_gemm(pass, i, Part::Down, &w.down, &hidden)
    }
}

impl Model<'_> {
    /// Rows `rows` of `w` where the resident trunk holds them on their own: with several
    /// ranks a rank holds only its rows of each matrix, which a lookup of the whole matrix
    /// does not find (`None` without a planned trunk, or for no rows).
    pub(in crate::model) fn own_rows<'l>(
        &self,
        w: &WeightMatrix<'l>,
        rows: Range<usize>,
    ) -> Result<Option<WeightMatrix<'l>>> {
        match (&self.trunk, rows.is_empty()) {
            (Some(_), false) => sub_rows(w, rows).map(Some),
            _ => Ok(None),
        }
    }

    /// `w` (rows from [`Model::own_rows`]) as the resident trunk holds it: relocated, packed
    /// or requantised, or as it is where the trunk does not hold it.
    pub(in crate::model) fn resident_view<'l>(
        &'l self,
        w: &'l WeightMatrix<'_>,
    ) -> Result<WeightMatrix<'l>> {
        match &self.trunk {
            Some(trunk) => relocated_matrix(w, trunk, None),
            None => Ok(*w),
        }
    }
}

/// Rows `rows` of `w` (every format stores a row's bytes together, rows in order).
fn sub_rows<'l>(w: &WeightMatrix<'l>, rows: Range<usize>) -> Result<WeightMatrix<'l>> {
    let part = |bytes: &'l [u8]| {
        let per_row = bytes.len() / w.rows();
        &bytes[rows.start * per_row..rows.end * per_row]
    };
    let (n, cols) = (rows.len(), w.cols());
    Ok(match w {
        WeightMatrix::Bf16(x) => Bf16Matrix::new(part(x.bytes()), n, cols)?.into(),
        WeightMatrix::PackedBf16(x) => x.sub_rows(rows)?.into(),
        WeightMatrix::F16(x) => F16Matrix::new(part(x.bytes()), n, cols)?.into(),
        WeightMatrix::F32(x) => F32Matrix::new(part(x.bytes()), n, cols)?.into(),
        WeightMatrix::MxFp4(x) => {
            MxFp4Matrix::new(part(x.packed()), part(x.scales()), n, cols)?.into()
        }
        WeightMatrix::Q8_0(x) => x.sub_rows(rows)?.into(),
    })
}

/// `w` as `trunk` holds it for the pass: its bytes relocated into the resident copy or
/// `held` (the buffer of its step), or, for a BF16 matrix the resident copy holds packed or
/// `held` holds read packed from the pack cache, in its packed form (the same bits from every
/// kernel).
fn relocated_matrix<'l>(
    w: &'l WeightMatrix<'_>,
    trunk: &'l TrunkStream,
    held: Option<&'l Held<'_>>,
) -> Result<WeightMatrix<'l>> {
    let relocate = |bytes| trunk.relocate(held, bytes);
    Ok(match w {
        WeightMatrix::Bf16(x) => match trunk.packed(held, x.bytes())? {
            Some(packed) => packed,
            None => Bf16Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        },
        // Packed matrices are built in memory, never mapped from the checkpoint whose byte
        // ranges `relocate` translates: they stay where they are.
        WeightMatrix::PackedBf16(x) => (*x).into(),
        // Likewise Q8_0 matrices: quantised in memory, never mapped from the checkpoint.
        WeightMatrix::Q8_0(x) => (*x).into(),
        // Requantised where a lossy `--trunk-format` holds them so.
        WeightMatrix::F16(x) => match trunk.packed(held, x.bytes())? {
            Some(quantised) => quantised,
            None => F16Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        },
        WeightMatrix::F32(x) => match trunk.packed(held, x.bytes())? {
            Some(quantised) => quantised,
            None => F32Matrix::new(relocate(x.bytes()), x.rows(), x.cols())?.into(),
        },
        WeightMatrix::MxFp4(x) => MxFp4Matrix::new(
            relocate(x.packed()),
            relocate(x.scales()),
            x.rows(),
            x.cols(),
        )?
        .into(),
    })
}
