//! Lossless conversion between the compressed-tensors MXFP4 layout and ggml's `block_mxfp4`.
//!
//! ggml stores 32 elements as `{ e: u8, qs: [u8; 16] }`: `qs[j]` holds element `j` in its low
//! nibble and element `j + 16` in its high nibble. Its code table is doubled
//! (`kvalues_mxfp4 = 2 * E2M1`) and its scale is halved (`2^(e-128)`), so the value of every
//! element — and therefore the E8M0 byte — is the same in both layouts.

use crate::codes::{E2M1_DOUBLED, E8M0_NAN};
use crate::error::{Error, Result};
use crate::view::{GROUP, GROUP_BYTES, MxFp4Matrix};

/// ggml's `block_mxfp4`: one E8M0 scale byte and 16 bytes of codes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockMxfp4 {
    /// The E8M0 scale byte (the same byte as the OCP scale; ggml halves its codes' table).
    pub e: u8,
    /// The 32 codes: `qs[j]` holds element `j` in its low nibble, `j + 16` in its high one.
    pub qs: [u8; 16],
}
/// Bytes of one block on disk.
pub const BLOCK_BYTES: usize = 17;
const _: () = assert!(size_of::<BlockMxfp4>() == BLOCK_BYTES);

impl BlockMxfp4 {
    /// Element `i` (0..32) decoded as ggml does: `kvalues_mxfp4[code] * 2^(e-128)`.
    pub fn value(&self, i: usize) -> f32 {
        let byte = self.qs[i % 16];
        let code = if i < 16 { byte & 0xF } else { byte >> 4 };
        // 2^(e-128) = half of the OCP scale; exact for every e (0 gives 2^-128, a subnormal).
        let half_scale = crate::codes::E8M0_TO_F32[self.e as usize] * 0.5;
        f32::from(E2M1_DOUBLED[code as usize]) * half_scale
    }
}

/// Repacks a matrix into ggml blocks, row-major (`rows * cols/32` blocks).
pub fn to_ggml(matrix: &MxFp4Matrix<'_>) -> Vec<BlockMxfp4> {
    let mut blocks = Vec::with_capacity(matrix.rows() * matrix.groups());
    for row in 0..matrix.rows() {
        let packed = matrix.packed_row(row);
        for (group, &e) in matrix.scale_row(row).iter().enumerate() {
            let src = &packed[group * GROUP_BYTES..(group + 1) * GROUP_BYTES];
            let code = |i: usize| (src[i / 2] >> (4 * (i & 1))) & 0xF;
            let mut qs = [0u8; 16];
            for (j, q) in qs.iter_mut().enumerate() {
                *q = code(j) | (code(j + 16) << 4);
            }
            blocks.push(BlockMxfp4 { e, qs });
        }
    }
    blocks
}

/// Unpacks ggml blocks of a `[rows, cols]` matrix into `(weight_packed, weight_scale)` bytes in
/// the compressed-tensors layout. Rejects a wrong block count and NaN (0xFF) scales.
pub fn from_ggml(blocks: &[BlockMxfp4], rows: usize, cols: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    let what = "ggml mxfp4 blocks";
    if rows == 0 || cols == 0 || rows.checked_mul(cols).is_none() {
        return Err(Error::BadShape { what, rows, cols });
    }
    if !cols.is_multiple_of(GROUP) {
        return Err(Error::ColsNotGroupMultiple { what, cols });
    }
    let groups = cols / GROUP;
    if blocks.len() != rows * groups {
        return Err(Error::BufferLength {
            what,
            buffer: "blocks (17 bytes each)",
            rows,
            cols,
            expected: rows * groups * BLOCK_BYTES,
            found: size_of_val(blocks),
        });
    }
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * groups];
    for (index, block) in blocks.iter().enumerate() {
        if block.e == E8M0_NAN {
            return Err(Error::NanScale {
                what,
                row: index / groups,
                group: index % groups,
            });
        }
        scales[index] = block.e;
        let code = |i: usize| {
            let byte = block.qs[i % 16];
            if i < 16 { byte & 0xF } else { byte >> 4 }
        };
        let dst = &mut packed[index * GROUP_BYTES..(index + 1) * GROUP_BYTES];
        for (b, d) in dst.iter_mut().enumerate() {
            *d = code(2 * b) | (code(2 * b + 1) << 4);
        }
    }
    Ok((packed, scales))
}
