//! Storage formats of a synthetic checkpoint's non-expert tensors ([`SynthFormats`]) and the
//! value transforms that make copies in different formats hold the same values.

use expert_store::checkpoint::Dtype;
use mxfp4_kernels::codes::{
    E2M1_VALUES, E8M0_TO_F32, bf16_to_f32, f32_to_bf16, f32_to_f16, quantize_group,
};

use crate::inventory::{Role, TensorSpec};

/// A float storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloatFormat {
    /// bfloat16, 2 bytes: the release's.
    #[default]
    Bf16,
    /// IEEE half, 2 bytes.
    F16,
    /// f32, 4 bytes.
    F32,
}

impl FloatFormat {
    /// Every format, in the order the flags list them.
    pub const ALL: [FloatFormat; 3] = [FloatFormat::Bf16, FloatFormat::F16, FloatFormat::F32];

    /// The name the `--*-dtype` flags take.
    pub fn name(self) -> &'static str {
        match self {
            FloatFormat::Bf16 => "bf16",
            FloatFormat::F16 => "f16",
            FloatFormat::F32 => "f32",
        }
    }

    pub(super) fn dtype(self) -> Dtype {
        match self {
            FloatFormat::Bf16 => Dtype::BF16,
            FloatFormat::F16 => Dtype::F16,
            FloatFormat::F32 => Dtype::F32,
        }
    }

    /// Appends `values` in this format: BF16 and F16 round to nearest even (exact for values
    /// the format holds), F32 as is.
    pub(super) fn encode(self, values: &[f32], buf: &mut Vec<u8>) {
        match self {
            FloatFormat::Bf16 => {
                buf.extend(values.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()))
            }
            FloatFormat::F16 => {
                buf.extend(values.iter().flat_map(|&v| f32_to_f16(v).to_le_bytes()))
            }
            FloatFormat::F32 => buf.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        }
    }
}

impl std::fmt::Display for FloatFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FloatFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        FloatFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| format!("unknown float format {s:?} (bf16, f16, f32)"))
    }
}

/// Storage formats of a synthetic checkpoint's non-expert tensors (routed experts are always
/// MXFP4). The default is the release's layout, byte for byte what [`generate`] writes.
///
/// Values do not depend on the formats: the trunk's are drawn as BF16 values and stored
/// exactly (BF16, F32) or rounded (F16), so an F32 copy decodes to the BF16 checkpoint's bits.
///
/// [`generate`]: crate::synth::generate
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SynthFormats {
    /// Format of every linear weight outside the routed experts (embedding and lm_head too).
    pub trunk: FloatFormat,
    /// Round the trunk's values to F16 before storing them: with `trunk: F32`, the F32 twin of
    /// the `trunk: F16` checkpoint (its F16 values widened). Not with `trunk: Bf16`.
    pub trunk_f16_values: bool,
    /// Format of every float vector (norms, AttnRes vectors, conv taps, `A_log`, `dt_bias`,
    /// router bias). `None`: the release's (norms BF16, the others F32). With a format, every
    /// vector's values are first made exact in BF16 and F16 (rounded to BF16, magnitudes below
    /// 2^-14 flushed to zero), so the three choices hold the same values.
    pub vectors: Option<FloatFormat>,
    /// Trunk linear weights to store as MXFP4 (`weight_packed` + `weight_scale`): those whose
    /// name contains one of these strings (`"all"`: every one). Their inputs must be a
    /// multiple of 32 wide.
    pub mxfp4_linears: Vec<String>,
    /// Store the `mxfp4_linears` as BF16 holding their exact dequantised values instead (E2M1
    /// x 2^k is exact in BF16): the BF16 twin of the MXFP4 checkpoint.
    pub mxfp4_as_bf16: bool,
}

impl SynthFormats {
    pub(super) fn is_mxfp4(&self, spec: &TensorSpec) -> bool {
        spec.role() == Role::Linear
            && self
                .mxfp4_linears
                .iter()
                .any(|p| p == "all" || spec.name.contains(p.as_str()))
    }
}

/// A value made exact in both BF16 and F16: rounded to BF16 (8 significant bits, which F16's
/// 11 hold from 2^-14 up), magnitudes below F16's normal range flushed to zero.
pub(super) fn exact_in_bf16_and_f16(v: f32) -> f32 {
    let b = bf16_to_f32(f32_to_bf16(v));
    if b.abs() < 2f32.powi(-14) { 0.0 } else { b }
}

/// Rows of `cols` values quantised to MXFP4 per 32-group and decoded again (exact values).
pub(super) fn mxfp4_round_trip(values: &[f32], cols: usize) -> Vec<f32> {
    debug_assert!(cols.is_multiple_of(32));
    let mut out = Vec::with_capacity(values.len());
    for group in values.chunks_exact(32) {
        let (codes, scale) = quantize_group(group.try_into().expect("32 values"));
        for c in 0..32 {
            let code = (codes[c / 2] >> (4 * (c % 2))) & 0xF;
            out.push(E2M1_VALUES[code as usize] * E8M0_TO_F32[scale as usize]);
        }
    }
    out
}
