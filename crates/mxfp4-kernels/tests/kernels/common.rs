//! Shared test data: random MXFP4/BF16 matrices and the error bounds tiers are held to.

use k3_testkit::Rng;
use mxfp4_kernels::codes::{E8M0_TO_F32, f32_to_bf16};
use mxfp4_kernels::{Kernels, Tier};

/// An owned MXFP4 matrix for tests.
#[derive(Debug, Clone)]
pub(crate) struct OwnedMx {
    pub(crate) packed: Vec<u8>,
    pub(crate) scales: Vec<u8>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl OwnedMx {
    /// Random codes; scale bytes drawn from `scale_lo..=scale_hi`.
    pub(crate) fn random(
        rng: &mut Rng,
        rows: usize,
        cols: usize,
        scale_lo: u8,
        scale_hi: u8,
    ) -> Self {
        let packed = rng.bytes(rows * cols / 2);
        let span = usize::from(scale_hi - scale_lo) + 1;
        let scales = (0..rows * cols / 32)
            .map(|_| scale_lo + rng.below(span) as u8)
            .collect();
        Self {
            packed,
            scales,
            rows,
            cols,
        }
    }
    pub(crate) fn view(&self) -> mxfp4_kernels::MxFp4Matrix<'_> {
        mxfp4_kernels::MxFp4Matrix::new(&self.packed, &self.scales, self.rows, self.cols).unwrap()
    }
    /// Exact weight value by definition (independent of the crate's kernels).
    pub(crate) fn weight(&self, r: usize, c: usize) -> f32 {
        let byte = self.packed[r * self.cols / 2 + c / 2];
        let code = (byte >> (4 * (c % 2))) & 0xF;
        mxfp4_kernels::codes::E2M1_VALUES[code as usize]
            * E8M0_TO_F32[self.scales[r * self.cols / 32 + c / 32] as usize]
    }
}

/// Random BF16 bytes of finite values with magnitudes around 1.
pub(crate) fn random_bf16(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|_| f32_to_bf16(rng.unit() * 2.0).to_le_bytes())
        .collect()
}

pub(crate) fn random_vec(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.unit()).collect()
}

/// Unit roundoff of f32.
pub(crate) const U: f64 = 1.0 / (1u64 << 24) as f64;

/// The largest deviation from scalar a tier may show on one dot product of `n` terms with
/// `Σ|w·x| = abs_sum`, where `act_err` bounds `Σ|w|·|x - x̃|` (the activation rounding of an
/// approximate tier, 0 for exact tiers). Both results are sums of the same `n` products in
/// different orders: each differs from the exact sum by at most `γ_(n+2)·Σ|w·x|` (one rounding
/// per product or FMA plus the lane tree and the scale), hence twice that between them. The
/// bound is proven, not tuned, so it cannot fail on a correct kernel; a wrong weight or lane is
/// caught because these tests keep `n` small (error of one term ≫ 2nU of the sum).
pub(crate) fn dot_bound(n: usize, abs_sum: f64, act_err: f64) -> f64 {
    let k = (n + 2) as f64 * U;
    2.0 * k / (1.0 - k) * (abs_sum + act_err) + act_err + f64::from(f32::MIN_POSITIVE)
}

/// `Σ|w|·|x - x̃|` for the tier's activation rounding.
pub(crate) fn activation_error(tier: Tier, w: &[f32], x: &[f32]) -> f64 {
    match tier {
        Tier::Scalar | Tier::Avx2 | Tier::Avx512 => 0.0,
        Tier::Avx512Bf16 => w
            .iter()
            .zip(x)
            .map(|(&w, &x)| {
                let xb = mxfp4_kernels::codes::bf16_to_f32(f32_to_bf16(x));
                f64::from(w).abs() * (f64::from(x) - f64::from(xb)).abs()
            })
            .sum(),
        Tier::Avx512Vnni => {
            // int8 per 32-group: |x - q·d| <= d/2 with d = max|x| / 127.
            w.chunks(32)
                .zip(x.chunks(32))
                .map(|(wg, xg)| {
                    let d = f64::from(xg.iter().fold(0.0f32, |m, a| m.max(a.abs()))) / 127.0;
                    wg.iter().map(|&w| f64::from(w).abs()).sum::<f64>() * d * 0.5000001
                })
                .sum()
        }
    }
}

/// Asserts `got` (a tier's `[tokens][rows]` output) is within `dot_bound` of the scalar `want`
/// for every row and token, given the dense weights `[rows][cols]` and the inputs
/// `[tokens][cols]`; `rounding` names the tier whose activation rounding applies.
pub(crate) fn assert_within_bound(
    label: &str,
    rounding: Tier,
    rows: usize,
    (dense, x): (&[f32], &[f32]),
    (got, want): (&[f32], &[f32]),
) {
    let cols = dense.len() / rows;
    let tokens = want.len() / rows;
    for t in 0..tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let w = &dense[r * cols..(r + 1) * cols];
            let abs_sum: f64 = w
                .iter()
                .zip(xt)
                .map(|(&a, &b)| f64::from(a * b).abs())
                .sum();
            let bound = dot_bound(cols, abs_sum, activation_error(rounding, w, xt));
            let (g, s) = (got[t * rows + r], want[t * rows + r]);
            assert!(
                (f64::from(g) - f64::from(s)).abs() <= bound,
                "{label} ({rounding} rounding): row {r} token {t} of [{rows}x{cols}]: {g} vs scalar {s}, bound {bound:e}"
            );
        }
    }
}

/// Tiers this CPU can run, with a note when the SIMD ones are skipped.
pub(crate) fn tiers() -> Vec<Kernels> {
    let available = Kernels::available();
    if available.len() < Tier::ALL.len() {
        eprintln!(
            "note: this CPU runs only {:?}; the other tiers are not tested here",
            available
                .iter()
                .map(|k| k.tier().name())
                .collect::<Vec<_>>()
        );
    }
    available
}
