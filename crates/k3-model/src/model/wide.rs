//! The AVX-512-compiled wrapper for the per-head loops.

use mxfp4_kernels::Kernels;

/// Runs `f` inside a function compiled with AVX-512 enabled when the kernels' tier proves the
/// CPU has it, so the per-head loops it inlines (`ops`: the KDA step, norms, dot products) use
/// 512-bit vectors instead of the baseline's SSE2. Same bits: the same IEEE operations in the
/// same order, only wider registers (Rust never contracts or reassociates float arithmetic).
#[inline(always)]
pub(super) fn wide<T>(kernels: &Kernels, f: impl FnOnce() -> T) -> T {
    #[cfg(target_arch = "x86_64")]
    if has_avx512(kernels) {
        // SAFETY: an AVX-512 tier's `Kernels` exists only where avx512f/bw/vl were detected.
        return unsafe { avx512(f) };
    }
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
