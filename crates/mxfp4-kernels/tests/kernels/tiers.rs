//! Every tier against the scalar oracle: dequant bit-identical, dot products within the proven
//! bound of `common::dot_bound`, exact tiers bit-identical on exactly-summable data, batch and
//! row-split invariance bit for bit, SiTU and the expert FFN.

use k3_testkit::Rng;
use mxfp4_kernels::{Bf16Matrix, ExpertScratch, Kernels, MAX_TOKENS, Situ, Tier};
use proptest::prelude::{ProptestConfig, any, prop_assert_eq, proptest};

use crate::common::*;

fn check_mxfp4_matmul(
    seed: u64,
    rows: usize,
    groups: usize,
    tokens: usize,
    scale_lo: u8,
    scale_hi: u8,
) {
    let cols = 32 * groups;
    let mut rng = Rng::new(seed);
    let m = OwnedMx::random(&mut rng, rows, cols, scale_lo, scale_hi);
    let x = random_vec(&mut rng, tokens * cols);
    let dense: Vec<f32> = (0..rows * cols)
        .map(|i| m.weight(i / cols, i % cols))
        .collect();
    let run = |k: &Kernels, out: &mut [f32]| {
        k.matmul_mxfp4(&m.view(), &k.prepare(&x, cols).unwrap(), 0..rows, out)
            .unwrap()
    };
    let mut want = vec![0.0; rows * tokens];
    run(&Kernels::scalar(), &mut want);
    for k in tiers() {
        let mut got = vec![0.0; rows * tokens];
        run(&k, &mut got);
        assert_within_bound("mxfp4", k.tier(), rows, (&dense, &x), (&got, &want));
    }
}

fn check_bf16_matmul(seed: u64, rows: usize, cols: usize, tokens: usize) {
    let mut rng = Rng::new(seed);
    let bytes = random_bf16(&mut rng, rows * cols);
    let m = Bf16Matrix::new(&bytes, rows, cols).unwrap();
    let x = random_vec(&mut rng, tokens * cols);
    let mut dense = vec![0.0; rows * cols];
    Kernels::scalar()
        .dequant_bf16(&m, 0..rows, &mut dense)
        .unwrap();
    let run = |k: &Kernels, out: &mut [f32]| {
        k.matmul_bf16(&m, &k.prepare(&x, cols).unwrap(), 0..rows, out)
            .unwrap()
    };
    let mut want = vec![0.0; rows * tokens];
    run(&Kernels::scalar(), &mut want);
    for k in tiers() {
        let mut got = vec![0.0; rows * tokens];
        run(&k, &mut got);
        // For BF16 matrices the VNNI tier runs the BF16 path.
        let rounding = if k.tier() == Tier::Avx512Vnni {
            Tier::Avx512Bf16
        } else {
            k.tier()
        };
        assert_within_bound("bf16", rounding, rows, (&dense, &x), (&got, &want));
    }
}

