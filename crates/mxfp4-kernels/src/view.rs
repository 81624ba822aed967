//! Validated, borrowed views over weight bytes: `MxFp4Matrix` (compressed-tensors layout),
//! `Q8_0Matrix` (ggml's Q8_0 blocks), `Bf16Matrix`, `F16Matrix` and `F32Matrix` (little-endian,
//! row-major). Kernels take only these (and `PackedBf16Matrix`, `WeightMatrix`), so they never
//! see a bad shape.

use std::ops::Range;

use crate::codes::{E8M0_NAN, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
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
        let check =
            |buffer, expected, found| check_length(what, buffer, (rows, cols), expected, found);
        check("weight_packed", rows * cols / 2, packed.len())?;
        check("weight_scale", rows * (cols / GROUP), scales.len())?;
        if let Some(pos) = first_nan_scale(scales) {
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

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of the matrix (a multiple of [`GROUP`]).
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

/// A `[rows, cols]` matrix of ggml Q8_0 blocks (`block_q8_0`), row-major: each row is
/// `cols / 32` blocks of [`Q8_0_BLOCK_BYTES`] bytes, a block being its little-endian F16 step
/// `d` then 32 int8 values `q`, and weight `c` of a row is `q[c % 32] · d` of its block
/// `c / 32`. Every such product is exact in f32 (an 8-bit integer times an 11-bit significand,
/// F16 subnormal steps included), so the kernels decode Q8_0 exactly, as they do MXFP4.
///
/// Steps are not checked: an F16 step that is infinite or NaN is kept and decodes exactly to
/// the non-finite weights it means (`q · ∞` is ±∞, `0 · ∞` and `q · NaN` NaN), as a BF16
/// infinity would. A dot product over such a block is non-finite in every tier, though
/// whether it is an infinity or a NaN may differ between tiers (their sum orders differ).
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Matrix<'a> {
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
}

impl<'a> Q8_0Matrix<'a> {
    /// Checks the shape (`cols` a multiple of 32) and the byte length (`rows * cols / 32 * 34`)
    /// and wraps the bytes.
    pub fn new(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        Self::with_name("q8_0 matrix", bytes, rows, cols)
    }

    /// As [`Q8_0Matrix::new`], naming the tensor in errors.
    pub fn with_name(
        what: &'static str,
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let expected = (cols / Q8_0_BLOCK)
            .checked_mul(Q8_0_BLOCK_BYTES)
            .and_then(|row| row.checked_mul(rows));
        let Some(expected) = expected.filter(|_| rows != 0 && cols != 0) else {
            return Err(Error::BadShape { what, rows, cols });
        };
        if !cols.is_multiple_of(Q8_0_BLOCK) {
            return Err(Error::ColsNotQ8_0Multiple { what, cols });
        }
        check_length(what, "q8_0 blocks", (rows, cols), expected, bytes.len())?;
        Ok(Self { bytes, rows, cols })
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of the matrix (a multiple of 32).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Blocks per row (`cols / 32`).
    pub fn blocks(&self) -> usize {
        self.cols / Q8_0_BLOCK
    }
    /// The whole buffer.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// Bytes per row (`cols / 32 * 34`).
    pub fn row_stride(&self) -> usize {
        self.blocks() * Q8_0_BLOCK_BYTES
    }
    /// The blocks of one row (`cols / 32 * 34` bytes).
    pub fn row_bytes(&self, row: usize) -> &'a [u8] {
        let n = self.row_stride();
        &self.bytes[row * n..(row + 1) * n]
    }
    /// Bytes of weights (steps and values) that one pass over `rows` reads.
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * self.row_stride()
    }
    /// Bytes of the whole matrix.
    pub fn weight_bytes(&self) -> usize {
        self.bytes.len()
    }
    /// The matrix of rows `rows` of this one (a non-empty range inside it), borrowing the
    /// same bytes.
    pub fn sub_rows(&self, rows: Range<usize>) -> Result<Self> {
        if rows.start >= rows.end || rows.end > self.rows {
            return Err(Error::RowRange {
                start: rows.start,
                end: rows.end,
                rows: self.rows,
            });
        }
        let n = self.row_stride();
        Ok(Self {
            bytes: &self.bytes[rows.start * n..rows.end * n],
            rows: rows.len(),
            cols: self.cols,
        })
    }
}

