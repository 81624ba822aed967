//! F16 and F32 matrices, and `WeightMatrix` dispatch: every tier against the scalar oracle
//! within `common::dot_bound`, batch and row-split invariance bit for bit, and the format
//! identities the model relies on: in the exact tiers an F32 matrix of BF16 values gives the
//! BF16 kernel's bits, an F16 matrix the bits of the F32 matrix of its widened values, and an
//! MXFP4 matrix the bits of the BF16 matrix of its dequantised values.

use k3_testkit::Rng;
use mxfp4_kernels::codes::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use mxfp4_kernels::{
    Bf16Matrix, Error, F16Matrix, F32Matrix, Kernels, MAX_TOKENS, Tier, WeightFormat, WeightMatrix,
};
use proptest::prelude::{ProptestConfig, any, proptest};

use crate::common::*;

/// Owned bytes of one matrix in each float format, holding the same values where the format
/// allows: BF16 values, the same widened to F32, and their F16 rounding (widened again to F32
/// in `f16_as_f32`).
struct Twins {
    rows: usize,
    cols: usize,
    bf16: Vec<u8>,
    f32_of_bf16: Vec<u8>,
    f16: Vec<u8>,
    f32_of_f16: Vec<u8>,
}

impl Twins {
    fn random(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let bf16 = random_bf16(rng, rows * cols);
        let values: Vec<f32> = bf16
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        let halves: Vec<u16> = values.iter().map(|&v| f32_to_f16(v)).collect();
        Self {
            rows,
            cols,
            f32_of_bf16: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            f16: halves.iter().flat_map(|h| h.to_le_bytes()).collect(),
            f32_of_f16: halves
                .iter()
                .flat_map(|&h| f16_to_f32(h).to_le_bytes())
                .collect(),
            bf16,
        }
    }
    fn bf16(&self) -> WeightMatrix<'_> {
        Bf16Matrix::new(&self.bf16, self.rows, self.cols)
            .unwrap()
            .into()
    }
    fn f32_of_bf16(&self) -> WeightMatrix<'_> {
        F32Matrix::new(&self.f32_of_bf16, self.rows, self.cols)
            .unwrap()
            .into()
    }
    fn f16(&self) -> WeightMatrix<'_> {
        F16Matrix::new(&self.f16, self.rows, self.cols)
            .unwrap()
            .into()
    }
    fn f32_of_f16(&self) -> WeightMatrix<'_> {
        F32Matrix::new(&self.f32_of_f16, self.rows, self.cols)
            .unwrap()
            .into()
    }
}

