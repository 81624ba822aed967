//! The capability token `Kernels`: a tier this CPU was found to run, and the token of the
//! instruction set its entry points take. Holding one is what makes calling them sound.

use std::str::FromStr;

use crate::error::{Error, Result};
use crate::isa::{Avx2, Avx512};
use crate::tier::Tier;

/// A capability token: holding one proves the CPU supports its tier, so the kernel methods
/// (`Kernels::matmul`, `Kernels::dequant`, ...) may call that tier's `#[target_feature]` entry
/// points. Cheap to copy; make one at startup and hand it to every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    token: TierToken,
}

/// A tier with the token of the instruction set its entry points take: `Avx2` for the `avx2`
/// tier, `Avx512` for the three AVX-512 tiers (the approximate tiers' further features,
/// avx512bf16 and avx512vnni/vbmi, were detected by `Kernels::new` before it made one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TierToken {
    Scalar,
    Avx2(Avx2),
    Avx512(Avx512),
    Avx512Bf16(Avx512),
    Avx512Vnni(Avx512),
}

impl Kernels {
    /// Kernels of the given tier, or `TierUnavailable` naming the missing CPU feature.
    pub fn new(tier: Tier) -> Result<Self> {
        if let Some(missing) = tier.missing_feature() {
            return Err(Error::TierUnavailable { tier, missing });
        }
        // `missing_feature` found what each token detects; the fallbacks only name it.
        let avx512 = || {
            Avx512::try_new().ok_or(Error::TierUnavailable {
                tier,
                missing: "avx512f",
            })
        };
        let token = match tier {
            Tier::Scalar => TierToken::Scalar,
            Tier::Avx2 => TierToken::Avx2(Avx2::try_new().ok_or(Error::TierUnavailable {
                tier,
                missing: "avx2",
            })?),
            Tier::Avx512 => TierToken::Avx512(avx512()?),
            Tier::Avx512Bf16 => TierToken::Avx512Bf16(avx512()?),
            Tier::Avx512Vnni => TierToken::Avx512Vnni(avx512()?),
        };
        Ok(Self { token })
    }

    /// The scalar oracle (always available).
    pub fn scalar() -> Self {
        Self {
            token: TierToken::Scalar,
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

    /// The tier these kernels run.
    pub fn tier(&self) -> Tier {
        match self.token {
            TierToken::Scalar => Tier::Scalar,
            TierToken::Avx2(_) => Tier::Avx2,
            TierToken::Avx512(_) => Tier::Avx512,
            TierToken::Avx512Bf16(_) => Tier::Avx512Bf16,
            TierToken::Avx512Vnni(_) => Tier::Avx512Vnni,
        }
    }

    /// Whether packed BF16 matrices multiply at about the memory's rate in this tier, so
    /// that reading 0.77x the bytes makes a GEMV faster than on the BF16 it packs: `avx512`
    /// (k3-wide's packed trunk decodes 1.6x faster than its mapped BF16 on Zen 5), and the
    /// approximate tiers, which decode in registers as `avx512` does and run `vdpbf16ps` (on
    /// Zen 4, from memory, 1.49-1.67x the BF16 GEMV's weights per second per core;
    /// PERFORMANCE.md, phase 34). Not `avx2`: its 15 decode operations per block ran at
    /// 0.65-0.8x the BF16 GEMV's weights per second on Zen 3, no faster per token.
    pub fn packed_at_memory_rate(&self) -> bool {
        matches!(
            self.tier(),
            Tier::Avx512 | Tier::Avx512Bf16 | Tier::Avx512Vnni
        )
    }

    /// The tier and its token, for `per_tier!`.
    pub(crate) fn token(&self) -> TierToken {
        self.token
    }

    /// The AVX-512 token of an AVX-512 tier (`None` for `scalar` and `avx2`).
    pub(crate) fn avx512(&self) -> Option<Avx512> {
        match self.token {
            TierToken::Avx512(token)
            | TierToken::Avx512Bf16(token)
            | TierToken::Avx512Vnni(token) => Some(token),
            TierToken::Scalar | TierToken::Avx2(_) => None,
        }
    }

    /// The AVX2 token of the `avx2` tier (`None` for every other tier).
    pub(crate) fn avx2(&self) -> Option<Avx2> {
        match self.token {
            TierToken::Avx2(token) => Some(token),
            _ => None,
        }
    }
}

/// Parses a tier's [`Tier::name`]. Here rather than beside `Tier`: the error type names tiers,
/// so `Tier` sits below it.
impl FromStr for Tier {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::UnknownTier(s.to_owned()))
    }
}

/// Calls the entry point of `$kernels`' tier with `($args)`: the one `match` on the tier that
/// every kernel method shares, so each method names each tier's entry point once. A SIMD entry
/// point takes its tier's token first (`Avx2` or `Avx512`); holding it is the proof its
/// `#[target_feature]`s need. The caller has checked the shapes the entry points' contracts
/// ask for. Off x86_64 only `scalar` exists (`Kernels::new` makes no other).
macro_rules! per_tier {
    ($kernels:expr, ($($arg:expr),* $(,)?) {
        scalar: $scalar:expr,
        avx2: $avx2:expr,
        avx512: $avx512:expr,
        avx512_bf16: $bf16:expr,
        avx512_vnni: $vnni:expr $(,)?
    }) => {
        match $kernels.token() {
            $crate::kernels::TierToken::Scalar => $scalar($($arg),*),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx2, fma and f16c; the caller checked the shapes.
            $crate::kernels::TierToken::Avx2(token) => unsafe { $avx2(token, $($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl; the caller checked the shapes.
            $crate::kernels::TierToken::Avx512(token) => unsafe { $avx512(token, $($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl, and `Kernels::new` detected avx512bf16
            // before making this tier; the caller checked the shapes.
            $crate::kernels::TierToken::Avx512Bf16(token) => unsafe { $bf16(token, $($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl, and `Kernels::new` detected avx512bf16,
            // avx512vnni and avx512vbmi before making this tier; the caller checked the shapes.
            $crate::kernels::TierToken::Avx512Vnni(token) => unsafe { $vnni(token, $($arg),*) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no SIMD token exists off x86_64"),
        }
    };
}
pub(crate) use per_tier;

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
