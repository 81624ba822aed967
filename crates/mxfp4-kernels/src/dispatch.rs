//! The kernel methods of `Kernels`: each checks the shapes once, then calls its tier's kernel
//! once per call (`per_tier!`); nothing is dispatched inside a kernel's loops.

use std::ops::Range;

use crate::activations::Activations;
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::kernels::TierToken;
use crate::kernels::{Kernels, per_tier};
use crate::packed::PackedBf16Matrix;
use crate::scalar;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, Q8_0Matrix};
use crate::weight::WeightMatrix;
#[cfg(target_arch = "x86_64")]
use crate::x86;

/// The most tokens an AVX-512 packed GEMM decodes in registers (groups of up to 6 in `avx512`,
/// 8 in the approximate tiers); more run through `packed_via_bf16`, which decodes each row
/// once. k3-wide slice, Zen 4, 2 threads, passes of n tokens with both paths (PERFORMANCE.md,
/// phase 30): n = 9 543 ms against 704, 12 734 against 831, 14 890 against 925, 15 1002
/// against 974, 16 1121 against 1031 (9-12 tokens split into the same two groups with at most
/// 6 a group as with 8).
#[cfg(target_arch = "x86_64")]
const PACKED_IN_REGISTERS: usize = 12;

impl Kernels {
    /// Dequantizes `rows` of `matrix` into `out` (`rows.len() * cols` f32, row-major).
    /// Every tier is bit-identical to scalar.
    pub fn dequant_mxfp4(
        &self,
        matrix: &MxFp4Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        per_tier!(self, (matrix, rows, out) {
            scalar: scalar::dequant_mxfp4,
            avx2: x86::avx2::mxfp4::dequant_mxfp4,
            avx512: x86::exact::dequant_mxfp4,
            avx512_bf16: x86::exact::dequant_mxfp4,
            avx512_vnni: x86::exact::dequant_mxfp4,
        });
        Ok(())
    }

    /// Decodes `rows` of a Q8_0 matrix to f32: each weight `q · d`, exact in f32, so every
    /// tier is bit-identical to scalar.
    pub fn dequant_q8_0(
        &self,
        matrix: &Q8_0Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        per_tier!(self, (matrix, rows, out) {
            scalar: scalar::dequant_q8_0,
            avx2: x86::avx2::q8_0::dequant_q8_0,
            avx512: x86::q8_0::dequant_q8_0,
            avx512_bf16: x86::q8_0::dequant_q8_0,
            avx512_vnni: x86::q8_0::dequant_q8_0,
        });
        Ok(())
    }

    /// Widens `rows` of a BF16 matrix to f32 (exact in every tier).
    pub fn dequant_bf16(
        &self,
        matrix: &Bf16Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        scalar::dequant_bf16(matrix, rows, out);
        Ok(())
    }

    /// Decodes `rows` of a packed BF16 matrix to f32: the BF16 values it packs, widened
    /// (exact in every tier).
    pub fn dequant_packed_bf16(
        &self,
        matrix: &PackedBf16Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        let mut values = vec![0u16; matrix.cols()];
        for (row, dst) in rows.zip(out.chunks_exact_mut(matrix.cols())) {
            matrix.decode_row(row, &mut values);
            for (d, &v) in dst.iter_mut().zip(&values) {
                *d = f32::from_bits(u32::from(v) << 16);
            }
        }
        Ok(())
    }

    /// Widens `rows` of an F16 matrix to f32 (exact in every tier).
    pub fn dequant_f16(
        &self,
        matrix: &F16Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        scalar::dequant_f16(matrix, rows, out);
        Ok(())
    }

    /// Copies `rows` of an F32 matrix out as f32.
    pub fn dequant_f32(
        &self,
        matrix: &F32Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_dequant(matrix.rows(), matrix.cols(), &rows, out)?;
        scalar::dequant_f32(matrix, rows, out);
        Ok(())
    }

    /// Decodes `rows` of a matrix of any format to f32 (`rows.len() * cols`, row-major),
    /// bit-identical in every tier.
    pub fn dequant(
        &self,
        matrix: &WeightMatrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        match matrix {
            WeightMatrix::Bf16(m) => self.dequant_bf16(m, rows, out),
            WeightMatrix::PackedBf16(m) => self.dequant_packed_bf16(m, rows, out),
            WeightMatrix::F16(m) => self.dequant_f16(m, rows, out),
            WeightMatrix::F32(m) => self.dequant_f32(m, rows, out),
            WeightMatrix::MxFp4(m) => self.dequant_mxfp4(m, rows, out),
            WeightMatrix::Q8_0(m) => self.dequant_q8_0(m, rows, out),
        }
    }

