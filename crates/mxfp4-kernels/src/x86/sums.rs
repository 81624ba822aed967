//! The AVX-512 kernels' horizontal sums, in a fixed tree written out so the order never
//! depends on how the compiler lowers a reduction: one vector (`hsum`), sixteen at once with
//! the same pairs (`hsum16`), and a row block's accumulators stored (`store_sums`).

use core::arch::x86_64::*;

use super::driver::Tile;
use super::lanes;

/// Horizontal sum in a fixed tree (halves, then quarters, ...), written out so the order never
/// depends on how the compiler lowers a reduction intrinsic.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn hsum(v: __m512) -> f32 {
    let s = _mm512_add_ps(v, _mm512_shuffle_f32x4::<{ lanes::HSUM_UPPER_HALF }>(v, v));
    let s = _mm512_add_ps(
        s,
        _mm512_shuffle_f32x4::<{ lanes::HSUM_UPPER_QUARTER }>(s, s),
    );
    let x = _mm512_castps512_ps128(s);
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<{ lanes::HSUM_LANE_ONE }>(x, x));
    _mm_cvtss_f32(x)
}

/// Writes the `R x T` accumulators of a row block where [`Tile`] says:
/// `out[(tok0 + t) * n + local0 + r]`.
/// Blocks of 8 or 16 accumulators reduce together (`hsum16`), the rest one by one; the sums
/// are `hsum`'s either way.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn store_sums<const R: usize, const T: usize>(
    acc: &[[__m512; T]; R],
    tile: Tile,
    out: &mut [f32],
) {
    let Tile {
        tok0, local0, n, ..
    } = tile;
    if R * T == 16 || R * T == 8 {
        let mut flat = [_mm512_setzero_ps(); 16];
        for (r, row_acc) in acc.iter().enumerate() {
            for (t, &a) in row_acc.iter().enumerate() {
                flat[t * R + r] = a;
            }
        }
        let mut sums = [0.0f32; 16];
        // SAFETY: `sums` is 16 writable f32.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), hsum16(&flat)) };
        for t in 0..T {
            let at = (tok0 + t) * n + local0;
            out[at..at + R].copy_from_slice(&sums[t * R..(t + 1) * R]);
        }
        return;
    }
    for (r, row_acc) in acc.iter().enumerate() {
        for (t, &a) in row_acc.iter().enumerate() {
            out[(tok0 + t) * n + local0 + r] = hsum(a);
        }
    }
}

/// The horizontal sums of 16 vectors at once: lane `l` is `hsum(v[l])` bit for bit. Each step
/// adds the same pairs as `hsum` (lanes 8 apart, then 4, 2, 1), with two vectors' halves packed
/// into one register, so 16 sums take 45 vector operations instead of about 140. Short rows
/// (256-512 columns) spend a large share of a GEMM block in these reductions.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn hsum16(v: &[__m512; 16]) -> __m512 {
    // The steps leave input 4k + q's sum in lane 4q + k; reading the inputs transposed puts
    // v[l]'s sum in lane l.
    let input = |j: usize| v[lanes::hsum16_input(j)];
    // Lanes i + (i + 8): two inputs' eight partial sums per vector.
    let halves: [__m512; 8] = core::array::from_fn(|k| {
        let (a, b) = (input(2 * k), input(2 * k + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_LOW_BLOCKS }>(a, b),
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_HIGH_BLOCKS }>(a, b),
        )
    });
    // Lanes i + (i + 4): 128-bit block q of `quarters[m]` holds input 4m + q's four sums.
    let quarters: [__m512; 4] = core::array::from_fn(|m| {
        let (c, d) = (halves[2 * m], halves[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_EVEN_BLOCKS }>(c, d),
            _mm512_shuffle_f32x4::<{ lanes::HSUM16_ODD_BLOCKS }>(c, d),
        )
    });
    // Lanes i + (i + 2), as `movehl`: block q of `pairs[p]` is [input 8p+q's two sums, input
    // 8p+4+q's two sums].
    let pairs: [__m512; 2] = core::array::from_fn(|p| {
        let (e, f) = (
            _mm512_castps_pd(quarters[2 * p]),
            _mm512_castps_pd(quarters[2 * p + 1]),
        );
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(e, f)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(e, f)),
        )
    });
    // Lane 0 + lane 1, as the final `add_ss`.
    _mm512_add_ps(
        _mm512_shuffle_ps::<{ lanes::HSUM16_EVEN_LANES }>(pairs[0], pairs[1]),
        _mm512_shuffle_ps::<{ lanes::HSUM16_ODD_LANES }>(pairs[0], pairs[1]),
    )
}

#[cfg(test)]
mod tests {
    use k3_testkit::Rng;

    use super::*;

    /// `hsum16` gives every vector `hsum`'s bits, on values of mixed signs and magnitudes
    /// (where the order of additions shows in the last bits).
    #[test]
    fn hsum16_matches_hsum_bitwise() {
        if !(is_x86_feature_detected!("avx512f")) {
            eprintln!("skipped: no avx512f on this CPU");
            return;
        }
        let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
        for _ in 0..200 {
            let values: Vec<f32> = (0..256).map(|_| rng.mixed(-20..=19)).collect();
            // SAFETY: avx512f was detected above; every load reads 16 of the 256 values.
            unsafe {
                let v: [__m512; 16] =
                    core::array::from_fn(|i| _mm512_loadu_ps(values[16 * i..].as_ptr()));
                let mut got = [0.0f32; 16];
                _mm512_storeu_ps(got.as_mut_ptr(), hsum16(&v));
                for (l, &g) in got.iter().enumerate() {
                    assert_eq!(g.to_bits(), hsum(v[l]).to_bits(), "lane {l}");
                }
            }
        }
    }
}
