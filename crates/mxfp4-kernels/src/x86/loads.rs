//! The AVX-512 kernels' loads of weight bytes and scales: whole or tail-masked byte loads,
//! 16 E8M0 scales widened exactly, and the lane patterns that spread scales over products.

use core::arch::x86_64::*;

use super::lanes;

/// Loads `32` bytes, or the first `n < 32` of them (the rest zero). Whole loads are plain:
/// AVX-512 masked loads that miss the cache stream far slower on Zen 4 (PERFORMANCE.md).
///
/// # Safety
/// `ptr..ptr + min(n, 32)` must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) unsafe fn load_bytes32(ptr: *const u8, n: usize) -> __m256i {
    if n >= 32 {
        // SAFETY: 32 readable bytes, by the caller.
        unsafe { _mm256_loadu_si256(ptr.cast()) }
    } else {
        // SAFETY: the mask limits the load to the `n` readable bytes.
        unsafe { _mm256_maskz_loadu_epi8(lanes::byte_mask32(n), ptr.cast()) }
    }
}

/// As [`load_bytes32`], for 64 bytes.
///
/// # Safety
/// `ptr..ptr + min(n, 64)` must be readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(crate) unsafe fn load_bytes64(ptr: *const u8, n: usize) -> __m512i {
    if n >= 64 {
        // SAFETY: 64 readable bytes, by the caller.
        unsafe { _mm512_loadu_si512(ptr.cast()) }
    } else {
        // SAFETY: the mask limits the load to the `n` readable bytes.
        unsafe { _mm512_maskz_loadu_epi8(lanes::byte_mask64(n), ptr.cast()) }
    }
}

/// The exact f32 scales of 16 consecutive groups (bytes beyond `n` read as 0, giving 2^-127
/// for groups whose weights are also masked to zero). Same values as `E8M0_TO_F32` (0xFF was
/// rejected when the matrix view was built).
///
/// # Safety
/// `ptr..ptr + n` must be readable, `n <= 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) unsafe fn scales16(ptr: *const u8, n: usize) -> __m512 {
    let bytes = if n >= 16 {
        // SAFETY: the caller vouches for 16 readable bytes.
        unsafe { _mm_loadu_si128(ptr.cast()) }
    } else {
        // SAFETY: the masked load touches only the `n` bytes the caller vouches for.
        unsafe { _mm_maskz_loadu_epi8((1u16 << n) - 1, ptr.cast()) }
    };
    let s = _mm512_cvtepu8_epi32(bytes);
    let normal = _mm512_slli_epi32::<23>(s);
    let zero = _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512());
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(
        normal,
        zero,
        _mm512_set1_epi32(0x0040_0000),
    ))
}

/// `N` lane patterns for `vpermps` over a vector of 16 group scales: pattern `p` gives lane
/// `l` the scale of group `(16 / N) * p + l / N`, i.e. each of `16 / N` consecutive groups
/// fills `N` consecutive lanes (the lanes its products land in).
pub(crate) const fn group_lanes<const P: usize>(lanes_per_group: usize) -> [[i32; 16]; P] {
    let mut idx = [[0i32; 16]; P];
    let groups_per_pattern = 16 / lanes_per_group;
    let mut p = 0;
    while p < P {
        let mut l = 0;
        while l < 16 {
            idx[p][l] = (groups_per_pattern * p + l / lanes_per_group) as i32;
            l += 1;
        }
        p += 1;
    }
    idx
}
