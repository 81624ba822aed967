//! The kernel tiers: what each computes and which CPU features it needs.

use std::fmt;

#[cfg(target_arch = "x86_64")]
use crate::isa::Avx2;

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
    /// Every tier, the oracle first.
    pub const ALL: [Tier; 5] = [
        Tier::Scalar,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Bf16,
        Tier::Avx512Vnni,
    ];

    /// The tier's name, as `FromStr` parses it and flags spell it (`avx512-bf16`).
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
    pub(crate) fn missing_feature(self) -> Option<&'static str> {
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
