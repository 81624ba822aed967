//! Kernel tiers and the capability token (`Kernels`) that dispatches to them.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::activations::Activations;
use crate::error::{Error, Result};
pub(crate) use crate::isa::{Avx2, Avx512};
use crate::packed::PackedBf16Matrix;
use crate::scalar;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, WeightMatrix};

/// A family of kernels. Exact tiers decode weights exactly to f32 and use f32 arithmetic; they
/// differ from `Scalar` only by summation order (and `Avx2` runs `Avx512`'s order, so the two
/// give the same bits). Approximate tiers round the activations. F16 and F32 matrices run f32
/// FMAs in every SIMD tier: on f32 activations in the exact tiers, on the BF16-rounded
/// activations in the approximate tiers (`vdpbf16ps` and int8 cannot hold their weights exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Plain Rust, sequential sums: the oracle every other tier is tested against.
    Scalar,
    /// As `Avx512` on 256-bit vectors (avx2, fma, f16c): each 16-lane accumulator kept as two
    /// halves, the same FMA chains and horizontal tree, so the same bits as `Avx512`. The
    /// default where the CPU has no AVX-512.
    Avx2,
    /// Exact activations: weights decoded exactly to f32, f32 FMA (the default where available).
    Avx512,
    /// Activations rounded to BF16, `vdpbf16ps`; E2M1 and BF16 weights are exact in BF16.
    Avx512Bf16,
    /// MXFP4: activations quantised to int8 per 32-group, E2M1 as doubled int8, `vpdpbusd`.
    /// BF16 matrices use the `Avx512Bf16` path (int8 cannot hold BF16 weights).
    Avx512Vnni,
}

impl Tier {
    pub const ALL: [Tier; 5] = [
        Tier::Scalar,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Bf16,
        Tier::Avx512Vnni,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Bf16 => "avx512-bf16",
            Tier::Avx512Vnni => "avx512-vnni",
        }
    }

    /// True for tiers whose activations stay f32 (results differ from scalar by order only).
    pub fn is_exact(self) -> bool {
        matches!(self, Tier::Scalar | Tier::Avx2 | Tier::Avx512)
    }

    /// The first CPU feature this tier needs that this CPU lacks, if any.
    fn missing_feature(self) -> Option<&'static str> {
        if self == Tier::Scalar {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        if self == Tier::Avx2 {
            return Avx2::missing_feature();
        }
        #[cfg(target_arch = "x86_64")]
        {
            let mut needed: Vec<(&'static str, bool)> = vec![
                ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
                ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
                ("avx512vl", std::arch::is_x86_feature_detected!("avx512vl")),
            ];
            if self == Tier::Avx512Bf16 || self == Tier::Avx512Vnni {
                needed.push((
                    "avx512bf16",
                    std::arch::is_x86_feature_detected!("avx512bf16"),
                ));
            }
            if self == Tier::Avx512Vnni {
                needed.push((
                    "avx512vnni",
                    std::arch::is_x86_feature_detected!("avx512vnni"),
                ));
                needed.push((
                    "avx512vbmi",
                    std::arch::is_x86_feature_detected!("avx512vbmi"),
                ));
            }
            needed
                .into_iter()
                .find(|(_, present)| !present)
                .map(|(name, _)| name)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Some("x86_64")
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::UnknownTier(s.to_owned()))
    }
}

/// The instruction set a `Kernels` value has proved present, as the token its tier's entry
/// points take: `Avx512` for the three AVX-512 tiers, `Avx2` for the avx2 tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    Avx2(Avx2),
    Avx512(Avx512),
}

/// A capability token: holding one proves the CPU supports its tier, so the dispatch below may
/// call that tier's `#[target_feature]` entry points. Cheap to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    tier: Tier,
    /// The token of `tier`'s instruction set (`Portable` exactly for `Scalar`).
    isa: Isa,
}

impl Kernels {
    /// Kernels of the given tier, or `TierUnavailable` naming the missing CPU feature.
    pub fn new(tier: Tier) -> Result<Self> {
        if let Some(missing) = tier.missing_feature() {
            return Err(Error::TierUnavailable { tier, missing });
        }
        // `missing_feature` found what each token detects; the fallbacks only name it.
        let isa = match tier {
            Tier::Scalar => Isa::Portable,
            Tier::Avx2 => Isa::Avx2(Avx2::try_new().ok_or(Error::TierUnavailable {
                tier,
                missing: "avx2",
            })?),
            Tier::Avx512 | Tier::Avx512Bf16 | Tier::Avx512Vnni => {
                Isa::Avx512(Avx512::try_new().ok_or(Error::TierUnavailable {
                    tier,
                    missing: "avx512f",
                })?)
            }
        };
        Ok(Self { tier, isa })
    }