    /// Prepares `tokens = x.len() / cols` activation vectors (1..=64, token-major) for this
    /// tier. Prepare once, then run any number of row ranges against it.
    pub fn prepare(&self, x: &[f32], cols: usize) -> Result<Activations> {
        Activations::new(self, x, cols)
    }

    /// `out[t * rows.len() + (r - rows.start)] = Σ_c W[r, c] · x_t[c]` for every prepared token
    /// `t`: a GEMV for one token, a small GEMM for several that decodes each weight group once.
    /// Batch-invariant: the row of token `t` is bit-identical to a one-token call with `x_t`.
    pub fn matmul_mxfp4(
        &self,
        matrix: &MxFp4Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        per_tier!(self, (matrix, act, rows, out) {
            scalar: scalar::matmul_mxfp4,
            avx2: x86::entry::avx2::<_, x86::avx2::mxfp4::Mxfp4>,
            avx512: x86::entry::avx512::<_, x86::exact::Mxfp4>,
            avx512_bf16: x86::entry::avx512_bf16::<_, x86::bf16::Mxfp4>,
            avx512_vnni: x86::entry::avx512_vnni::<_, x86::vnni::Mxfp4>,
        });
        Ok(())
    }

    /// As [`Kernels::matmul_mxfp4`], for a Q8_0 matrix: activations stay f32 in every tier (no
    /// activation rounding). Scalar decodes each weight exactly (`q · d`) and sums in order;
    /// `avx2` and `avx512` sum each block's `q · x` products, then apply its step `d` with one
    /// FMA (a fixed order both share, so they give the same bits, within `dot_bound` of
    /// scalar); the approximate tiers run the `avx512` kernel.
    pub fn matmul_q8_0(
        &self,
        matrix: &Q8_0Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        per_tier!(self, (matrix, act, rows, out) {
            scalar: scalar::matmul_q8_0,
            avx2: x86::entry::avx2::<_, x86::avx2::q8_0::Q8_0>,
            avx512: x86::entry::avx512::<_, x86::q8_0::Q8_0>,
            avx512_bf16: x86::entry::avx512_bf16::<_, x86::q8_0::Q8_0>,
            avx512_vnni: x86::entry::avx512_vnni::<_, x86::q8_0::Q8_0>,
        });
        Ok(())
    }

    /// As [`Kernels::matmul_mxfp4`], for a BF16 matrix. The `avx512-vnni` tier runs the
    /// `avx512-bf16` kernel (int8 cannot hold BF16 weights).
    pub fn matmul_bf16(
        &self,
        matrix: &Bf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        per_tier!(self, (matrix, act, rows, out) {
            scalar: scalar::matmul_bf16,
            avx2: x86::entry::avx2::<_, x86::avx2::float::Float>,
            avx512: x86::entry::avx512::<_, x86::exact::Bf16>,
            avx512_bf16: x86::entry::avx512_bf16::<_, x86::bf16::Bf16>,
            avx512_vnni: x86::entry::avx512_vnni::<_, x86::bf16::Bf16>,
        });
        Ok(())
    }

