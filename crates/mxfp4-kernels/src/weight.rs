//! `WeightMatrix`: a linear layer's weights in any format the kernels decode exactly, and
//! `WeightFormat`, its format's name.

use crate::packed::PackedBf16Matrix;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, Q8_0Matrix};

/// How a matrix's weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightFormat {
    /// Little-endian BF16 ([`Bf16Matrix`]).
    Bf16,
    /// BF16 packed losslessly in 12.25 bits per weight ([`PackedBf16Matrix`]).
    PackedBf16,
    /// Little-endian IEEE binary16 ([`F16Matrix`]).
    F16,
    /// Little-endian f32 ([`F32Matrix`]).
    F32,
    /// E2M1 codes with E8M0 scales per 32 weights ([`MxFp4Matrix`]).
    MxFp4,
    /// ggml's Q8_0: int8 values with an F16 step per 32 weights ([`Q8_0Matrix`]), 8.5 bits
    /// per weight.
    Q8_0,
}

impl WeightFormat {
    /// Every format.
    pub const ALL: [WeightFormat; 6] = [
        WeightFormat::Bf16,
        WeightFormat::PackedBf16,
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::MxFp4,
        WeightFormat::Q8_0,
    ];

    /// The format's name in logs and plans (`bf16-packed`).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::PackedBf16 => "bf16-packed",
            WeightFormat::F16 => "f16",
            WeightFormat::F32 => "f32",
            WeightFormat::MxFp4 => "mxfp4",
            WeightFormat::Q8_0 => "q8_0",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A linear layer's weights in any format the kernels decode exactly: what a model holds for
/// every projection, so the format is chosen per tensor by the checkpoint, not per role by the
/// code. [`crate::Kernels::matmul`] and [`crate::Kernels::dequant`] dispatch on it once per
/// call, outside the kernels' loops.
#[derive(Debug, Clone, Copy)]
pub enum WeightMatrix<'a> {
    /// A BF16 matrix.
    Bf16(Bf16Matrix<'a>),
    /// A packed BF16 matrix.
    PackedBf16(PackedBf16Matrix<'a>),
    /// An F16 matrix.
    F16(F16Matrix<'a>),
    /// An F32 matrix.
    F32(F32Matrix<'a>),
    /// An MXFP4 matrix.
    MxFp4(MxFp4Matrix<'a>),
    /// A Q8_0 matrix.
    Q8_0(Q8_0Matrix<'a>),
}

/// `$body` with `$m` bound to the view inside `$matrix`, whatever its format.
macro_rules! each_format {
    ($matrix:expr, |$m:ident| $body:expr) => {
        match $matrix {
            WeightMatrix::Bf16($m) => $body,
            WeightMatrix::PackedBf16($m) => $body,
            WeightMatrix::F16($m) => $body,
            WeightMatrix::F32($m) => $body,
            WeightMatrix::MxFp4($m) => $body,
            WeightMatrix::Q8_0($m) => $body,
        }
    };
}

impl<'a> WeightMatrix<'a> {
    /// The matrix's format.
    pub fn format(&self) -> WeightFormat {
        match self {
            WeightMatrix::Bf16(_) => WeightFormat::Bf16,
            WeightMatrix::PackedBf16(_) => WeightFormat::PackedBf16,
            WeightMatrix::F16(_) => WeightFormat::F16,
            WeightMatrix::F32(_) => WeightFormat::F32,
            WeightMatrix::MxFp4(_) => WeightFormat::MxFp4,
            WeightMatrix::Q8_0(_) => WeightFormat::Q8_0,
        }
    }
    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        each_format!(self, |m| m.rows())
    }
    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        each_format!(self, |m| m.cols())
    }
    /// Bytes of weights that one pass over `rows` reads.
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        each_format!(self, |m| m.bytes_for_rows(rows))
    }
    /// Bytes of the whole matrix.
    pub fn weight_bytes(&self) -> usize {
        self.bytes_for_rows(self.rows())
    }
    /// The stored bytes a read of row `row` touches: the row (an MXFP4 row's codes, then its
    /// scales; a packed row's body, not its exception blocks, which are few and elsewhere).
    /// For asking the OS to read them in before a lookup (the embedding in `k3-model`).
    ///
    /// # Panics
    /// If `row` is not below [`WeightMatrix::rows`].
    pub fn row_storage(&self, row: usize) -> Vec<&'a [u8]> {
        assert!(row < self.rows(), "row {row} of {} rows", self.rows());
        match self {
            WeightMatrix::Bf16(m) => vec![m.row_bytes(row)],
            WeightMatrix::F16(m) => vec![m.row_bytes(row)],
            WeightMatrix::F32(m) => vec![m.row_bytes(row)],
            WeightMatrix::MxFp4(m) => vec![m.packed_row(row), m.scale_row(row)],
            WeightMatrix::PackedBf16(m) => vec![m.row_body(row)],
            WeightMatrix::Q8_0(m) => vec![m.row_bytes(row)],
        }
    }
}

/// `From` each view for `WeightMatrix`.
macro_rules! from_views {
    ($($variant:ident($view:ident)),*) => {$(
        impl<'a> From<$view<'a>> for WeightMatrix<'a> {
            fn from(m: $view<'a>) -> Self {
                WeightMatrix::$variant(m)
            }
        }
    )*};
}
from_views!(
    Bf16(Bf16Matrix),
    PackedBf16(PackedBf16Matrix),
    F16(F16Matrix),
    F32(F32Matrix),
    MxFp4(MxFp4Matrix),
    Q8_0(Q8_0Matrix)
);
