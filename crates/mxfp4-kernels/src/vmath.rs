//! The engine's own `exp`, `tanh` and `sigmoid` in f32: the scalar functions and their AVX-512
//! forms run the very same IEEE operations (fused multiply-adds where the scalar code calls
//! `mul_add`), so a value computed 16 lanes at a time has the bits of the scalar call. libm's
//! `expf` is not vectorised, and a KDA head's token step spends most of its time in it.
//!
//! `exp`: clamp to [-87, 88] (2^n stays a normal number; e^-87 ≈ 1.6e-38, e^88 ≈ 1.7e38),
//! n = round(a·log2 e), Cody–Waite reduction with a split ln 2, degree-7 Taylor polynomial
//! (|r| <= ln2/2, truncation error < 6e-9 relative), times 2^n. `tanh`: odd Taylor series to
//! x^17 for |a| < 0.55 (no cancellation near 0), else `1 - 2/(e^{2|a|} + 1)` with the sign of
//! `a`. Measured against f64 in the tests: a few ulp.

use crate::kernels::Kernels;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4; // 0x3f318000: few mantissa bits, so n * LN2_HI is exact
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
/// 1/k! for k = 7 down to 0 (Horner order).
const EXP_POLY: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];
/// Below this |a|, tanh uses its odd series.
const TANH_SERIES_LIMIT: f32 = 0.55;
/// tanh(a) = a + a·s·P(s), s = a²: P's coefficients from the x^17 term down to the x^3 term.
const TANH_POLY: [f32; 8] = [
    (6404582.0f64 / 10854718875.0) as f32,
    (-929569.0f64 / 638512875.0) as f32,
    (21844.0f64 / 6081075.0) as f32,
    (-1382.0f64 / 155925.0) as f32,
    (62.0f64 / 2835.0) as f32,
    (-17.0f64 / 315.0) as f32,
    (2.0f64 / 15.0) as f32,
    (-1.0f64 / 3.0) as f32,
];

/// Clamp with NaN passing through, written to match `vminps`/`vmaxps` operand order.
#[inline]
fn clamp_exp_arg(a: f32) -> f32 {
    let m = if EXP_HI < a { EXP_HI } else { a };
    if EXP_LO > m { EXP_LO } else { m }
}

/// e^a, see the module docs.
#[inline]
pub fn exp(a: f32) -> f32 {
    let a = clamp_exp_arg(a);
    let n = (a * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, a);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// tanh(a), see the module docs.
#[inline]
pub fn tanh(a: f32) -> f32 {
    if a.abs() < TANH_SERIES_LIMIT {
        let s = a * a;
        let mut p = TANH_POLY[0];
        for &c in &TANH_POLY[1..] {
            p = p.mul_add(s, c);
        }
        (a * s).mul_add(p, a)
    } else {
        let e = exp(2.0 * a.abs());
        (1.0 - 2.0 / (e + 1.0)).copysign(a)
    }
}

/// 1 / (1 + e^-a).
#[inline]
pub fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + exp(-a))
}

/// Above this, softplus is its argument (torch's threshold).
const SOFTPLUS_LINEAR: f32 = 20.0;
/// ln m = 2s + 2s·z·P(z) with s = (m-1)/(m+1), z = s²: P's coefficients 1/11 .. 1/3.
const LOG_POLY: [f32; 5] = [1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0];

/// torch's softplus, `ln(1 + e^a)` and `a` itself above 20, on [`exp`] and our own log1p:
/// `u = 1 + e^a` split as `2^k · m` with m in (√½, √2], `ln m` by its atanh series to s^11
/// (|s| <= 0.172: truncation below 1e-10 relative), `k·ln 2` with the split ln 2, and the
/// rounding of `1 + e^a` added back as `(e^a - (u - 1)) / u`, so tiny `e^a` give `e^a`.
#[inline]
pub fn softplus(a: f32) -> f32 {
    if a > SOFTPLUS_LINEAR {
        return a;
    }
    let y = exp(a);
    let u = 1.0 + y;
    let bits = u.to_bits();
    let mut k = (bits >> 23) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        k += 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut p = LOG_POLY[0];
    for &c in &LOG_POLY[1..] {
        p = p.mul_add(z, c);
    }
    let t = 2.0 * s;
    let ln_m = (t * z).mul_add(p, t);
    let k = k as f32;
    let low = k.mul_add(LN2_LO, ln_m) + (y - (u - 1.0)) / u;
    k.mul_add(LN2_HI, low)
}

