//! `WeightMatrix`: a linear layer's weights in any format the kernels decode exactly, and
//! `WeightFormat`, its format's name.

use crate::packed::PackedBf16Matrix;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix};

/// How a matrix's weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightFormat {
    Bf16,
    /// BF16 packed losslessly in 12.25 bits per weight (`crate::packed`).
    PackedBf16,
    F16,
    F32,
    MxFp4,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 5] = [
        WeightFormat::Bf16,
        WeightFormat::PackedBf16,
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::MxFp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::PackedBf16 => "bf16-packed",
            WeightFormat::F16 => "f16",
            WeightFormat::F32 => "f32",
            WeightFormat::MxFp4 => "mxfp4",
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
    Bf16(Bf16Matrix<'a>),
    PackedBf16(PackedBf16Matrix<'a>),
    F16(F16Matrix<'a>),
    F32(F32Matrix<'a>),
    MxFp4(MxFp4Matrix<'a>),
}

impl<'a> WeightMatrix<'a> {
    pub fn format(&self) -> WeightFormat {
        match self {
            WeightMatrix::Bf16(_) => WeightFormat::Bf16,
            WeightMatrix::PackedBf16(_) => WeightFormat::PackedBf16,
            WeightMatrix::F16(_) => WeightFormat::F16,
            WeightMatrix::F32(_) => WeightFormat::F32,
            WeightMatrix::MxFp4(_) => WeightFormat::MxFp4,
        }
    }
    pub fn rows(&self) -> usize {
        match self {
            WeightMatrix::Bf16(m) => m.rows(),
            WeightMatrix::PackedBf16(m) => m.rows(),
            WeightMatrix::F16(m) => m.rows(),
            WeightMatrix::F32(m) => m.rows(),
            WeightMatrix::MxFp4(m) => m.rows(),
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            WeightMatrix::Bf16(m) => m.cols(),
            WeightMatrix::PackedBf16(m) => m.cols(),
            WeightMatrix::F16(m) => m.cols(),
            WeightMatrix::F32(m) => m.cols(),
            WeightMatrix::MxFp4(m) => m.cols(),
        }
    }
    /// Bytes of weights that one pass over `rows` reads.
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        match self {
            WeightMatrix::Bf16(m) => m.bytes_for_rows(rows),
            WeightMatrix::PackedBf16(m) => m.bytes_for_rows(rows),
            WeightMatrix::F16(m) => m.bytes_for_rows(rows),
            WeightMatrix::F32(m) => m.bytes_for_rows(rows),
            WeightMatrix::MxFp4(m) => m.bytes_for_rows(rows),
        }
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
        }
    }
}

impl<'a> From<Bf16Matrix<'a>> for WeightMatrix<'a> {
    fn from(m: Bf16Matrix<'a>) -> Self {
        WeightMatrix::Bf16(m)
    }
}
impl<'a> From<PackedBf16Matrix<'a>> for WeightMatrix<'a> {
    fn from(m: PackedBf16Matrix<'a>) -> Self {
        WeightMatrix::PackedBf16(m)
    }
}
impl<'a> From<F16Matrix<'a>> for WeightMatrix<'a> {
    fn from(m: F16Matrix<'a>) -> Self {
        WeightMatrix::F16(m)
    }
}
impl<'a> From<F32Matrix<'a>> for WeightMatrix<'a> {
    fn from(m: F32Matrix<'a>) -> Self {
        WeightMatrix::F32(m)
    }
}
impl<'a> From<MxFp4Matrix<'a>> for WeightMatrix<'a> {
    fn from(m: MxFp4Matrix<'a>) -> Self {
        WeightMatrix::MxFp4(m)
    }
}