/// GEMM rows for token t equal the GEMV of token t alone, and any split of the rows gives the
/// same bits as one call.
fn check_batch_invariance(seed: u64, rows: usize, groups: usize, tokens: usize, split: usize) {
    let cols = 32 * groups;
    let mut rng = Rng::new(seed);
    let m = OwnedMx::random(&mut rng, rows, cols, 110, 140);
    let bf16_bytes = random_bf16(&mut rng, rows * cols);
    let b = Bf16Matrix::new(&bf16_bytes, rows, cols).unwrap();
    let x = random_vec(&mut rng, tokens * cols);
    let split = split.min(rows);
    for k in tiers() {
        let act = k.prepare(&x, cols).unwrap();
        let mut batch = vec![0.0; rows * tokens];
        let mut batch_bf16 = vec![0.0; rows * tokens];
        k.matmul_mxfp4(&m.view(), &act, 0..rows, &mut batch)
            .unwrap();
        k.matmul_bf16(&b, &act, 0..rows, &mut batch_bf16).unwrap();
        // The same batch in two row ranges (outputs token-major within each range).
        let mut parts = [0usize..split, split..rows].map(|range| {
            let mut y = vec![0.0; range.len() * tokens];
            let mut y_bf16 = vec![0.0; range.len() * tokens];
            k.matmul_mxfp4(&m.view(), &act, range.clone(), &mut y)
                .unwrap();
            k.matmul_bf16(&b, &act, range.clone(), &mut y_bf16).unwrap();
            (range, y, y_bf16)
        });
        for (range, y, y_bf16) in &mut parts {
            for t in 0..tokens {
                for (i, r) in range.clone().enumerate() {
                    let at = t * range.len() + i;
                    assert_eq!(
                        y[at].to_bits(),
                        batch[t * rows + r].to_bits(),
                        "{}: mxfp4 split",
                        k.tier()
                    );
                    assert_eq!(
                        y_bf16[at].to_bits(),
                        batch_bf16[t * rows + r].to_bits(),
                        "{}: bf16 split",
                        k.tier()
                    );
                }
            }
        }
        for t in 0..tokens {
            let single = k.prepare(&x[t * cols..(t + 1) * cols], cols).unwrap();
            let mut one = vec![0.0; rows];
            let mut one_bf16 = vec![0.0; rows];
            // Two row ranges, as two workers would compute them.
            k.matmul_mxfp4(&m.view(), &single, 0..split, &mut one[..split])
                .unwrap();
            k.matmul_mxfp4(&m.view(), &single, split..rows, &mut one[split..])
                .unwrap();
            k.matmul_bf16(&b, &single, 0..split, &mut one_bf16[..split])
                .unwrap();
            k.matmul_bf16(&b, &single, split..rows, &mut one_bf16[split..])
                .unwrap();
            for r in 0..rows {
                assert_eq!(
                    batch[t * rows + r].to_bits(),
                    one[r].to_bits(),
                    "{}: mxfp4 row {r} token {t}/{tokens}",
                    k.tier()
                );
                assert_eq!(
                    batch_bf16[t * rows + r].to_bits(),
                    one_bf16[r].to_bits(),
                    "{}: bf16 row {r} token {t}/{tokens}",
                    k.tier()
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn mxfp4_matmul_within_bound(seed in any::<u64>(), rows in 1usize..21, groups in 1usize..14,
                                 tokens in 1usize..=MAX_TOKENS, scale_lo in 100u8..127, width in 0u8..30) {
        check_mxfp4_matmul(seed, rows, groups, tokens, scale_lo, scale_lo + width);
    }

    #[test]
    fn bf16_matmul_within_bound(seed in any::<u64>(), rows in 1usize..21, cols in 1usize..300,
                                tokens in 1usize..=MAX_TOKENS) {
        check_bf16_matmul(seed, rows, cols, tokens);
    }

    #[test]
    fn gemm_equals_gemv_bitwise(seed in any::<u64>(), rows in 1usize..24, groups in 1usize..10,
                                tokens in 1usize..=MAX_TOKENS, split in 0usize..24) {
        check_batch_invariance(seed, rows, groups, tokens, split);
    }

    #[test]
    fn dequant_bit_identical(seed in any::<u64>(), rows in 1usize..12, groups in 1usize..8,
                             start in 0usize..12) {
        let cols = 32 * groups;
        let mut rng = Rng::new(seed);
        // Every valid scale byte, 0x00 and 0xFE included.
        let m = OwnedMx::random(&mut rng, rows, cols, 0, 254);
        let start = start.min(rows);
        let mut want = vec![0.0; (rows - start) * cols];
        Kernels::scalar().dequant_mxfp4(&m.view(), start..rows, &mut want).unwrap();
        for (i, w) in want.iter().enumerate() {
            prop_assert_eq!(w.to_bits(), m.weight(start + i / cols, i % cols).to_bits());
        }
        for k in tiers() {
            let mut got = vec![0.0; (rows - start) * cols];
            k.dequant_mxfp4(&m.view(), start..rows, &mut got).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), w.to_bits(), "{}: element {}", k.tier(), i);
            }
        }
    }
}

/// At an expert's width, GEMMs of more tokens than one group holds (9, 16 and 33: groups of
/// 2-4 over stretches of rows) give each token's GEMV bits, over two row ranges.
#[test]
fn mxfp4_gemms_of_many_tokens_equal_gemvs_at_k3_width() {
    for (seed, tokens) in [(11u64, 9usize), (12, 16), (13, 33)] {
        check_batch_invariance(seed, 37, 3584 / 32, tokens, 21);
    }
}

/// With small-integer activations and scale 2^0, every product and partial sum is an exact
/// f32, so any summation order gives the same bits: exact tiers must equal scalar exactly.
#[test]
fn exact_tiers_bit_identical_on_exactly_summable_data() {
    let mut rng = Rng::new(7);
    for &(rows, cols) in &[(13usize, 3584usize), (9, 96), (4, 3072)] {
        let mut m = OwnedMx::random(&mut rng, rows, cols, 127, 127);
        m.scales
            .iter_mut()
            .for_each(|s| *s = 126 + (rng.below(3) as u8)); // 2^-1..2^1
        let x: Vec<f32> = (0..cols).map(|_| rng.below(9) as f32 - 4.0).collect();
        let bf16_bytes: Vec<u8> = (0..rows * cols)
            .flat_map(|_| {
                mxfp4_kernels::codes::f32_to_bf16(rng.below(17) as f32 - 8.0).to_le_bytes()
            })
            .collect();
        let b = Bf16Matrix::new(&bf16_bytes, rows, cols).unwrap();
        let scalar = Kernels::scalar();
        let mut want = vec![0.0; rows];
        let mut want_bf16 = vec![0.0; rows];
        let sa = scalar.prepare(&x, cols).unwrap();
        scalar
            .matmul_mxfp4(&m.view(), &sa, 0..rows, &mut want)
            .unwrap();
        scalar
            .matmul_bf16(&b, &sa, 0..rows, &mut want_bf16)
            .unwrap();
        for k in tiers() {
            // Integers in [-4, 4] are exact in BF16 and int8 (d = 4/127 is not: skip VNNI's MXFP4).
            let act = k.prepare(&x, cols).unwrap();
            let mut got = vec![0.0; rows];
            k.matmul_bf16(&b, &act, 0..rows, &mut got).unwrap();
            assert_eq!(got, want_bf16, "{}: bf16 [{rows}x{cols}]", k.tier());
            if k.tier() != Tier::Avx512Vnni {
                k.matmul_mxfp4(&m.view(), &act, 0..rows, &mut got).unwrap();
                assert_eq!(got, want, "{}: mxfp4 [{rows}x{cols}]", k.tier());
            }
        }
    }
}

/// The VNNI tier is exact when every activation group is a multiple of its int8 step.
#[test]
fn vnni_exact_on_int8_representable_activations() {
    let Ok(k) = Kernels::new(Tier::Avx512Vnni) else {
        eprintln!("note: no avx512-vnni tier on this CPU; skipped");
        return;
    };
    let mut rng = Rng::new(11);
    let (rows, cols) = (11, 3584);
    let m = OwnedMx::random(&mut rng, rows, cols, 126, 128);
    // Each group holds ±127 once, so d = 1 and every value is an integer: exactly representable.
    let x: Vec<f32> = (0..cols)
        .map(|c| {
            if c % 32 == 5 {
                127.0
            } else {
                rng.below(255) as f32 - 127.0
            }
        })
        .collect();
    let scalar = Kernels::scalar();
    let mut want = vec![0.0; rows];
    scalar
        .matmul_mxfp4(
            &m.view(),
            &scalar.prepare(&x, cols).unwrap(),
            0..rows,
            &mut want,
        )
        .unwrap();
    let mut got = vec![0.0; rows];
    k.matmul_mxfp4(&m.view(), &k.prepare(&x, cols).unwrap(), 0..rows, &mut got)
        .unwrap();
    assert_eq!(got, want);
}

#[test]
fn k3_shapes_within_bound() {
    // Expert gate/up [3072 x 3584] and down [3584 x 3072], a slice of rows each; GEMVs on
    // these widths run the kernel copies compiled for them.
    check_mxfp4_matmul(1, 24, 3584 / 32, 1, 118, 124);
    check_mxfp4_matmul(2, 24, 3072 / 32, 1, 118, 124);
    check_mxfp4_matmul(2, 19, 3072 / 32, 3, 118, 124);
    check_bf16_matmul(3, 19, 7168, 1);
    check_bf16_matmul(4, 12, 7168, 2);
    check_bf16_matmul(5, 21, 512, 1);
    check_bf16_matmul(6, 21, 1024, 1);
}

/// GEMMs of more than 4 tokens run token groups over stretches of rows (16 rows of 7168-wide
/// BF16, 48 of MXFP4): ranges that start mid-stretch and end in a row tail still give the
/// GEMV's bits at the caller's offsets.
#[test]
fn token_groups_over_stretches_batch_invariant() {
    for (seed, tokens, split) in [
        (20u64, 5usize, 30usize),
        (21, 9, 11),
        (22, 13, 47),
        (23, 16, 1),
    ] {
        check_batch_invariance(seed, 100, 7168 / 32, tokens, split);
    }
}

/// The GEMV copies compiled for K3's widths (and k3-0.40b's 1024) and the generic GEMM give
/// the same bits.
#[test]
fn k3_widths_batch_invariant() {
    check_batch_invariance(6, 37, 3584 / 32, 3, 20);
    check_batch_invariance(7, 19, 3072 / 32, 2, 8);
    // 256-2048 (and 1000) also run the short-row GEMV block (8 rows; 21 rows leave a tail).
    for (seed, cols) in [
        (8u64, 7168usize),
        (9, 12288),
        (10, 512),
        (11, 1024),
        (12, 1000),
        (13, 256),
        (14, 2048),
    ] {
        let mut rng = Rng::new(seed);
        let rows = 21;
        let bytes = random_bf16(&mut rng, rows * cols);
        let m = Bf16Matrix::new(&bytes, rows, cols).unwrap();
        let x = random_vec(&mut rng, 3 * cols);
        for k in tiers() {
            let mut batch = vec![0.0; 3 * rows];
            k.matmul_bf16(&m, &k.prepare(&x, cols).unwrap(), 0..rows, &mut batch)
                .unwrap();
            for t in 0..3 {
                let mut one = vec![0.0; rows];
                k.matmul_bf16(
                    &m,
                    &k.prepare(&x[t * cols..(t + 1) * cols], cols).unwrap(),
                    0..rows,
                    &mut one,
                )
                .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&batch[t * rows..(t + 1) * rows]),
                    bits(&one),
                    "{}: bf16 width {cols} token {t}",
                    k.tier()
                );
            }
        }
    }
}