fn matmul(k: &Kernels, m: &WeightMatrix<'_>, x: &[f32], rows: std::ops::Range<usize>) -> Vec<f32> {
    let act = k.prepare(x, m.cols()).unwrap();
    let mut out = vec![0.0; rows.len() * act.tokens()];
    k.matmul(m, &act, rows, &mut out).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The activation rounding a tier applies to F16/F32 matrices: none in the exact tiers, the
/// BF16 rounding in both approximate tiers (VNNI runs float matrices on BF16 activations).
fn float_rounding(tier: Tier) -> Tier {
    if tier.is_exact() {
        tier
    } else {
        Tier::Avx512Bf16
    }
}

fn check_float_matmul(seed: u64, rows: usize, cols: usize, tokens: usize) {
    let mut rng = Rng::new(seed);
    let twins = Twins::random(&mut rng, rows, cols);
    let x = random_vec(&mut rng, tokens * cols);
    let scalar = Kernels::scalar();
    for m in [twins.f32_of_bf16(), twins.f16()] {
        let mut dense = vec![0.0; rows * cols];
        scalar.dequant(&m, 0..rows, &mut dense).unwrap();
        let want = matmul(&scalar, &m, &x, 0..rows);
        for k in tiers() {
            let got = matmul(&k, &m, &x, 0..rows);
            assert_within_bound(
                m.format().name(),
                float_rounding(k.tier()),
                rows,
                (&dense, &x),
                (&got, &want),
            );
        }
    }
}

/// Exact tiers: the F32 twin of a BF16 matrix and the BF16 matrix give the same bits, and so
/// do an F16 matrix and the F32 matrix of its widened values (same products, same order).
fn check_format_identities(seed: u64, rows: usize, cols: usize, tokens: usize) {
    let mut rng = Rng::new(seed);
    let twins = Twins::random(&mut rng, rows, cols);
    let x = random_vec(&mut rng, tokens * cols);
    for k in tiers().into_iter().filter(|k| k.tier().is_exact()) {
        assert_eq!(
            bits(&matmul(&k, &twins.f32_of_bf16(), &x, 0..rows)),
            bits(&matmul(&k, &twins.bf16(), &x, 0..rows)),
            "{}: f32 of bf16 vs bf16 [{rows}x{cols}] x {tokens}",
            k.tier()
        );
        assert_eq!(
            bits(&matmul(&k, &twins.f16(), &x, 0..rows)),
            bits(&matmul(&k, &twins.f32_of_f16(), &x, 0..rows)),
            "{}: f16 vs f32 of f16 [{rows}x{cols}] x {tokens}",
            k.tier()
        );
    }
}

/// GEMM rows for token t equal the GEMV of token t alone, and any split of the rows gives the
/// same bits as one call, for F32 and F16 in every tier.
fn check_float_batch_invariance(seed: u64, rows: usize, cols: usize, tokens: usize, split: usize) {
    let mut rng = Rng::new(seed);
    let twins = Twins::random(&mut rng, rows, cols);
    let x = random_vec(&mut rng, tokens * cols);
    let split = split.min(rows);
    for k in tiers() {
        for m in [twins.f32_of_bf16(), twins.f16()] {
            let label = format!("{} {} [{rows}x{cols}]", k.tier(), m.format());
            let batch = matmul(&k, &m, &x, 0..rows);
            let head = matmul(&k, &m, &x, 0..split);
            let tail = matmul(&k, &m, &x, split..rows);
            for t in 0..tokens {
                let mut parts = head[t * split..(t + 1) * split].to_vec();
                parts.extend_from_slice(&tail[t * (rows - split)..(t + 1) * (rows - split)]);
                let one = matmul(&k, &m, &x[t * cols..(t + 1) * cols], 0..rows);
                let row = &batch[t * rows..(t + 1) * rows];
                assert_eq!(
                    bits(row),
                    bits(&parts),
                    "{label}: split at {split}, token {t}"
                );
                assert_eq!(
                    bits(row),
                    bits(&one),
                    "{label}: token {t} of {tokens} vs alone"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn float_matmul_within_bound(seed in any::<u64>(), rows in 1usize..21, cols in 1usize..300,
                                 tokens in 1usize..=MAX_TOKENS) {
        check_float_matmul(seed, rows, cols, tokens);
    }

    #[test]
    fn float_formats_bit_identical_in_exact_tiers(seed in any::<u64>(), rows in 1usize..21,
                                                  cols in 1usize..300, tokens in 1usize..=MAX_TOKENS) {
        check_format_identities(seed, rows, cols, tokens);
    }

    #[test]
    fn float_gemm_equals_gemv_bitwise(seed in any::<u64>(), rows in 1usize..24, cols in 1usize..300,
                                      tokens in 1usize..=MAX_TOKENS, split in 0usize..24) {
        check_float_batch_invariance(seed, rows, cols, tokens, split);
    }

    #[test]
    fn float_dequant_bit_identical(seed in any::<u64>(), rows in 1usize..12, cols in 1usize..200,
                                   start in 0usize..12) {
        let mut rng = Rng::new(seed);
        // Any bit pattern, NaN, infinities and subnormals included: widening is exact.
        let f16 = rng.bytes(2 * rows * cols);
        let f32 = rng.bytes(4 * rows * cols);
        let start = start.min(rows);
        let n = (rows - start) * cols;
        let cases = [
            (WeightMatrix::from(F16Matrix::new(&f16, rows, cols).unwrap()), 2usize, &f16),
            (WeightMatrix::from(F32Matrix::new(&f32, rows, cols).unwrap()), 4, &f32),
        ];
        for (m, elem, bytes) in cases {
            let want: Vec<u32> = bytes[start * cols * elem..]
                .chunks_exact(elem)
                .map(|b| match elem {
                    2 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])).to_bits(),
                    _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                })
                .collect();
            for k in tiers() {
                let mut got = vec![0.0; n];
                k.dequant(&m, start..rows, &mut got).unwrap();
                assert_eq!(bits(&got), want, "{} {}", k.tier(), m.format());
            }
        }
    }
}

/// K3's and k3-0.40b's widths run the GEMV copies compiled for them (and the short-row block);
/// more than 4 tokens run token groups over stretches of rows, walked in column chunks on
/// `avx2` (a width of 4100 ends its last chunk with a partial block; 7168 splits into chunks
/// of 32, 42 or 64 blocks for groups of 4, 3 and 2 tokens, the last of 42 short).
#[test]
fn float_k3_widths_within_bound_and_batch_invariant() {
    for (seed, rows, cols) in [
        (1u64, 19usize, 7168usize),
        (2, 21, 1024),
        (3, 21, 512),
        (4, 9, 12288),
        (5, 21, 1000),
    ] {
        check_float_matmul(seed, rows, cols, 1);
        check_float_matmul(seed, rows, cols, 3);
        check_format_identities(seed, rows, cols, 1);
        check_float_batch_invariance(seed, rows, cols, 3, rows / 2);
    }
    for (seed, tokens, split) in [(20u64, 5usize, 30usize), (21, 9, 11), (22, 16, 47)] {
        check_float_batch_invariance(seed, 100, 7168, tokens, split);
        check_format_identities(seed, 100, 7168, tokens);
    }
    for (seed, tokens, split) in [(23u64, 9usize, 17usize), (24, 7, 5)] {
        check_float_matmul(seed, 40, 4100, tokens);
        check_float_batch_invariance(seed, 40, 4100, tokens, split);
    }
}

/// With small-integer weights and activations every product and partial sum is exact, so
/// every tier (the approximate ones too: integers up to 8 are exact in BF16) equals scalar.
#[test]
fn float_tiers_bit_identical_on_exactly_summable_data() {
    let mut rng = Rng::new(9);
    for &(rows, cols) in &[(13usize, 7168usize), (9, 96), (4, 1000)] {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.below(17) as f32 - 8.0)
            .collect();
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| f32_to_f16(v).to_le_bytes())
            .collect();
        let x: Vec<f32> = (0..2 * cols).map(|_| rng.below(9) as f32 - 4.0).collect();
        for m in [
            WeightMatrix::from(F32Matrix::new(&f32_bytes, rows, cols).unwrap()),
            WeightMatrix::from(F16Matrix::new(&f16_bytes, rows, cols).unwrap()),
        ] {
            let want = matmul(&Kernels::scalar(), &m, &x, 0..rows);
            for k in tiers() {
                assert_eq!(
                    bits(&matmul(&k, &m, &x, 0..rows)),
                    bits(&want),
                    "{} {} [{rows}x{cols}]",
                    k.tier(),
                    m.format()
                );
            }
        }
    }
}

