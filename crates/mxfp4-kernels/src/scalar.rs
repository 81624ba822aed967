//! The scalar tier: the oracle. Weights decoded exactly, f32 products summed sequentially by
//! column (`acc += w * x`), one row and one token at a time. Every SIMD tier is tested against it.

use std::ops::Range;

use crate::activations::Activations;
use crate::codes::{E2M1_VALUES, E8M0_TO_F32, Q8_0_BLOCK_BYTES, bf16_to_f32, f16_to_f32};
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, GROUP, MxFp4Matrix, Q8_0Matrix};

pub(crate) fn dequant_mxfp4(matrix: &MxFp4Matrix<'_>, rows: Range<usize>, out: &mut [f32]) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let packed = matrix.packed_row(row);
        let scales = matrix.scale_row(row);
        for (c, w) in out_row.iter_mut().enumerate() {
            let code = (packed[c / 2] >> (4 * (c & 1))) & 0xF;
            *w = E2M1_VALUES[code as usize] * E8M0_TO_F32[scales[c / GROUP] as usize];
        }
    }
}

/// Each weight `q · d`, exact in f32 (an 8-bit integer times an F16 value).
pub(crate) fn dequant_q8_0(matrix: &Q8_0Matrix<'_>, rows: Range<usize>, out: &mut [f32]) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        let blocks = matrix.row_bytes(row).chunks_exact(Q8_0_BLOCK_BYTES);
        for (block, dst) in blocks.zip(out_row.chunks_exact_mut(32)) {
            let d = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
            for (w, &q) in dst.iter_mut().zip(&block[2..]) {
                *w = f32::from(q as i8) * d;
            }
        }
    }
}

pub(crate) fn dequant_bf16(matrix: &Bf16Matrix<'_>, rows: Range<usize>, out: &mut [f32]) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        for (w, pair) in out_row
            .iter_mut()
            .zip(matrix.row_bytes(row).chunks_exact(2))
        {
            *w = bf16_to_f32(u16::from_le_bytes([pair[0], pair[1]]));
        }
    }
}

pub(crate) fn dequant_f16(matrix: &F16Matrix<'_>, rows: Range<usize>, out: &mut [f32]) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        for (w, pair) in out_row
            .iter_mut()
            .zip(matrix.row_bytes(row).chunks_exact(2))
        {
            *w = f16_to_f32(u16::from_le_bytes([pair[0], pair[1]]));
        }
    }
}

pub(crate) fn dequant_f32(matrix: &F32Matrix<'_>, rows: Range<usize>, out: &mut [f32]) {
    let cols = matrix.cols();
    for (row, out_row) in rows.zip(out.chunks_exact_mut(cols)) {
        for (w, quad) in out_row
            .iter_mut()
            .zip(matrix.row_bytes(row).chunks_exact(4))
        {
            *w = f32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]);
        }
    }
}

pub(crate) fn matmul_mxfp4(
    matrix: &MxFp4Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    matmul_rows(matrix.cols(), act, rows, out, |row, w| {
        dequant_mxfp4(matrix, row..row + 1, w)
    });
}

pub(crate) fn matmul_q8_0(
    matrix: &Q8_0Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    matmul_rows(matrix.cols(), act, rows, out, |row, w| {
        dequant_q8_0(matrix, row..row + 1, w)
    });
}

pub(crate) fn matmul_bf16(
    matrix: &Bf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    matmul_rows(matrix.cols(), act, rows, out, |row, w| {
        dequant_bf16(matrix, row..row + 1, w)
    });
}

pub(crate) fn matmul_f16(
    matrix: &F16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    matmul_rows(matrix.cols(), act, rows, out, |row, w| {
        dequant_f16(matrix, row..row + 1, w)
    });
}

pub(crate) fn matmul_f32(
    matrix: &F32Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    matmul_rows(matrix.cols(), act, rows, out, |row, w| {
        dequant_f32(matrix, row..row + 1, w)
    });
}

/// Decodes each row with `dequant_row` and takes its dot product with every token.
fn matmul_rows(
    cols: usize,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
    dequant_row: impl Fn(usize, &mut [f32]),
) {
    let n_rows = rows.len();
    let mut w = vec![0.0f32; cols];
    for (i, row) in rows.enumerate() {
        dequant_row(row, &mut w);
        for t in 0..act.tokens() {
            out[t * n_rows + i] = dot(&w, act.token(t));
        }
    }
}

fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (a, b) in w.iter().zip(x) {
        acc += a * b;
    }
    acc
}