#[test]
fn situ_bit_identical_across_tiers_and_accurate() {
    let mut rng = Rng::new(5);
    let n = 4096 + 7; // a tail after the vectors
    let mut gate: Vec<f32> = (0..n).map(|_| rng.unit() * 30.0).collect();
    let mut up: Vec<f32> = (0..n).map(|_| rng.unit() * 200.0).collect();
    // Edges: zeros of both signs, tiny, the series/exp switch, saturation, clamp limits.
    let edges = [
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        0.549_999_9,
        0.55,
        -0.55,
        2.2,
        87.0,
        -87.5,
        100.0,
        -100.0,
        1e6,
    ];
    gate[..edges.len()].copy_from_slice(&edges);
    up[..edges.len()].copy_from_slice(&edges);
    for situ in [
        Situ::K3,
        Situ {
            beta: 4.0,
            linear_beta: None,
        },
    ] {
        let mut want = vec![0.0; n];
        situ.apply(&Kernels::scalar(), &gate, &up, &mut want)
            .unwrap();
        for k in tiers() {
            let mut got = vec![0.0; n];
            situ.apply(&k, &gate, &up, &mut got).unwrap();
            for i in 0..n {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "{}: situ({}, {})",
                    k.tier(),
                    gate[i],
                    up[i]
                );
            }
        }
        for i in 0..n {
            let (g, u) = (f64::from(gate[i]), f64::from(up[i]));
            let linear = match situ.linear_beta {
                Some(b) => f64::from(b) * (u / f64::from(b)).tanh(),
                None => u,
            };
            let exact = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * linear;
            let err = (f64::from(want[i]) - exact).abs();
            // ~a dozen roundings of 2^-24 each; the exp clamp at 88 keeps sigmoid(g) >= 6.06e-39,
            // an absolute error of at most 4 * 6.06e-39 * |linear| for very negative gates; 1e-40
            // covers results that underflow f32 (subnormals lose relative precision).
            assert!(
                err <= 2e-6 * exact.abs() + 4.0 * 6.06e-39 * linear.abs() + 1e-40,
                "situ({g}, {u}) = {} vs {exact}",
                want[i]
            );
        }
    }
}