/// In the exact tiers an MXFP4 matrix and a BF16 matrix of its exact dequantised values give
/// the same bits (E2M1 x 2^k is exact in BF16; both kernels take even then odd columns of each
/// 32-block): a trunk linear stored as MXFP4 matches its BF16 twin.
#[test]
fn mxfp4_equals_bf16_of_its_values_in_exact_tiers() {
    let mut rng = Rng::new(31);
    for &(rows, cols, tokens) in &[(21usize, 1024usize, 1usize), (13, 3584, 3), (8, 96, 7)] {
        let m = OwnedMx::random(&mut rng, rows, cols, 100, 140);
        let mut dense = vec![0.0; rows * cols];
        Kernels::scalar()
            .dequant_mxfp4(&m.view(), 0..rows, &mut dense)
            .unwrap();
        let bf16: Vec<u8> = dense
            .iter()
            .flat_map(|&v| {
                let h = f32_to_bf16(v);
                assert_eq!(bf16_to_f32(h).to_bits(), v.to_bits(), "not exact in BF16");
                h.to_le_bytes()
            })
            .collect();
        let twin = WeightMatrix::from(Bf16Matrix::new(&bf16, rows, cols).unwrap());
        let x = random_vec(&mut rng, tokens * cols);
        for k in tiers().into_iter().filter(|k| k.tier().is_exact()) {
            assert_eq!(
                bits(&matmul(&k, &WeightMatrix::from(m.view()), &x, 0..rows)),
                bits(&matmul(&k, &twin, &x, 0..rows)),
                "{} [{rows}x{cols}] x {tokens}",
                k.tier()
            );
        }
    }
}

