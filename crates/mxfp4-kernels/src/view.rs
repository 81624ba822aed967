//! Validated, borrowed views over weight bytes: `MxFp4Matrix` (compressed-tensors layout),
//! `Bf16Matrix`, `F16Matrix` and `F32Matrix` (little-endian, row-major). Kernels take only
//! these (and `PackedBf16Matrix`, `WeightMatrix`), so they never see a bad shape.

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