#[test]
fn elementary_functions_accurate() {
    use mxfp4_kernels::vmath::{exp, sigmoid, softplus, tanh};
    let mut max_rel = [0.0f64; 3];
    for i in -200_000..=200_000 {
        let a = i as f32 * 4.3e-4; // [-86, 86]
        let e = f64::from(a).exp();
        max_rel[0] = max_rel[0].max((f64::from(exp(a)) - e).abs() / e);
        let t = f64::from(a / 10.0).tanh();
        if t != 0.0 {
            max_rel[1] = max_rel[1].max((f64::from(tanh(a / 10.0)) - t).abs() / t.abs());
        }
        let s = 1.0 / (1.0 + (-f64::from(a / 4.0)).exp());
        max_rel[2] = max_rel[2].max((f64::from(sigmoid(a / 4.0)) - s).abs() / s);
    }
    // Relative error of a few ulp (1 ulp ≈ 6e-8 .. 1.2e-7).
    assert!(
        max_rel.iter().all(|&e| e < 5e-7),
        "max relative errors exp/tanh/sigmoid: {max_rel:?}"
    );
    // softplus against ln(1 + e^a) in f64, relative, over the range KDA's gate sees and past
    // both ends (e^a underflowing, and the linear branch above 20).
    let mut softplus_rel = 0.0f64;
    for i in -60_000..=60_000 {
        let a = i as f32 * 1.5e-3; // [-90, 90]
        let want = if a > 20.0 {
            f64::from(a)
        } else {
            f64::from(a).exp().ln_1p()
        };
        if want > 1e-37 {
            softplus_rel = softplus_rel.max((f64::from(softplus(a)) - want).abs() / want);
        }
    }
    assert!(
        softplus_rel < 5e-7,
        "softplus max relative error {softplus_rel:e}"
    );
    assert_eq!(tanh(0.0), 0.0);
    assert_eq!(tanh(-0.0), 0.0);
    assert_eq!(tanh(50.0), 1.0);
    assert_eq!(tanh(-50.0), -1.0);
}