    /// The scalar oracle (always available).
    pub fn scalar() -> Self {
        Self {
            tier: Tier::Scalar,
            isa: Isa::Portable,
        }
    }

    /// The default: the exact `avx512` tier where the CPU has it, else the exact `avx2` tier
    /// (same bits), else `scalar`. Never an approximate tier: those are chosen explicitly.
    pub fn detect() -> Self {
        Self::new(Tier::Avx512)
            .or_else(|_| Self::new(Tier::Avx2))
            .unwrap_or_else(|_| Self::scalar())
    }

    /// Every tier this CPU can run.
    pub fn available() -> Vec<Kernels> {
        Tier::ALL
            .into_iter()
            .filter_map(|t| Self::new(t).ok())
            .collect()
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Whether packed BF16 matrices multiply at about the memory's rate in this tier, so
    /// that reading 0.77x the bytes makes a GEMV faster than on the BF16 it packs: `avx512`
    /// (k3-wide's packed trunk decodes 1.6x faster than its mapped BF16 on Zen 5). Not
    /// `avx2`: its 15 decode operations per block ran at 0.65-0.8x the BF16 GEMV's weights
    /// per second on Zen 3, no faster per token; nor the tiers that decode into a buffer.
    pub fn packed_at_memory_rate(&self) -> bool {
        self.tier == Tier::Avx512
    }

    /// The AVX-512 token of an AVX-512 tier (`None` for `scalar` and `avx2`).
    pub(crate) fn avx512(&self) -> Option<Avx512> {
        match self.isa {
            Isa::Avx512(token) => Some(token),
            _ => None,
        }
    }

    /// The AVX2 token of the `avx2` tier (`None` for every other tier).
    pub(crate) fn avx2(&self) -> Option<Avx2> {
        match self.isa {
            Isa::Avx2(token) => Some(token),
            _ => None,
        }
    }

    /// Dequantizes `rows` of `matrix` into `out` (`rows.len() * cols` f32, row-major).
    /// Every tier is bit-identical to scalar.
    pub fn dequant_mxfp4(
        &self,
        matrix: &MxFp4Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_rows(&rows, matrix.rows())?;
        check_out(rows.len() * matrix.cols(), out.len())?;
        match self.isa {
            Isa::Portable => scalar::dequant_mxfp4(matrix, rows, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx2/fma/f16c were detected on this CPU.
            Isa::Avx2(token) => unsafe {
                crate::x86::avx2::dequant_mxfp4(token, matrix, rows, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl were detected on this CPU.
            Isa::Avx512(token) => unsafe {
                crate::x86::exact::dequant_mxfp4(token, matrix, rows, out)
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no SIMD token exists off x86_64"),
        }
        Ok(())
    }

    /// Widens `rows` of a BF16 matrix to f32 (exact in every tier).
    pub fn dequant_bf16(
        &self,
        matrix: &Bf16Matrix<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_rows(&rows, matrix.rows())?;
        check_out(rows.len() * matrix.cols(), out.len())?;
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
        check_rows(&rows, matrix.rows())?;
        check_out(rows.len() * matrix.cols(), out.len())?;
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
        check_rows(&rows, matrix.rows())?;
        check_out(rows.len() * matrix.cols(), out.len())?;
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
        check_rows(&rows, matrix.rows())?;
        check_out(rows.len() * matrix.cols(), out.len())?;
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
        }
    }

    /// Prepares `tokens = x.len() / cols` activation vectors (1..=16, token-major) for this
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
        match self.tier {
            Tier::Scalar => scalar::matmul_mxfp4(matrix, act, rows, out),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                let token = self.avx2().expect("an avx2 Kernels holds its token");
                // SAFETY: the token proves avx2/fma/f16c; `check_matmul` proved the shapes.
                unsafe { crate::x86::avx2::matmul_mxfp4(token, matrix, act, rows, out) }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; `check_matmul` proved the shapes.
            Tier::Avx512 => unsafe { crate::x86::exact::matmul_mxfp4(matrix, act, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl + bf16; shapes checked above.
            Tier::Avx512Bf16 => unsafe { crate::x86::bf16::matmul_mxfp4(matrix, act, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl + vnni + vbmi; shapes checked above.
            Tier::Avx512Vnni => unsafe { crate::x86::vnni::matmul_mxfp4(matrix, act, rows, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("non-scalar tiers cannot be constructed off x86_64"),
        }
        Ok(())
    }

    /// As [`Kernels::matmul_mxfp4`], for a BF16 matrix.
    pub fn matmul_bf16(
        &self,
        matrix: &Bf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        match self.tier {
            Tier::Scalar => scalar::matmul_bf16(matrix, act, rows, out),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                let token = self.avx2().expect("an avx2 Kernels holds its token");
                // SAFETY: the token proves avx2/fma/f16c; `check_matmul` proved the shapes.
                unsafe { crate::x86::avx2::matmul_bf16(token, matrix, act, rows, out) }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; shapes checked above.
            Tier::Avx512 => unsafe { crate::x86::exact::matmul_bf16(matrix, act, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl + bf16 (both approximate tiers have it).
            Tier::Avx512Bf16 | Tier::Avx512Vnni => unsafe {
                crate::x86::bf16::matmul_bf16(matrix, act, rows, out)
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("non-scalar tiers cannot be constructed off x86_64"),
        }
        Ok(())
    }

    /// As [`Kernels::matmul_bf16`] on the BF16 matrix that `matrix` packs, with its bits in
    /// every tier. `avx2` and `avx512` decode each block in registers and run their BF16
    /// kernel's FMAs on it; the other tiers decode a few rows at a time into an L2-sized
    /// buffer and run their BF16 kernel over it (no row's result depends on how rows are
    /// blocked).
    pub fn matmul_packed_bf16(
        &self,
        matrix: &PackedBf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_matmul(matrix.rows(), matrix.cols(), act, &rows, out)?;
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                let token = self.avx2().expect("an avx2 Kernels holds its token");
                // SAFETY: the token proves avx2/fma/f16c; `check_matmul` proved the shapes.
                unsafe { crate::x86::avx2::matmul_packed_bf16(token, matrix, act, rows, out) }
            }
            // A GEMV or a GEMM of a few tokens decodes in registers; more tokens run as
            // groups of at most 4 over each stretch of rows and would decode every block once
            // per group, so their rows are decoded once into a buffer and run through the BF16
            // GEMM (`packed_via_bf16`).
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; shapes checked above.
            Tier::Avx512 if act.tokens() <= 4 => unsafe {
                crate::x86::packed::matmul_packed_bf16(matrix, act, rows, out)
            },
            _ => self.packed_via_bf16(matrix, act, rows, out)?,
        }
        Ok(())
    }

    /// `matmul_packed_bf16` for the tiers without a packed kernel, and `avx512`'s GEMMs of more
    /// than 4 tokens: rows decoded into a 512 KiB buffer (in L2), that buffer's rows through
    /// the tier's BF16 kernel, each token's results put at their place. k3-wide, a 64-token
    /// prefill with the trunk packed (0.9x plan), 2 threads, alternating with the mapped BF16
    /// trunk: 64 KiB buffers 20.6-20.8 tokens/s against 23.4-30.7 (each 4-row buffer streams
    /// every token's activations), 512 KiB 25.7-27.4 against 23.4-27.5.
    fn packed_via_bf16(
        &self,
        matrix: &PackedBf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let (n, tokens, cols) = (rows.len(), act.tokens(), matrix.cols());
        let chunk = ((512 << 10) / (2 * cols)).max(1);
        let mut bytes = vec![0u8; chunk * cols * 2];
        let mut sums = vec![0f32; chunk * tokens];
        let mut start = rows.start;
        while start < rows.end {
            let end = (start + chunk).min(rows.end);
            let k = end - start;
            let decoded = &mut bytes[..k * cols * 2];
            match self.isa {
                // Every x86 tier's CPU has avx2 (AVX-512F implies it).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2(_) | Isa::Avx512(_) => {
                    // SAFETY: the token proves avx2, fma and f16c (AVX-512F implies them).
                    unsafe {
                        crate::x86::avx2::packed::decode_rows_bf16(matrix, start..end, decoded)
                    }
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
        match self.tier {
            Tier::Scalar => scalar::matmul_f16(matrix, act, rows, out),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                let token = self.avx2().expect("an avx2 Kernels holds its token");
                // SAFETY: the token proves avx2/fma/f16c; `check_matmul` proved the shapes.
                unsafe { crate::x86::avx2::matmul_f16(token, matrix, act, rows, out) }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; shapes checked above.
            Tier::Avx512 => unsafe { crate::x86::float::matmul_f16_exact(matrix, act, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl (all these kernels need); shapes checked.
            Tier::Avx512Bf16 | Tier::Avx512Vnni => unsafe {
                crate::x86::float::matmul_f16_bf16_act(matrix, act, rows, out)
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("non-scalar tiers cannot be constructed off x86_64"),
        }
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
        match self.tier {
            Tier::Scalar => scalar::matmul_f32(matrix, act, rows, out),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                let token = self.avx2().expect("an avx2 Kernels holds its token");
                // SAFETY: the token proves avx2/fma/f16c; `check_matmul` proved the shapes.
                unsafe { crate::x86::avx2::matmul_f32(token, matrix, act, rows, out) }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; shapes checked above.
            Tier::Avx512 => unsafe { crate::x86::float::matmul_f32_exact(matrix, act, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl (all these kernels need); shapes checked.
            Tier::Avx512Bf16 | Tier::Avx512Vnni => unsafe {
                crate::x86::float::matmul_f32_bf16_act(matrix, act, rows, out)
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("non-scalar tiers cannot be constructed off x86_64"),
        }
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
        }
    }

    fn check_matmul(
        &self,
        matrix_rows: usize,
        matrix_cols: usize,
        act: &Activations,
        rows: &Range<usize>,
        out: &[f32],
    ) -> Result<()> {
        if act.tier() != self.tier {
            return Err(Error::TierMismatch {
                prepared: act.tier(),
                kernels: self.tier,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The token is free to pass, exists exactly where the CPU has avx512f/bw/vl, and a
    /// `Kernels` carries one exactly when its tier is a SIMD tier.
    #[test]
    fn an_avx512_token_exists_only_where_detected() {
        assert_eq!(std::mem::size_of::<Avx512>(), 0);
        #[cfg(target_arch = "x86_64")]
        let detected = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        let detected = false;
        assert_eq!(Avx512::try_new().is_some(), detected);
        assert_eq!(Kernels::scalar().avx512(), None);
        for tier in Tier::ALL {
            match Kernels::new(tier) {
                Ok(k) => {
                    let avx512_tier = !matches!(tier, Tier::Scalar | Tier::Avx2);
                    assert_eq!(k.avx512().is_some(), avx512_tier, "{tier}");
                    assert_eq!(k.avx2().is_some(), tier == Tier::Avx2, "{tier}");
                }
                Err(_) => assert!(tier != Tier::Scalar),
            }
        }
        assert_eq!(Kernels::detect().avx512().is_some(), detected);
    }

    /// The AVX2 token exists exactly where avx2, fma and f16c are detected; `Kernels::new`
    /// names the first one missing; `detect` prefers avx512, then avx2, then scalar.
    #[test]
    fn an_avx2_token_exists_only_where_detected() {
        assert_eq!(std::mem::size_of::<Avx2>(), 0);
        #[cfg(target_arch = "x86_64")]
        let features = [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
        ];
        #[cfg(not(target_arch = "x86_64"))]
        let features = [("x86_64", false)];
        let missing = features.iter().find(|(_, present)| !present).map(|f| f.0);
        assert_eq!(Avx2::try_new().is_some(), missing.is_none());
        match (Kernels::new(Tier::Avx2), missing) {
            (Ok(k), None) => assert_eq!(k.tier(), Tier::Avx2),
            (Err(Error::TierUnavailable { tier, missing: m }), Some(expected)) => {
                assert_eq!((tier, m), (Tier::Avx2, expected));
            }
            (other, expected) => panic!("avx2 with {expected:?} missing gave {other:?}"),
        }
        let expected = if Avx512::try_new().is_some() {
            Tier::Avx512
        } else if missing.is_none() {
            Tier::Avx2
        } else {
            Tier::Scalar
        };
        assert_eq!(Kernels::detect().tier(), expected);
        assert_eq!(
            Kernels::available().iter().any(|k| k.tier() == Tier::Avx2),
            missing.is_none()
        );
    }
}
