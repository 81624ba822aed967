//! Capability tokens: zero-sized proofs that this CPU has an instruction set, made only after
//! detecting it at runtime, which the `#[target_feature]` entry points take.

/// Proof that this CPU has avx512f, avx512bw and avx512vl: only [`Avx512::try_new`] makes one,
/// after detecting them at runtime. The AVX-512 entry points outside the matmul dispatch
/// (activation layout, `vmath`, `Situ`, dequant) take one, so their callers' SAFETY arguments
/// cite a value the type system tracks instead of "the tier is not scalar".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx512 {
    _detected: (),
}

impl Avx512 {
    /// The token, where this CPU has avx512f, avx512bw and avx512vl.
    pub(crate) fn try_new() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Some(Self { _detected: () });
        }
        None
    }
}

/// Proof that this CPU has avx2, fma and f16c: only [`Avx2::try_new`] makes one, after
/// detecting them at runtime. The `avx2` tier's entry points take one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx2 {
    _detected: (),
}

impl Avx2 {
    /// The token, where this CPU has avx2, fma and f16c.
    pub(crate) fn try_new() -> Option<Self> {
        Self::missing_feature()
            .is_none()
            .then_some(Self { _detected: () })
    }

    /// The first of avx2, fma, f16c this CPU lacks, if any.
    pub(crate) fn missing_feature() -> Option<&'static str> {
        #[cfg(target_arch = "x86_64")]
        {
            [
                ("avx2", std::arch::is_x86_feature_detected!("avx2")),
                ("fma", std::arch::is_x86_feature_detected!("fma")),
                ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ]
            .into_iter()
            .find(|(_, present)| !present)
            .map(|(name, _)| name)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Some("x86_64")
    }
}
