//! The wrapper that compiles the per-head loops for the widest vectors the kernels' tier
//! proves: AVX-512, or AVX2 with FMA.

use mxfp4_kernels::Kernels;

/// Runs `f` inside a function compiled with AVX-512 enabled when the kernels' tier proves the
/// CPU has it, else with AVX2 and FMA on the `avx2` tier, so the per-head loops it inlines
/// (`ops`: the KDA step, norms, dot products; the MLA attention) use 512- or 256-bit vectors
/// instead of the baseline's SSE2. Same bits: the same IEEE operations in the same order, only
/// wider registers (Rust never contracts or reassociates float arithmetic, and an explicit
/// `mul_add` is one correctly rounded operation with or without the FMA instruction).
#[inline(always)]
pub(super) fn wide<T>(kernels: &Kernels, f: impl FnOnce() -> T) -> T {
    #[cfg(target_arch = "x86_64")]
    if has_avx512(kernels) {
        // SAFETY: an AVX-512 tier's `Kernels` exists only where avx512f/bw/vl were detected.
        return unsafe { avx512(f) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernels.tier() == mxfp4_kernels::Tier::Avx2 {
        // SAFETY: the `avx2` tier's `Kernels` exists only where avx2, fma and f16c were
        // detected.
        return unsafe { avx2(f) };
    }
    f()
}

/// # Safety
/// The CPU must have avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<T>(f: impl FnOnce() -> T) -> T {
    f()
}

/// # Safety
/// The CPU must have avx512f, avx512bw and avx512vl.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn avx512<T>(f: impl FnOnce() -> T) -> T {
    f()
}

/// Whether `kernels`' tier proves the CPU has avx512f, avx512bw and avx512vl (an AVX-512
/// tier's `Kernels` exists only where they were detected).
#[inline(always)]
pub(super) fn has_avx512(kernels: &Kernels) -> bool {
    cfg!(target_arch = "x86_64")
        && !matches!(
            kernels.tier(),
            mxfp4_kernels::Tier::Scalar | mxfp4_kernels::Tier::Avx2
        )
}