/// The slice forms of exp, sigmoid and softplus give the scalar functions' bits in every
/// tier, tails (lengths that are not a multiple of 16) and edge values included.
#[test]
fn exp_and_sigmoid_slices_match_scalar_bitwise() {
    use mxfp4_kernels::vmath::{exp, sigmoid, softplus};
    let mut values: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.0237).collect();
    values.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        88.5,
        -88.5,
        200.0,
        -200.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
    ]);
    for k in tiers() {
        for len in [values.len(), values.len() - 5, 7] {
            let mut e = values[..len].to_vec();
            k.exp_in_place(&mut e);
            let mut s = values[..len].to_vec();
            k.sigmoid_in_place(&mut s);
            let mut p = values[..len].to_vec();
            k.softplus_in_place(&mut p);
            for (i, &x) in values[..len].iter().enumerate() {
                assert_eq!(e[i].to_bits(), exp(x).to_bits(), "{}: exp({x})", k.tier());
                let (got, want) = (p[i].to_bits(), softplus(x).to_bits());
                assert_eq!(got, want, "{}: softplus({x})", k.tier());
                assert_eq!(
                    s[i].to_bits(),
                    sigmoid(x).to_bits(),
                    "{}: sigmoid({x})",
                    k.tier()
                );
            }
        }
    }
}

