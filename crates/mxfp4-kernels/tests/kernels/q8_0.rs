//! Q8_0 matrices: the view's checks, dequant bit-identical in every tier (and to the format's
//! definition), each tier's matmul within `common::dot_bound` of scalar (activations stay f32,
//! so every tier is held to the exact tiers' bound), `avx2` equal to `avx512` bit for bit,
//! batch and row-split invariance, an edge table, and `quantize_q8_0`'s round trip.

use k3_testkit::Rng;
use mxfp4_kernels::codes::{Q8_0_BLOCK_BYTES, f16_to_f32, f32_to_f16, quantize_q8_0};
use mxfp4_kernels::{Error, Kernels, MAX_TOKENS, Q8_0Matrix, Tier, WeightFormat, WeightMatrix};
use proptest::prelude::{ProptestConfig, any, prop_assert_eq, proptest};

use crate::common::*;

/// An owned Q8_0 matrix for tests.
struct OwnedQ8 {
    bytes: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl OwnedQ8 {
    /// Random int8 values; steps random F16 values of magnitude 2^lo..2^hi, either sign.
    fn random(rng: &mut Rng, rows: usize, cols: usize, (lo, hi): (i32, i32)) -> Self {
        let mut bytes = rng.bytes(rows * cols / 32 * Q8_0_BLOCK_BYTES);
        for block in bytes.chunks_exact_mut(Q8_0_BLOCK_BYTES) {
            let d = f32_to_f16(rng.mixed(lo..=hi));
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
        Self { bytes, rows, cols }
    }
    /// Any F16 bit pattern as a step: zeros, subnormals, infinities and NaNs included.
    fn any_steps(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let bytes = rng.bytes(rows * cols / 32 * Q8_0_BLOCK_BYTES);
        Self { bytes, rows, cols }
    }
    fn view(&self) -> Q8_0Matrix<'_> {
        Q8_0Matrix::new(&self.bytes, self.rows, self.cols).unwrap()
    }
    /// Exact weight value by the format's definition (independent of the crate's kernels).
    fn weight(&self, r: usize, c: usize) -> f32 {
        let block = &self.bytes[(r * self.cols / 32 + c / 32) * Q8_0_BLOCK_BYTES..];
        let d = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
        f32::from(block[2 + c % 32] as i8) * d
    }
    fn dense(&self) -> Vec<f32> {
        (0..self.rows * self.cols)
            .map(|i| self.weight(i / self.cols, i % self.cols))
            .collect()
    }
}

fn matmul(k: &Kernels, m: &Q8_0Matrix<'_>, x: &[f32], rows: std::ops::Range<usize>) -> Vec<f32> {
    let act = k.prepare(x, m.cols()).unwrap();
    let mut out = vec![f32::NAN; rows.len() * act.tokens()];
    k.matmul(&WeightMatrix::from(*m), &act, rows, &mut out)
        .unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every tier within the bound of scalar; `avx2` equal to `avx512` bit for bit where both run.
fn check_matmul(seed: u64, rows: usize, blocks: usize, tokens: usize) {
    let cols = 32 * blocks;
    let mut rng = Rng::new(seed);
    let m = OwnedQ8::random(&mut rng, rows, cols, (-12, 2));
    let x = random_vec(&mut rng, tokens * cols);
    let want = matmul(&Kernels::scalar(), &m.view(), &x, 0..rows);
    let dense = m.dense();
    for k in tiers() {
        let got = matmul(&k, &m.view(), &x, 0..rows);
        // No tier rounds the activations for Q8_0: every tier has the exact tiers' bound.
        let label = format!("q8_0 {}", k.tier());
        assert_within_bound(&label, Tier::Avx512, rows, (&dense, &x), (&got, &want));
    }
    if let (Ok(avx2), Ok(avx512)) = (Kernels::new(Tier::Avx2), Kernels::new(Tier::Avx512)) {
        let start = rng.below(rows);
        assert_eq!(
            bits(&matmul(&avx2, &m.view(), &x, start..rows)),
            bits(&matmul(&avx512, &m.view(), &x, start..rows)),
            "avx2 vs avx512, [{rows}x{cols}], {tokens} tokens, rows {start}..{rows}"
        );
    }
}

/// Each token's row equals its one-token call, and two row ranges equal one call, bit for bit.
fn check_batch_invariance(seed: u64, rows: usize, blocks: usize, tokens: usize, split: usize) {
    let cols = 32 * blocks;
    let mut rng = Rng::new(seed);
    let m = OwnedQ8::random(&mut rng, rows, cols, (-10, 0));
    let x = random_vec(&mut rng, tokens * cols);
    let split = split.min(rows);
    for k in tiers() {
        let batch = matmul(&k, &m.view(), &x, 0..rows);
        for range in [0..split, split..rows] {
            let part = matmul(&k, &m.view(), &x, range.clone());
            for t in 0..tokens {
                for (i, r) in range.clone().enumerate() {
                    assert_eq!(
                        part[t * range.len() + i].to_bits(),
                        batch[t * rows + r].to_bits(),
                        "{}: split at {split}, row {r} token {t}",
                        k.tier()
                    );
                }
            }
        }
        for t in 0..tokens {
            let one = matmul(&k, &m.view(), &x[t * cols..(t + 1) * cols], 0..rows);
            assert_eq!(
                bits(&batch[t * rows..(t + 1) * rows]),
                bits(&one),
                "{}: token {t} of {tokens} differs from its one-token call",
                k.tier()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn q8_0_matmul_within_bound(seed in any::<u64>(), rows in 1usize..40, blocks in 1usize..14,
                                tokens in 1usize..=MAX_TOKENS) {
        check_matmul(seed, rows, blocks, tokens);
    }

    #[test]
    fn q8_0_gemm_equals_gemv_bitwise(seed in any::<u64>(), rows in 1usize..40,
                                     blocks in 1usize..10, tokens in 1usize..=MAX_TOKENS,
                                     split in 0usize..40) {
        check_batch_invariance(seed, rows, blocks, tokens, split);
    }

    #[test]
    fn q8_0_dequant_bit_identical(seed in any::<u64>(), rows in 1usize..12, blocks in 1usize..8,
                                  start in 0usize..12) {
        let cols = 32 * blocks;
        let mut rng = Rng::new(seed);
        let m = OwnedQ8::any_steps(&mut rng, rows, cols);
        let start = start.min(rows);
        for k in std::iter::once(Kernels::scalar()).chain(tiers()) {
            let mut got = vec![0.0; (rows - start) * cols];
            k.dequant(&m.view().into(), start..rows, &mut got).unwrap();
            for (i, g) in got.iter().enumerate() {
                let want = m.weight(start + i / cols, i % cols);
                prop_assert_eq!(g.to_bits(), want.to_bits(), "{}: element {}", k.tier(), i);
            }
        }
    }
}

/// 1 and 64 tokens at K3's widths, row tails of every row block: `avx2` equals `avx512`, and
/// both lie within the bound.
#[test]
fn q8_0_k3_widths_one_and_64_tokens() {
    let mut rng = Rng::new(0x08_00);
    for (rows, cols, tokens) in [(37, 7168, 1), (19, 3584, 1), (21, 512, 64), (5, 1024, 64)] {
        let m = OwnedQ8::random(&mut rng, rows, cols, (-12, -4));
        let x = random_vec(&mut rng, tokens * cols);
        let want = matmul(&Kernels::scalar(), &m.view(), &x, 0..rows);
        let dense = m.dense();
        let mut outputs = Vec::new();
        for k in tiers() {
            let got = matmul(&k, &m.view(), &x, 0..rows);
            let label = format!("q8_0 {} [{rows}x{cols}] x {tokens}", k.tier());
            assert_within_bound(&label, Tier::Avx512, rows, (&dense, &x), (&got, &want));
            outputs.push((k.tier(), bits(&got)));
        }
        let of = |tier| outputs.iter().find(|(t, _)| *t == tier).map(|o| &o.1);
        if let (Some(a), Some(b)) = (of(Tier::Avx2), of(Tier::Avx512)) {
            assert_eq!(a, b, "avx2 vs avx512 at [{rows}x{cols}] x {tokens}");
        }
    }
}

/// K3's width with more than 4 tokens: token groups of 3 and 4 over stretches of rows.
#[test]
fn q8_0_batch_invariant_at_k3_width_in_token_groups() {
    check_batch_invariance(0x08_02, 40, 224, 9, 17);
    check_batch_invariance(0x08_03, 21, 224, 16, 5);
}

/// With small-integer activations, small values and power-of-two steps every product and
/// partial sum is an exact f32, so any sum order gives the same bits: every tier equals scalar.
#[test]
fn q8_0_tiers_bit_identical_on_exactly_summable_data() {
    let mut rng = Rng::new(0x08_01);
    for (rows, cols, tokens) in [(13, 3584, 1), (9, 96, 3), (4, 7168, 64), (17, 512, 2)] {
        let mut m = OwnedQ8::random(&mut rng, rows, cols, (0, 0));
        for block in m.bytes.chunks_exact_mut(Q8_0_BLOCK_BYTES) {
            let d = [0.5f32, 1.0, 2.0][rng.below(3)];
            block[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
            for q in &mut block[2..] {
                *q = (rng.below(17) as i8 - 8) as u8;
            }
        }
        let x: Vec<f32> = (0..tokens * cols)
            .map(|_| rng.below(9) as f32 - 4.0)
            .collect();
        let want = matmul(&Kernels::scalar(), &m.view(), &x, 0..rows);
        for k in tiers() {
            let got = matmul(&k, &m.view(), &x, 0..rows);
            assert_eq!(bits(&got), bits(&want), "{} [{rows}x{cols}]", k.tier());
        }
    }
}

/// One block per edge: step 0, -0, the smallest and largest F16 subnormals, the smallest
/// normal, 1 and the largest finite F16; values -128, 127, -1, 0. Dequant gives `q · d` bit for
/// bit (signed zeros included) in every tier, and a matmul whose activations pick one column
/// gives that weight exactly.
#[test]
fn q8_0_edge_table() {
    let steps: [(u16, f32); 7] = [
        (0x0000, 0.0),
        (0x8000, -0.0),
        (0x0001, 2f32.powi(-24)),
        (0x03FF, 1023.0 * 2f32.powi(-24)),
        (0x0400, 2f32.powi(-14)),
        (0x3C00, 1.0),
        (0x7BFF, 65504.0),
    ];
    let values: [i8; 4] = [-128, 127, -1, 0];
    let cols = 32;
    let mut bytes = Vec::new();
    for &(d, _) in &steps {
        let mut block = [0u8; Q8_0_BLOCK_BYTES];
        block[..2].copy_from_slice(&d.to_le_bytes());
        for (j, q) in block[2..].iter_mut().enumerate() {
            *q = values[j % 4] as u8;
        }
        bytes.extend_from_slice(&block);
    }
    let rows = steps.len();
    let m = Q8_0Matrix::new(&bytes, rows, cols).unwrap();
    for k in std::iter::once(Kernels::scalar()).chain(tiers()) {
        let mut got = vec![f32::NAN; rows * cols];
        k.dequant_q8_0(&m, 0..rows, &mut got).unwrap();
        for (r, &(_, d)) in steps.iter().enumerate() {
            for c in 0..cols {
                let want = f32::from(values[c % 4]) * d;
                assert_eq!(
                    got[r * cols + c].to_bits(),
                    want.to_bits(),
                    "{}: step {d:e}, value {}",
                    k.tier(),
                    values[c % 4]
                );
            }
        }
        // Column c alone: the output is weight (r, c) plus zeros, exact in any order.
        for c in [0, 1, 2, 17] {
            let mut x = vec![0.0f32; cols];
            x[c] = 1.0;
            let y = matmul(&k, &m, &x, 0..rows);
            for (r, &(_, d)) in steps.iter().enumerate() {
                let want = f32::from(values[c % 4]) * d;
                assert_eq!(y[r], want, "{}: step {d:e}, column {c}", k.tier());
            }
        }
    }
}

/// A step that is infinite or NaN is accepted and decodes to the non-finite weights it means.
#[test]
fn q8_0_non_finite_steps_decode_exactly() {
    let mut bytes = vec![0u8; 2 * Q8_0_BLOCK_BYTES];
    bytes[..2].copy_from_slice(&0x7C00u16.to_le_bytes()); // +inf
    bytes[2] = 3;
    bytes[3] = (-2i8) as u8;
    bytes[34..36].copy_from_slice(&0x7E00u16.to_le_bytes()); // NaN
    let m = Q8_0Matrix::new(&bytes, 2, 32).unwrap();
    for k in std::iter::once(Kernels::scalar()).chain(tiers()) {
        let mut w = vec![0.0; 64];
        k.dequant_q8_0(&m, 0..2, &mut w).unwrap();
        assert_eq!(w[0], f32::INFINITY, "{}", k.tier());
        assert_eq!(w[1], f32::NEG_INFINITY, "{}", k.tier());
        assert!(
            w[2].is_nan() && w[32..].iter().all(|v| v.is_nan()),
            "{}",
            k.tier()
        );
        let y = matmul(&k, &m, &[1.0; 32], 0..2);
        assert!(y.iter().all(|v| !v.is_finite()), "{}: {y:?}", k.tier());
    }
}

/// The view refuses widths that are not whole blocks, wrong lengths and empty shapes, naming
/// the value and the limit; `sub_rows` borrows whole rows or refuses the range.
#[test]
fn q8_0_matrix_checks_its_shape() {
    let bytes = vec![0u8; 3 * 2 * Q8_0_BLOCK_BYTES];
    let m = Q8_0Matrix::new(&bytes, 3, 64).unwrap();
    assert_eq!((m.rows(), m.cols(), m.weight_bytes()), (3, 64, 204));
    assert_eq!(m.bytes_for_rows(2), 136);
    assert_eq!(m.row_bytes(1).len(), 68);
    let wm = WeightMatrix::from(m);
    assert_eq!(wm.format(), WeightFormat::Q8_0);
    assert_eq!(wm.format().name(), "q8_0");
    assert_eq!(wm.row_storage(2), vec![&bytes[136..204]]);
    let sub = m.sub_rows(1..3).unwrap();
    assert_eq!(
        (sub.rows(), sub.bytes().as_ptr()),
        (2, bytes[68..].as_ptr())
    );
    assert_eq!(
        m.sub_rows(2..4).unwrap_err(),
        Error::RowRange {
            start: 2,
            end: 4,
            rows: 3
        }
    );
    assert!(m.sub_rows(1..1).is_err());

    let err = Q8_0Matrix::new(&bytes, 3, 48).unwrap_err();
    assert_eq!(
        err,
        Error::ColsNotQ8_0Multiple {
            what: "q8_0 matrix",
            cols: 48
        }
    );
    assert_eq!(
        err.to_string(),
        "q8_0 matrix: cols 48 is not a multiple of the Q8_0 block of 32"
    );
    let err = Q8_0Matrix::with_name("blk.0.attn_q", &bytes[1..], 3, 64).unwrap_err();
    assert_eq!(
        err.to_string(),
        "blk.0.attn_q: q8_0 blocks holds 203 bytes, expected 204 for [3, 64]"
    );
    assert!(matches!(
        Q8_0Matrix::new(&bytes, 2, 64),
        Err(Error::BufferLength {
            expected: 136,
            found: 204,
            ..
        })
    ));
    assert!(matches!(
        Q8_0Matrix::new(&[], 0, 64),
        Err(Error::BadShape { .. })
    ));
    assert!(matches!(
        Q8_0Matrix::new(&[], 1, 0),
        Err(Error::BadShape { .. })
    ));
    assert!(matches!(
        Q8_0Matrix::new(&bytes, usize::MAX, 64),
        Err(Error::BadShape { .. })
    ));
}

/// `quantize_q8_0` then dequant gives each value back within `max|x| / 254` (half a step)
/// plus `max|x| · 2^-11` (the step's rounding to F16, times |q| <= 127), plus one f32 rounding.
#[test]
fn q8_0_round_trip_within_half_a_step() {
    let mut rng = Rng::new(0x08_02);
    let (rows, cols) = (16, 256);
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.mixed(-5..=9)).collect();
    let bytes: Vec<u8> = values
        .chunks_exact(32)
        .flat_map(|v| quantize_q8_0(v.try_into().unwrap()))
        .collect();
    let m = Q8_0Matrix::new(&bytes, rows, cols).unwrap();
    for k in std::iter::once(Kernels::scalar()).chain(tiers()) {
        let mut back = vec![0.0; rows * cols];
        k.dequant_q8_0(&m, 0..rows, &mut back).unwrap();
        for (group, decoded) in values.chunks_exact(32).zip(back.chunks_exact(32)) {
            let amax = f64::from(group.iter().fold(0.0f32, |a, v| a.max(v.abs())));
            let bound = amax * (1.0 / 254.0 + 2f64.powi(-11)) * (1.0 + 4.0 * U);
            for (&v, &b) in group.iter().zip(decoded) {
                let err = (f64::from(v) - f64::from(b)).abs();
                assert!(err <= bound, "{}: {v} came back as {b}", k.tier());
            }
        }
    }
}