/// A `Kernels` method applying the scalar function `$scalar` to a slice in place: whole
/// vectors of 16 through `simd::$name` where the tier has AVX-512, the rest (and the scalar
/// tier) one by one, so every tier gives the scalar function's bits. The `avx2` tier runs the
/// scalar function itself, compiled for avx2 and fma (`avx2::$name`): the same IEEE
/// operations (`mul_add` one FMA instruction instead of a libm call), so the same bits.
macro_rules! in_place {
    ($(#[$doc:meta])* $name:ident, $scalar:ident) => {
        $(#[$doc])*
        pub fn $name(&self, x: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if let Some(token) = self.avx2() {
                // SAFETY: the token proves avx2/fma/f16c were detected on this CPU.
                unsafe { avx2::$name(token, x) };
                return;
            }
            let done = match self.avx512() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves avx512f/bw/vl were detected on this CPU.
                Some(token) => unsafe { simd::$name(token, x) },
                _ => 0,
            };
            x[done..].iter_mut().for_each(|v| *v = $scalar(*v));
        }
    };
}

impl Kernels {
    in_place!(
        /// `x[i] = e^x[i]` with [`exp`]; every tier gives the scalar function's bits.
        exp_in_place,
        exp
    );
    in_place!(
        /// `x[i] = 1 / (1 + e^-x[i])` with [`sigmoid`]; every tier gives the scalar bits.
        sigmoid_in_place,
        sigmoid
    );
    in_place!(
        /// `x[i] = softplus(x[i])` with [`softplus`]; every tier gives the scalar bits.
        softplus_in_place,
        softplus
    );
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The scalar functions compiled for avx2 and fma (the `avx2` tier).

    use crate::isa::Avx2;

    /// `$name(token, x)` maps the scalar `$f` over `x` in place.
    macro_rules! map_fn {
        ($name:ident, $f:ident) => {
            /// # Safety
            /// The CPU must have avx2 and fma: the token says it has.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name(_: Avx2, x: &mut [f32]) {
                x.iter_mut().for_each(|v| *v = super::$f(*v));
            }
        };
    }
    map_fn!(exp_in_place, exp);
    map_fn!(sigmoid_in_place, sigmoid);
    map_fn!(softplus_in_place, softplus);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    //! The same operations as the scalar functions above, 16 lanes at a time.

    use core::arch::x86_64::*;

    use super::*;
    use crate::isa::Avx512;

    /// `$f` over the whole vectors of 16 of `$x` in place; evaluates to how many elements it
    /// did. A macro, not a function taking a closure: the closure would not inline the
    /// target-feature function it calls.
    macro_rules! map_in_place {
        ($x:expr, $f:ident) => {{
            let x: &mut [f32] = $x;
            let whole = x.len() / 16 * 16;
            for chunk in x[..whole].chunks_exact_mut(16) {
                // SAFETY: `chunk` is 16 f32.
                unsafe {
                    _mm512_storeu_ps(chunk.as_mut_ptr(), $f(_mm512_loadu_ps(chunk.as_ptr())))
                };
            }
            whole
        }};
    }

    /// # Safety
    /// The CPU must have avx512f: the token says it has.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_in_place(_: Avx512, x: &mut [f32]) -> usize {
        map_in_place!(x, exp)
    }

    /// # Safety
    /// The CPU must have avx512f: the token says it has.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sigmoid_in_place(_: Avx512, x: &mut [f32]) -> usize {
        map_in_place!(x, sigmoid)
    }

    /// # Safety
    /// The CPU must have avx512f: the token says it has.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softplus_in_place(_: Avx512, x: &mut [f32]) -> usize {
        map_in_place!(x, softplus)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn exp(a: __m512) -> __m512 {
        let a = _mm512_max_ps(
            _mm512_set1_ps(EXP_LO),
            _mm512_min_ps(_mm512_set1_ps(EXP_HI), a),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(a, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), a);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn tanh(a: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let abs = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(a)));
        let s = _mm512_mul_ps(a, a);
        let mut p = _mm512_set1_ps(TANH_POLY[0]);
        for &c in &TANH_POLY[1..] {
            p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(c));
        }
        let series = _mm512_fmadd_ps(_mm512_mul_ps(a, s), p, a);
        let one = _mm512_set1_ps(1.0);
        let e = exp(_mm512_mul_ps(_mm512_set1_ps(2.0), abs));
        let t = _mm512_sub_ps(
            one,
            _mm512_div_ps(_mm512_set1_ps(2.0), _mm512_add_ps(e, one)),
        );
        // copysign: clear t's sign bit, take a's (vpternlog: (t & !sign) | (a & sign)).
        let signed =
            _mm512_ternarylogic_epi32::<0xD8>(_mm512_castps_si512(t), _mm512_castps_si512(a), sign);
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs, _mm512_set1_ps(TANH_SERIES_LIMIT));
        _mm512_mask_blend_ps(small, _mm512_castsi512_ps(signed), series)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn sigmoid(a: __m512) -> __m512 {
        // Flip the sign bit, as scalar `-a` does (0 - a would turn -0 into +0).
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(a),
            _mm512_set1_epi32(i32::MIN),
        ));
        let one = _mm512_set1_ps(1.0);
        _mm512_div_ps(one, _mm512_add_ps(one, exp(neg)))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn softplus(a: __m512) -> __m512 {
        let y = exp(a);
        let one = _mm512_set1_ps(1.0);
        let u = _mm512_add_ps(one, y);
        let bits = _mm512_castps_si512(u);
        let k = _mm512_sub_epi32(_mm512_srli_epi32::<23>(bits), _mm512_set1_epi32(127));
        let m = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(bits, _mm512_set1_epi32(0x007f_ffff)),
            _mm512_set1_epi32(0x3f80_0000),
        ));
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_set1_ps(std::f32::consts::SQRT_2));
        let m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5));
        let k = _mm512_mask_add_epi32(k, big, k, _mm512_set1_epi32(1));
        let f = _mm512_sub_ps(m, one);
        let s = _mm512_div_ps(f, _mm512_add_ps(_mm512_set1_ps(2.0), f));
        let z = _mm512_mul_ps(s, s);
        let mut p = _mm512_set1_ps(LOG_POLY[0]);
        for &c in &LOG_POLY[1..] {
            p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(c));
        }
        let t = _mm512_add_ps(s, s);
        let ln_m = _mm512_fmadd_ps(_mm512_mul_ps(t, z), p, t);
        let k = _mm512_cvtepi32_ps(k);
        let rounding = _mm512_div_ps(_mm512_sub_ps(y, _mm512_sub_ps(u, one)), u);
        let low = _mm512_add_ps(_mm512_fmadd_ps(k, _mm512_set1_ps(LN2_LO), ln_m), rounding);
        let log1p = _mm512_fmadd_ps(k, _mm512_set1_ps(LN2_HI), low);
        let linear = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_set1_ps(SOFTPLUS_LINEAR));
        _mm512_mask_blend_ps(linear, log1p, a)
    }
}