#[test]
fn expert_ffn_matches_composition_and_is_batch_invariant() {
    let mut rng = Rng::new(9);
    let (hidden, latent) = (96, 128);
    let gate = OwnedMx::random(&mut rng, hidden, latent, 120, 126);
    let up = OwnedMx::random(&mut rng, hidden, latent, 120, 126);
    let down = OwnedMx::random(&mut rng, latent, hidden, 120, 126);
    let tokens = 5;
    let z = random_vec(&mut rng, tokens * latent);
    let situ = Situ::K3;
    // Scalar expert == scalar matmuls + SiTU, composed by hand.
    let s = Kernels::scalar();
    let za = s.prepare(&z, latent).unwrap();
    let (mut g, mut u) = (vec![0.0; tokens * hidden], vec![0.0; tokens * hidden]);
    s.matmul_mxfp4(&gate.view(), &za, 0..hidden, &mut g)
        .unwrap();
    s.matmul_mxfp4(&up.view(), &za, 0..hidden, &mut u).unwrap();
    let h: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| situ.eval(a, b)).collect();
    let mut composed = vec![0.0; tokens * latent];
    s.matmul_mxfp4(
        &down.view(),
        &s.prepare(&h, hidden).unwrap(),
        0..latent,
        &mut composed,
    )
    .unwrap();
    let mut scratch = ExpertScratch::default();
    let mut scalar_out = vec![0.0; tokens * latent];
    s.expert_ffn(
        &gate.view(),
        &up.view(),
        &down.view(),
        &situ,
        &za,
        &mut scratch,
        &mut scalar_out,
    )
    .unwrap();
    assert_eq!(scalar_out, composed);
    for k in tiers() {
        let act = k.prepare(&z, latent).unwrap();
        let mut out = vec![0.0; tokens * latent];
        k.expert_ffn(
            &gate.view(),
            &up.view(),
            &down.view(),
            &situ,
            &act,
            &mut scratch,
            &mut out,
        )
        .unwrap();
        for t in 0..tokens {
            let single = k.prepare(&z[t * latent..(t + 1) * latent], latent).unwrap();
            let mut one = vec![0.0; latent];
            k.expert_ffn(
                &gate.view(),
                &up.view(),
                &down.view(),
                &situ,
                &single,
                &mut scratch,
                &mut one,
            )
            .unwrap();
            for i in 0..latent {
                assert_eq!(
                    out[t * latent + i].to_bits(),
                    one[i].to_bits(),
                    "{}: token {t} out {i}",
                    k.tier()
                );
            }
        }
        // Relative L2 distance to scalar. Exact tiers: summation order only (~1e-7). BF16: 2^-9
        // activation rounding, twice. VNNI: int8 steps of max|group|/127 on z and on the SiTU
        // output, whose heavy tail (|h| up to 100) makes small elements coarse: a few percent.
        let diff: f64 = out
            .iter()
            .zip(&scalar_out)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let norm: f64 = scalar_out.iter().map(|b| f64::from(*b).powi(2)).sum();
        let rel_l2 = (diff / norm).sqrt();
        let allowed = match k.tier() {
            Tier::Scalar | Tier::Avx2 | Tier::Avx512 => 1e-6,
            Tier::Avx512Bf16 => 1e-2,
            Tier::Avx512Vnni => 6e-2,
        };
        eprintln!(
            "{}: expert FFN relative L2 deviation from scalar {rel_l2:.2e}",
            k.tier()
        );
        assert!(
            rel_l2 <= allowed,
            "{}: expert deviates by relative L2 {rel_l2:e}",
            k.tier()
        );
    }
}
