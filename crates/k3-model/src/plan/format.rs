//! `--trunk-format`: the trunk's matrices as stored (exact, the default) or requantised once at
//! load to Q8_0 or MXFP4 (lossy, opt-in), and which matrices a format requantises.

use std::str::FromStr;

use expert_store::Dtype;
use mxfp4_kernels::codes::{Q8_0_BLOCK, Q8_0_BLOCK_BYTES};

/// How the trunk's matrices are held (`--trunk-format`).
///
/// `Bf16` keeps every matrix's stored values (exact; packed losslessly where the plan packs).
/// `Q8_0` and `MxFp4` requantise the trunk's large projections once at load: KDA's q, k, v, g
/// and o; MLA's q_a, q_b, kv_a, o and gate; the dense MLP; the shared experts; the latent
/// down and up projections. The KDA gate's and beta's small matrices (`f_a`, `f_b`, `b`), the
/// router and the lm_head stay as stored unless `all` is set; vectors, norms, convolutions,
/// MLA's `kv_b` (widened to f32 at load) and the embedding (one row read per token) always do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrunkFormat {
    /// As stored (exact).
    #[default]
    Bf16,
    /// ggml's Q8_0 blocks (32 int8 and an F16 step: 8.5 bits per weight).
    Q8_0 {
        /// The router, the lm_head and KDA's small gate matrices too.
        all: bool,
    },
    /// OCP MXFP4 blocks (32 E2M1 codes and an E8M0 scale: 4.25 bits per weight), as the
    /// routed experts are stored.
    MxFp4 {
        /// As [`TrunkFormat::Q8_0`]'s.
        all: bool,
    },
}

/// A lossy format a trunk matrix is requantised to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// ggml `block_q8_0`, row-major, 34 bytes per 32 weights.
    Q8_0,
    /// E2M1 codes (16 bytes per 32 weights) then E8M0 scales (one byte per 32), each as a
    /// row-major array of its own.
    MxFp4,
}

/// Whether (and how) a stored float matrix may be requantised: its columns, its stored dtype,
/// and whether it is one a format keeps as stored unless told `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloatMatrix {
    /// Columns (a multiple of 32).
    pub cols: usize,
    /// Its stored dtype (BF16, F16 or F32).
    pub dtype: Dtype,
    /// Kept as stored unless the format says `all` (the router, the lm_head, KDA's `f_a`,
    /// `f_b` and `b`).
    pub kept: bool,
}

impl TrunkFormat {
    /// Every name `--trunk-format` takes.
    pub const NAMES: [&'static str; 5] = ["bf16", "q8_0", "mxfp4", "q8_0-all", "mxfp4-all"];

    /// The format's flag value.
    pub fn name(self) -> &'static str {
        match self {
            TrunkFormat::Bf16 => "bf16",
            TrunkFormat::Q8_0 { all: false } => "q8_0",
            TrunkFormat::Q8_0 { all: true } => "q8_0-all",
            TrunkFormat::MxFp4 { all: false } => "mxfp4",
            TrunkFormat::MxFp4 { all: true } => "mxfp4-all",
        }
    }

    /// The lossy format the trunk is requantised to (`None`: exact).
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            TrunkFormat::Bf16 => None,
            TrunkFormat::Q8_0 { .. } => Some(QuantFormat::Q8_0),
            TrunkFormat::MxFp4 { .. } => Some(QuantFormat::MxFp4),
        }
    }

    /// The format `matrix` is held in under this trunk format (`None`: as stored).
    pub fn for_matrix(self, matrix: &FloatMatrix) -> Option<QuantFormat> {
        let all = matches!(
            self,
            TrunkFormat::Q8_0 { all: true } | TrunkFormat::MxFp4 { all: true }
        );
        self.quant().filter(|_| all || !matrix.kept)
    }
}

impl std::fmt::Display for TrunkFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TrunkFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "bf16" => TrunkFormat::Bf16,
            "q8_0" => TrunkFormat::Q8_0 { all: false },
            "q8_0-all" => TrunkFormat::Q8_0 { all: true },
            "mxfp4" => TrunkFormat::MxFp4 { all: false },
            "mxfp4-all" => TrunkFormat::MxFp4 { all: true },
            other => {
                return Err(format!(
                    "unknown trunk format {other:?}: expected one of {}",
                    Self::NAMES.join(", ")
                ));
            }
        })
    }
}