    /// As [`Kernels::matmul_bf16`] on the BF16 matrix that `matrix` packs, with its bits in
    /// every tier. `avx2` and `avx512` decode each block in registers and run their BF16
    /// kernel's FMAs on it, the approximate tiers their `vdpbf16ps`; `scalar`, and GEMMs of
    /// more than `PACKED_IN_REGISTERS` tokens, decode a few rows at a time into an L2-sized
    /// buffer and run the tier's BF16 kernel over it (no row's result depends on how rows are
    /// blocked).
    pub fn matmul_packed_bf16(
        &self,
        matrix: &PackedBf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        match self.token() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx2/fma/f16c, the kernel's features.
            TierToken::Avx2(token) => unsafe {
                x86::entry::avx2::<_, x86::avx2::packed::Packed>(token, matrix, act, rows, out)
            },
            // A GEMV or a GEMM of up to `PACKED_IN_REGISTERS` tokens (a verify pass, a few
            // sequences' step) decodes in registers, in groups of at most 6 tokens (exact) or 8
            // (`vdpbf16ps`); more tokens would decode every block once per group, so their rows
            // are decoded once into a buffer and run through the BF16 GEMM (`packed_via_bf16`).
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; `check_matmul` proved the shapes.
            TierToken::Avx512(token) if act.tokens() <= PACKED_IN_REGISTERS => unsafe {
                x86::packed::matmul_packed_bf16(token, matrix, act, rows, out)
            },
            // The approximate tiers likewise, with their BF16 kernel's `vdpbf16ps`.
            #[cfg(target_arch = "x86_64")]
            TierToken::Avx512Bf16(token) | TierToken::Avx512Vnni(token)
                if act.tokens() <= PACKED_IN_REGISTERS =>
            {
                // SAFETY: the tokens prove avx512f/bw/vl and avx512bf16; `check_matmul` proved
                // the shapes, and this tier prepared `act` (its BF16 activations).
                unsafe { x86::packed::matmul_packed_bf16_dot(token, matrix, act, rows, out) }
            }
            _ => self.packed_via_bf16(matrix, act, rows, out)?,
        }
        Ok(())
    }

    /// `matmul_packed_bf16` for `scalar`, and the AVX-512 tiers' GEMMs of more than
    /// `PACKED_IN_REGISTERS` tokens: rows decoded into a buffer of about 512 KiB (in L2;
    /// whole 16-row blocks), that buffer's rows through the tier's BF16 kernel, each token's
    /// results put at their place; decoded with `vpermb` where the CPU has avx512vbmi.
    /// k3-wide, a 64-token prefill with the trunk packed (0.9x plan), 2 threads, alternating
    /// with the mapped BF16 trunk: 64 KiB buffers 20.6-20.8 tokens/s against 23.4-30.7 (each
    /// 4-row buffer streams every token's activations), 512 KiB 25.7-27.4 against 23.4-27.5.
    /// On Zen 4 (PERFORMANCE.md, phase 30) the 16-row blocks took the dense MLP's bucket from
    /// 9.0-9.4 to 8.0 ms per token (7.7 with the stored trunk).
    fn packed_via_bf16(
        &self,
        matrix: &PackedBf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let (n, tokens, cols) = (rows.len(), act.tokens(), matrix.cols());
        // Whole 16-row blocks (the BF16 GEMM's row block is 4): 14 rows of 18,432 columns left
        // 2 rows to single-row tiles in every chunk.
        let chunk = ((512 << 10) / (2 * cols)).max(1).div_ceil(16) * 16;
        let mut bytes = vec![0u8; chunk * cols * 2];
        let mut sums = vec![0f32; chunk * tokens];
        let mut start = rows.start;
        while start < rows.end {
            let end = (start + chunk).min(rows.end);
            let k = end - start;
            let decoded = &mut bytes[..k * cols * 2];
            match self.token() {
                // The AVX-512 tiers' CPUs have avx512f/bw/vl (the tokens prove it).
                #[cfg(target_arch = "x86_64")]
                TierToken::Avx512(_) | TierToken::Avx512Bf16(_) | TierToken::Avx512Vnni(_)
                    if x86::packed::has_vbmi() =>
                {
                    // SAFETY: the token proves avx512f/bw/vl, and avx512vbmi was detected.
                    unsafe { x86::packed::decode_rows_bf16_vbmi(matrix, start..end, decoded) }
                }
                // Every x86 tier's CPU has avx2, fma and f16c (AVX-512F implies them).
                #[cfg(target_arch = "x86_64")]
                TierToken::Avx2(_)
                | TierToken::Avx512(_)
                | TierToken::Avx512Bf16(_)
                | TierToken::Avx512Vnni(_) => {
                    // SAFETY: the token proves avx2, fma and f16c (AVX-512F implies them).
                    unsafe { x86::avx2::packed::decode_rows_bf16(matrix, start..end, decoded) }
                }
                _ => matrix.decode_rows_bf16(start..end, decoded),
            }
            let view = Bf16Matrix::new(&bytes[..k * cols * 2], k, cols)?;
            self.matmul_bf16(&view, act, 0..k, &mut sums[..k * tokens])?;
            for t in 0..tokens {
                out[t * n + start - rows.start..][..k].copy_from_slice(&sums[t * k..(t + 1) * k]);
            }
            start = end;
        }
        Ok(())
    }

    /// As [`Kernels::matmul_mxfp4`], for an F16 matrix. Exact tiers: F16 widened exactly
    /// (`vcvtph2ps`), the BF16 kernel's summation order. Approximate tiers: activations rounded
    /// to BF16 as for BF16 matrices, weights exact, f32 FMA.
    pub fn matmul_f16(
        &self,
        matrix: &F16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        per_tier!(self, (matrix, act, rows, out) {
            scalar: scalar::matmul_f16,
            avx2: x86::entry::avx2::<_, x86::avx2::float::Float>,
            avx512: x86::entry::avx512::<_, x86::float::Float<false>>,
            avx512_bf16: x86::entry::avx512_bf16::<_, x86::float::Float<true>>,
            avx512_vnni: x86::entry::avx512_vnni::<_, x86::float::Float<true>>,
        });
        Ok(())
    }

    /// As [`Kernels::matmul_mxfp4`], for an F32 matrix. In the exact tiers a matrix of BF16
    /// values widened to F32 gives the same bits as the BF16 matrix (same products, same
    /// order). Approximate tiers: activations rounded to BF16, weights exact, f32 FMA.
    pub fn matmul_f32(
        &self,
        matrix: &F32Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        per_tier!(self, (matrix, act, rows, out) {
            scalar: scalar::matmul_f32,
            avx2: x86::entry::avx2::<_, x86::avx2::float::Float>,
            avx512: x86::entry::avx512::<_, x86::float::Float<false>>,
            avx512_bf16: x86::entry::avx512_bf16::<_, x86::float::Float<true>>,
            avx512_vnni: x86::entry::avx512_vnni::<_, x86::float::Float<true>>,
        });
        Ok(())
    }

    /// `matrix · x_t` for a matrix of any format: one dispatch on the format per call, then
    /// that format's kernel (see [`Kernels::matmul_mxfp4`]).
    pub fn matmul(
        &self,
        matrix: &WeightMatrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        match matrix {
            WeightMatrix::Bf16(m) => self.matmul_bf16(m, act, rows, out),
            WeightMatrix::PackedBf16(m) => self.matmul_packed_bf16(m, act, rows, out),
            WeightMatrix::F16(m) => self.matmul_f16(m, act, rows, out),
            WeightMatrix::F32(m) => self.matmul_f32(m, act, rows, out),
            WeightMatrix::MxFp4(m) => self.matmul_mxfp4(m, act, rows, out),
            WeightMatrix::Q8_0(m) => self.matmul_q8_0(m, act, rows, out),
        }
    }

    /// `act` was prepared by these kernels for the matrix's width, `rows` lie in the matrix
    /// and `out` holds them for every token.
    fn check_matmul(
        &self,
        matrix_rows: usize,
        matrix_cols: usize,
        act: &Activations,
        rows: &Range<usize>,
        out: &[f32],
    ) -> Result<()> {
        if act.tier() != self.tier() {
            return Err(Error::TierMismatch {
                prepared: act.tier(),
                kernels: self.tier(),
            });
        }
        if act.cols() != matrix_cols {
            return Err(Error::ActivationCols {
                expected: matrix_cols,
                found: act.cols(),
            });
        }
        check_rows(rows, matrix_rows)?;
        check_out(rows.len() * act.tokens(), out.len())
    }
}

/// `rows` lie in a matrix of `matrix_rows` rows and `out` holds them (`cols` f32 each).
fn check_dequant(matrix_rows: usize, cols: usize, rows: &Range<usize>, out: &[f32]) -> Result<()> {
    check_rows(rows, matrix_rows)?;
    check_out(rows.len() * cols, out.len())
}

fn check_rows(rows: &Range<usize>, n_rows: usize) -> Result<()> {
    if rows.start > rows.end || rows.end > n_rows {
        return Err(Error::RowRange {
            start: rows.start,
            end: rows.end,
            rows: n_rows,
        });
    }
    Ok(())
}

fn check_out(expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(Error::OutputLength { expected, found });
    }
    Ok(())
}
