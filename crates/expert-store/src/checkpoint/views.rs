//! Typed, validated views of a checkpoint's tensors: float and MXFP4 matrices, linear weights
//! in whatever format the header says, float vectors widened to f32.

use mxfp4_kernels::codes::f16_to_f32;
use mxfp4_kernels::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, WeightMatrix};

use safetensors::Dtype;

use super::error::{CheckpointError, Result};
use super::open::Checkpoint;
use super::storage::TensorRef;

/// The formats a linear weight may be stored in, as error messages name them.
pub const LINEAR_FORMATS: &str = "BF16, F16 or F32 (or MXFP4 weight_packed + weight_scale)";

/// The formats a float vector (norm, bias, conv taps, `A_log`) may be stored in.
pub const VECTOR_FORMATS: &str = "F32, BF16 or F16";

/// How a linear weight is stored ([`Checkpoint::linear_format`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinearStorage {
    /// `name` itself, of this dtype (BF16, F16 or F32).
    Float(Dtype),
    /// `{base}.weight_packed` + `{base}.weight_scale`, MXFP4.
    MxFp4(String),
}

impl Checkpoint {
    /// A BF16 matrix `[rows, cols]`.
    pub fn bf16_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Bf16Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::BF16, &[rows, cols])?;
        Bf16Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// An F16 matrix `[rows, cols]`.
    pub fn f16_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<F16Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::F16, &[rows, cols])?;
        F16Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// An F32 matrix `[rows, cols]`.
    pub fn f32_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<F32Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::F32, &[rows, cols])?;
        F32Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// A linear layer's weight `[rows, cols]` in whatever format the checkpoint stores it:
    /// `name` (`....weight`) as BF16, F16 or F32, or, where `name` is absent, MXFP4 as
    /// `{base}.weight_packed` + `{base}.weight_scale` (compressed-tensors, as the routed
    /// experts; `base` is `name` without `.weight`). Errors name the tensor, the formats
    /// accepted and what was found.
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix<'_>> {
        match self.linear_format(name)? {
            LinearStorage::Float(Dtype::BF16) => self.bf16_matrix(name, rows, cols).map(Into::into),
            LinearStorage::Float(Dtype::F16) => self.f16_matrix(name, rows, cols).map(Into::into),
            LinearStorage::Float(_) => self.f32_matrix(name, rows, cols).map(Into::into),
            LinearStorage::MxFp4(base) => self.mxfp4_matrix(&base, rows, cols).map(Into::into),
        }
    }

    /// How the linear weight `name` is stored (see [`Checkpoint::linear`]), checking the dtype
    /// but not the shape.
    pub fn linear_format(&self, name: &str) -> Result<LinearStorage> {
        if let Some(t) = self.tensor(name) {
            return match t.dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(LinearStorage::Float(t.dtype)),
                found => Err(CheckpointError::Mismatch {
                    path: t.path.to_owned(),
                    tensor: t.name.to_owned(),
                    expected: format!("{LINEAR_FORMATS} {:?}", t.shape),
                    found: format!("{found:?} {:?}", t.shape),
                }),
            };
        }
        match name.strip_suffix(".weight") {
            Some(base) if self.tensor(&format!("{base}.weight_packed")).is_some() => {
                Ok(LinearStorage::MxFp4(base.to_owned()))
            }
            Some(base) => Err(CheckpointError::Missing {
                tensor: format!(
                    "{p}{name} (or MXFP4 {p}{base}.weight_packed + weight_scale)",
                    p = self.prefix
                ),
            }),
            None => Err(CheckpointError::Missing {
                tensor: format!("{}{name}", self.prefix),
            }),
        }
    }

    /// A floating-point tensor of `shape` as f32, copied out (the mapping gives no alignment
    /// guarantee). The dtype is the header's: F32 as is, BF16 and F16 widened (exactly).
    pub fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.require(name)?;
        let dtype = t.dtype;
        if !matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) || t.shape != shape {
            return Err(CheckpointError::Mismatch {
                path: t.path.to_owned(),
                tensor: t.name.to_owned(),
                expected: format!("{VECTOR_FORMATS} {shape:?}"),
                found: format!("{dtype:?} {:?}", t.shape),
            });
        }
        let halves = || {
            t.bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        };
        Ok(match dtype {
            Dtype::BF16 => halves()
                .map(|h| f32::from_bits(u32::from(h) << 16))
                .collect(),
            Dtype::F16 => halves().map(f16_to_f32).collect(),
            _ => t
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }

    /// An MXFP4 matrix `[rows, cols]` from `{base}.weight_packed` and `{base}.weight_scale`
    /// (compressed-tensors' names; see [`Checkpoint::mxfp4_tensors`]).
    pub fn mxfp4_matrix(&self, base: &str, rows: usize, cols: usize) -> Result<MxFp4Matrix<'_>> {
        self.mxfp4_tensors(
            &format!("{base}.weight_packed"),
            &format!("{base}.weight_scale"),
            rows,
            cols,
        )
    }

    /// An MXFP4 matrix `[rows, cols]` from its packed codes `codes` (U8 `[rows, cols/2]`) and
    /// its E8M0 scales `scales` (U8 `[rows, cols/32]`); every scale byte is checked (0xFF is
    /// NaN).
    pub fn mxfp4_tensors(
        &self,
        codes: &str,
        scales: &str,
        rows: usize,
        cols: usize,
    ) -> Result<MxFp4Matrix<'_>> {
        let packed = self.require(codes)?;
        let scales = self.require(scales)?;
        expect(&packed, Dtype::U8, &[rows, cols / 2])?;
        expect(&scales, Dtype::U8, &[rows, cols / 32])?;
        MxFp4Matrix::new(packed.bytes, scales.bytes, rows, cols)
            .map_err(|source| view_error(&scales, source))
    }
}

fn expect(t: &TensorRef<'_>, dtype: Dtype, shape: &[usize]) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(CheckpointError::Mismatch {
            path: t.path.to_owned(),
            tensor: t.name.to_owned(),
            expected: format!("{dtype:?} {shape:?}"),
            found: format!("{:?} {:?}", t.dtype, t.shape),
        });
    }
    Ok(())
}

fn view_error(t: &TensorRef<'_>, source: mxfp4_kernels::Error) -> CheckpointError {
    CheckpointError::View {
        path: t.path.to_owned(),
        tensor: t.name.to_owned(),
        source,
    }
}