#[test]
fn f16_conversions_are_exact_and_round_to_nearest_even() {
    for h in 0..=u16::MAX {
        let v = f16_to_f32(h);
        if v.is_nan() {
            assert!(f32_to_f16(v) & 0x7C00 == 0x7C00 && f32_to_f16(v) & 0x3FF != 0);
            continue;
        }
        // Every F16 is an f32 and comes back unchanged.
        assert_eq!(f32_to_f16(v), h, "{h:#06x} -> {v:e}");
        // Definition of the value: sign, 5-bit exponent, 10-bit mantissa.
        let (e, m) = (i32::from((h >> 10) & 0x1F), f64::from(h & 0x3FF));
        let magnitude = match e {
            0 => m * 2f64.powi(-24),
            31 => f64::INFINITY,
            _ => (1.0 + m / 1024.0) * 2f64.powi(e - 15),
        };
        assert_eq!(f64::from(v.abs()), magnitude, "{h:#06x}");
    }
    // Ties go to the even mantissa; overflow goes to infinity at 65520.
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3C00);
    assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3C02);
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11) + 2f32.powi(-20)), 0x3C01);
    assert_eq!(f32_to_f16(65504.0), 0x7BFF);
    assert_eq!(f32_to_f16(65519.99), 0x7BFF);
    assert_eq!(f32_to_f16(65520.0), 0x7C00);
    assert_eq!(f32_to_f16(-1e9), 0xFC00);
    assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000); // half the smallest subnormal: ties to 0
    assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
    assert_eq!(f32_to_f16(-0.0), 0x8000);
}

#[test]
fn float_views_reject_bad_lengths_and_shapes() {
    assert!(matches!(
        F32Matrix::new(&[0u8; 20], 2, 3),
        Err(Error::BufferLength {
            expected: 24,
            found: 20,
            ..
        })
    ));
    assert!(matches!(
        F16Matrix::new(&[0u8; 13], 2, 3),
        Err(Error::BufferLength {
            expected: 12,
            found: 13,
            ..
        })
    ));
    assert!(matches!(
        F32Matrix::new(&[], usize::MAX, 2),
        Err(Error::BadShape { .. })
    ));
    assert!(matches!(
        F16Matrix::new(&[], 0, 2),
        Err(Error::BadShape { .. })
    ));
    let msg = F32Matrix::with_name("lm_head.weight", &[0u8; 4], 1, 2)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("lm_head.weight") && msg.contains('8') && msg.contains('4'),
        "{msg}"
    );
    // Calls with a wrong row range or output length are errors through the enum too.
    let bytes = [0u8; 4 * 64];
    let m = WeightMatrix::from(F32Matrix::new(&bytes, 2, 32).unwrap());
    assert_eq!(m.format(), WeightFormat::F32);
    assert_eq!((m.rows(), m.cols(), m.weight_bytes()), (2, 32, 256));
    for k in tiers() {
        let act = k.prepare(&[1.0; 32], 32).unwrap();
        assert!(k.matmul(&m, &act, 1..3, &mut [0.0; 2]).is_err());
        assert!(k.matmul(&m, &act, 0..2, &mut [0.0; 3]).is_err());
        assert!(k.dequant(&m, 0..3, &mut [0.0; 96]).is_err());
    }
}