impl QuantFormat {
    /// The format's name (`q8_0`, `mxfp4`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::MxFp4 => "mxfp4",
        }
    }

    /// Bytes of `rows` rows of `cols` weights (`cols` a multiple of 32).
    pub const fn bytes(self, rows: usize, cols: usize) -> usize {
        let blocks = rows * (cols / Q8_0_BLOCK);
        match self {
            QuantFormat::Q8_0 => blocks * Q8_0_BLOCK_BYTES,
            // 16 bytes of codes and a scale byte per 32 weights.
            QuantFormat::MxFp4 => blocks * 17,
        }
    }

    /// Bits per weight.
    pub fn bits_per_weight(self) -> f64 {
        8.0 * self.bytes(1, 32) as f64 / 32.0
    }
}

/// How a resident matrix is held when not as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackAs {
    /// BF16 packed losslessly (`mxfp4_kernels::packed`), `cols` columns.
    Packed {
        /// Columns (a multiple of 32).
        cols: usize,
    },
    /// Requantised from its stored `dtype` to `format`.
    Quant {
        /// The format.
        format: QuantFormat,
        /// Columns (a multiple of 32).
        cols: usize,
        /// The stored dtype (BF16, F16 or F32).
        dtype: Dtype,
    },
}

impl PackAs {
    /// Bytes of the body of `rows` rows: packed (`mxfp4_kernels::packed`), Q8_0 blocks, or
    /// MXFP4 codes of every row then scales of every row.
    pub fn body_bytes(self, rows: usize) -> usize {
        match self {
            PackAs::Packed { cols } => mxfp4_kernels::packed::packed_body_bytes(rows, cols),
            PackAs::Quant { format, cols, .. } => format.bytes(rows, cols),
        }
    }

    /// The format's code in a pack cache's manifest (0: packed BF16).
    pub fn code(self) -> u32 {
        match self {
            PackAs::Packed { .. } => 0,
            PackAs::Quant {
                format: QuantFormat::Q8_0,
                ..
            } => 1,
            PackAs::Quant {
                format: QuantFormat::MxFp4,
                ..
            } => 2,
        }
    }

    /// Columns of the matrix.
    pub fn cols(self) -> usize {
        match self {
            PackAs::Packed { cols } | PackAs::Quant { cols, .. } => cols,
        }
    }

    /// Bytes per weight as stored.
    pub fn stored_bytes_per_weight(self) -> usize {
        match self {
            PackAs::Packed { .. } => 2,
            PackAs::Quant { dtype, .. } => dtype.bitsize() / 8,
        }
    }
}

/// Whether `dtype` is a float a matrix can be requantised from.
pub(crate) fn requantisable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_bytes_are_the_block_sizes() {
        for name in TrunkFormat::NAMES {
            assert_eq!(name.parse::<TrunkFormat>().unwrap().name(), name);
        }
        let err = "q4_k".parse::<TrunkFormat>().unwrap_err();
        assert!(err.contains("q4_k") && err.contains("q8_0-all"), "{err}");
        assert_eq!(QuantFormat::Q8_0.bytes(3, 64), 3 * 2 * 34);
        assert_eq!(QuantFormat::MxFp4.bytes(3, 64), 3 * 2 * 17);
        assert_eq!(QuantFormat::Q8_0.bits_per_weight(), 8.5);
        assert_eq!(QuantFormat::MxFp4.bits_per_weight(), 4.25);
        let kept = FloatMatrix {
            cols: 32,
            dtype: Dtype::BF16,
            kept: true,
        };
        let projection = FloatMatrix {
            kept: false,
            ..kept
        };
        let q8 = TrunkFormat::Q8_0 { all: false };
        assert_eq!(q8.for_matrix(&projection), Some(QuantFormat::Q8_0));
        assert_eq!(q8.for_matrix(&kept), None);
        assert_eq!(
            TrunkFormat::MxFp4 { all: true }.for_matrix(&kept),
            Some(QuantFormat::MxFp4)
        );
        assert_eq!(TrunkFormat::Bf16.for_matrix(&projection), None);
    }
}