/// Defines a `[rows, cols]` row-major matrix of little-endian floats of `$bytes` bytes each,
/// borrowed as bytes (no alignment needed: the kernels load unaligned).
macro_rules! float_matrix {
    ($(#[$doc:meta])* $name:ident, $bytes:literal, $what:literal, $buffer:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name<'a> {
            bytes: &'a [u8],
            rows: usize,
            cols: usize,
        }

        impl<'a> $name<'a> {
            /// Bytes per element.
            pub const ELEMENT_BYTES: usize = $bytes;

            #[doc = concat!("Checks the shape and the byte length (`rows * cols * ", $bytes, "`) and wraps the bytes.")]
            pub fn new(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
                Self::with_name($what, bytes, rows, cols)
            }

            #[doc = concat!("As [`", stringify!($name), "::new`], naming the tensor in errors.")]
            pub fn with_name(
                what: &'static str,
                bytes: &'a [u8],
                rows: usize,
                cols: usize,
            ) -> Result<Self> {
                let Some(expected) = rows.checked_mul(cols).and_then(|n| n.checked_mul($bytes))
                else {
                    return Err(Error::BadShape { what, rows, cols });
                };
                if rows == 0 || cols == 0 {
                    return Err(Error::BadShape { what, rows, cols });
                }
                if bytes.len() != expected {
                    return Err(Error::BufferLength {
                        what,
                        buffer: $buffer,
                        rows,
                        cols,
                        expected,
                        found: bytes.len(),
                    });
                }
                Ok(Self { bytes, rows, cols })
            }

            /// Rows of the matrix.
            pub fn rows(&self) -> usize {
                self.rows
            }
            /// Columns of the matrix.
            pub fn cols(&self) -> usize {
                self.cols
            }
            /// The whole buffer.
            pub fn bytes(&self) -> &'a [u8] {
                self.bytes
            }
            #[doc = concat!("Bytes of one row (`", $bytes, " * cols`).")]
            pub fn row_bytes(&self, row: usize) -> &'a [u8] {
                let n = self.cols * $bytes;
                &self.bytes[row * n..(row + 1) * n]
            }
            /// Bytes of weights that one pass over `rows` reads.
            pub fn bytes_for_rows(&self, rows: usize) -> usize {
                rows * self.cols * $bytes
            }
            /// Bytes of the whole matrix.
            pub fn weight_bytes(&self) -> usize {
                self.bytes.len()
            }
        }
    };
}

float_matrix!(
    /// A `[rows, cols]` row-major matrix of little-endian BF16 values, borrowed as bytes.
    Bf16Matrix,
    2,
    "bf16 matrix",
    "bf16 data"
);

float_matrix!(
    /// A `[rows, cols]` row-major matrix of little-endian IEEE binary16 (F16) values, borrowed
    /// as bytes. Every F16 value, subnormals included, is exact in f32.
    F16Matrix,
    2,
    "f16 matrix",
    "f16 data"
);

float_matrix!(
    /// A `[rows, cols]` row-major matrix of little-endian f32 values, borrowed as bytes.
    F32Matrix,
    4,
    "f32 matrix",
    "f32 data"
);

/// `Ok` where `buffer` of the `[rows, cols]` matrix `what` holds the `expected` bytes, else
/// the error naming both.
pub(crate) fn check_length(
    what: &'static str,
    buffer: &'static str,
    (rows, cols): (usize, usize),
    expected: usize,
    found: usize,
) -> Result<()> {
    if expected == found {
        return Ok(());
    }
    Err(Error::BufferLength {
        what,
        buffer,
        rows,
        cols,
        expected,
        found,
    })
}

/// The position of the first E8M0 NaN byte in `scales`. Every landed expert's scales are
/// checked (about 1 MB per 17.5 MB expert): 64-byte chunks are or-reduced branch-free, which
/// the compiler turns into vector compares (0.033 ms per MiB against 0.83 for
/// `iter().position`, one Zen 3 core), and only a chunk that has one is searched.
fn first_nan_scale(scales: &[u8]) -> Option<usize> {
    const CHUNK: usize = 64;
    let mut chunks = scales.chunks_exact(CHUNK);
    for (i, chunk) in chunks.by_ref().enumerate() {
        if chunk
            .iter()
            .fold(0u8, |any, &s| any | u8::from(s == E8M0_NAN))
            != 0
        {
            return chunk
                .iter()
                .position(|&s| s == E8M0_NAN)
                .map(|p| i * CHUNK + p);
        }
    }
    let tail = chunks.remainder();
    tail.iter()
        .position(|&s| s == E8M0_NAN)
        .map(|p| scales.len() - tail.len() + p)
}
