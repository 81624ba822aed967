//! Validated, borrowed views over weight bytes: `MxFp4Matrix` (compressed-tensors layout) and
//! `Bf16Matrix` (little-endian BF16). Kernels take only these, so they never see a bad shape.

use crate::codes::E8M0_NAN;
use crate::error::{Error, Result};

/// MXFP4 elements per shared E8M0 scale.
pub const GROUP: usize = 32;
/// Packed bytes per group (two E2M1 codes per byte).
pub const GROUP_BYTES: usize = GROUP / 2;

/// A `[rows, cols]` MXFP4 matrix in the compressed-tensors `mxfp4-pack-quantized` layout:
/// `weight_packed` is `[rows, cols/2]` bytes, byte `b` of a row holding column `2b` in its low
/// nibble and column `2b+1` in its high nibble; `weight_scale` is `[rows, cols/32]` E8M0 bytes,
/// scale `g` covering columns `32g..32g+32` of the same row.
#[derive(Debug, Clone, Copy)]
pub struct MxFp4Matrix<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    rows: usize,
    cols: usize,
}

/// A `[rows, cols]` row-major matrix of little-endian BF16 values, borrowed as bytes.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Matrix<'a> {
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
}

impl<'a> MxFp4Matrix<'a> {
    /// Checks shape, lengths and every scale byte (0xFF, NaN, is rejected) and wraps the bytes.
    pub fn new(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        Self::with_name("mxfp4 matrix", packed, scales, rows, cols)
    }

    /// As [`MxFp4Matrix::new`], naming the tensor in errors.
    pub fn with_name(
        what: &'static str,
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if rows == 0 || cols == 0 || rows.checked_mul(cols).is_none() {
            return Err(Error::BadShape { what, rows, cols });
        }
        if !cols.is_multiple_of(GROUP) {
            return Err(Error::ColsNotGroupMultiple { what, cols });
        }
        let check = |buffer, expected: usize, found: usize| {
            if expected == found {
                Ok(())
            } else {
                Err(Error::BufferLength {
                    what,
                    buffer,
                    rows,
                    cols,
                    expected,
                    found,
                })
            }
        };
        check("weight_packed", rows * cols / 2, packed.len())?;
        check("weight_scale", rows * (cols / GROUP), scales.len())?;
        if let Some(pos) = scales.iter().position(|&s| s == E8M0_NAN) {
            let groups = cols / GROUP;
            return Err(Error::NanScale {
                what,
                row: pos / groups,
                group: pos % groups,
            });
        }
        Ok(Self {
            packed,
            scales,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Scale groups per row.
    pub fn groups(&self) -> usize {
        self.cols / GROUP
    }
    /// The whole `weight_packed` buffer.
    pub fn packed(&self) -> &'a [u8] {
        self.packed
    }
    /// The whole `weight_scale` buffer.
    pub fn scales(&self) -> &'a [u8] {
        self.scales
    }
    /// Packed bytes of one row (`cols/2` bytes).
    pub fn packed_row(&self, row: usize) -> &'a [u8] {
        let n = self.cols / 2;
        &self.packed[row * n..(row + 1) * n]
    }
    /// Scale bytes of one row (`cols/32` bytes).
    pub fn scale_row(&self, row: usize) -> &'a [u8] {
        let n = self.groups();
        &self.scales[row * n..(row + 1) * n]
    }
    /// Bytes of weights (packed codes and scales) that one pass over `rows` reads.
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * (self.cols / 2 + self.groups())
    }
    /// Bytes of the whole matrix.
    pub fn weight_bytes(&self) -> usize {
        self.bytes_for_rows(self.rows)
    }
}

impl<'a> Bf16Matrix<'a> {
    /// Checks the shape and the byte length (`rows * cols * 2`) and wraps the bytes.
    pub fn new(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        Self::with_name("bf16 matrix", bytes, rows, cols)
    }

    /// As [`Bf16Matrix::new`], naming the tensor in errors.
    pub fn with_name(
        what: &'static str,
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let Some(expected) = rows.checked_mul(cols).and_then(|n| n.checked_mul(2)) else {
            return Err(Error::BadShape { what, rows, cols });
        };
        if rows == 0 || cols == 0 {
            return Err(Error::BadShape { what, rows, cols });
        }
        if bytes.len() != expected {
            return Err(Error::BufferLength {
                what,
                buffer: "bf16 data",
                rows,
                cols,
                expected,
                found: bytes.len(),
            });
        }
        Ok(Self { bytes, rows, cols })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The whole buffer.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// Bytes of one row (`2 * cols`).
    pub fn row_bytes(&self, row: usize) -> &'a [u8] {
        let n = self.cols * 2;
        &self.bytes[row * n..(row + 1) * n]
    }
    /// Bytes of weights that one pass over `rows` reads.
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * self.cols * 2
    }
    /// Bytes of the whole matrix.
    pub fn weight_bytes(&self) -> usize {
        self.bytes.len()
    }
}
