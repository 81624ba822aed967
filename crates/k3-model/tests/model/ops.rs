//! The forward-pass primitives against straightforward f64 transcriptions of docs/MODEL.md's
//! formulas, plus the properties the spec calls out (identity mix, bias for selection only,
//! ties to the lower id, the gate ranges).

use k3_model::config::KdaGate;
use k3_model::ops::*;
use k3_testkit::Rng;
use mxfp4_kernels::Kernels;

/// `n` values uniform in [-1, 1).
fn randoms(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.unit()).collect()
}

fn close(a: f32, b: f64, rel: f64) -> bool {
    (f64::from(a) - b).abs() <= rel * b.abs().max(1e-30) + 1e-12
}

#[test]
fn dot_is_within_the_summation_bound_and_fixed_in_order() {
    for n in [0usize, 1, 15, 16, 17, 128, 512, 1000] {
        let a = randoms(n as u64 + 1, n);
        let b = randoms(n as u64 + 99, n);
        let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let magnitude: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        // Each term passes through at most n/16 + 4 roundings (the lane's fused multiply-adds,
        // then the tree's additions).
        let bound = ((n / 16 + 5) as f64) * f32::EPSILON as f64 * magnitude;
        let got = dot(&a, &b);
        assert!(
            (got as f64 - exact).abs() <= bound,
            "n {n}: {got} vs {exact}"
        );
        // The order is lane-interleaved, each product fused into its lane: the same bits as a
        // sum written out that way.
        let mut lanes = [0.0f32; 16];
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            lanes[i % 16] = x.mul_add(*y, lanes[i % 16]);
        }
        for width in [8, 4, 2, 1] {
            for i in 0..width {
                lanes[i] += lanes[i + width];
            }
        }
        assert_eq!(got.to_bits(), lanes[0].to_bits(), "n {n}");
    }
    // Integer-valued data sums exactly.
    let a: Vec<f32> = (0..100).map(|i| (i % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..100).map(|i| (i % 5) as f32).collect();
    let exact: i64 = (0..100).map(|i| ((i % 7) - 3) * (i % 5)).sum();
    assert_eq!(dot(&a, &b), exact as f32);
}

#[test]
fn rms_norm_matches_f64() {
    let x = randoms(1, 777);
    let w = randoms(2, 777);
    let mut out = vec![0.0; 777];
    rms_norm(&x, Some(&w), 1e-5, &mut out);
    let mean: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / 777.0;
    let inv = 1.0 / (mean + 1e-5).sqrt();
    for i in 0..777 {
        assert!(
            close(out[i], f64::from(w[i]) * f64::from(x[i]) * inv, 1e-6),
            "{i}"
        );
    }
    rms_norm(&x, None, 1e-5, &mut out);
    assert!(close(out[5], f64::from(x[5]) * inv, 1e-6));
}

#[test]
fn l2_norm_gives_unit_vectors() {
    let mut x = randoms(3, 128);
    l2_norm(&mut x);
    let norm: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    let mut zero = vec![0.0f32; 8];
    l2_norm(&mut zero);
    assert!(
        zero.iter().all(|&v| v == 0.0),
        "eps keeps a zero vector finite"
    );
}

#[test]
fn attn_res_mix_matches_f64_and_is_identity_with_one_candidate() {
    let d = 256;
    let cands: Vec<Vec<f32>> = (0..5)
        .map(|i| {
            randoms(10 + i, d)
                .iter()
                .map(|v| v * (1.0 + i as f32))
                .collect()
        })
        .collect();
    let score = randoms(20, d);
    let refs: Vec<&[f32]> = cands.iter().map(Vec::as_slice).collect();
    let mut out = vec![0.0; d];
    attn_res_mix(&refs[..1], &score, 1e-5, &mut out);
    assert_eq!(out, cands[0], "one candidate: exactly itself");
    attn_res_mix(&refs, &score, 1e-5, &mut out);
    let logits: Vec<f64> = cands
        .iter()
        .map(|v| {
            let inv = 1.0
                / (v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>() / d as f64 + 1e-5).sqrt();
            v.iter()
                .zip(&score)
                .map(|(&a, &s)| f64::from(a) * inv * f64::from(s))
                .sum()
        })
        .collect();
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = logits.iter().map(|l| (l - max).exp()).sum();
    for i in 0..d {
        let want: f64 = cands
            .iter()
            .zip(&logits)
            .map(|(v, l)| (l - max).exp() / total * f64::from(v[i]))
            .sum();
        assert!(
            (f64::from(out[i]) - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "{i}: {} vs {want}",
            out[i]
        );
    }
}

#[test]
fn router_selects_with_bias_and_weighs_without_it() {
    // Expert 3 has the best raw score, but expert 1's bias lifts it into the top 2.
    let logits = [0.0, 0.1, -1.0, 2.0, 0.5];
    let bias = [0.0, 1.0, 0.0, 0.0, 0.0];
    let (ids, weights) = route(&logits, &bias, 2, true, 2.5);
    assert_eq!(ids, [1, 3]);
    let (s1, s3) = (1.0 / (1.0 + (-0.1f64).exp()), 1.0 / (1.0 + (-2.0f64).exp()));
    assert!(
        close(weights[0], 2.5 * s1 / (s1 + s3), 1e-6)
            && close(weights[1], 2.5 * s3 / (s1 + s3), 1e-6)
    );
    // Exact ties go to the lower id; top-1 is not renormalised.
    let (ids, weights) = route(&[0.3, 0.3, 0.3], &[0.0; 3], 1, true, 1.0);
    assert_eq!(ids, [0]);
    assert!(close(weights[0], 1.0 / (1.0 + (-0.3f64).exp()), 1e-6));
}

#[test]
fn gate_forms_and_their_ranges() {
    for z in [-30.0f32, -2.0, 0.0, 0.7, 25.0] {
        for a_log in [-1.0f32, 0.0, 1.5] {
            let k3 = kda_log_decay(KdaGate::LowerBound(-5.0), a_log, z);
            assert!((-5.0..=0.0).contains(&k3), "K3 form in (lb, 0): {k3}");
            let want = -5.0 / (1.0 + (-(f64::from(a_log).exp() * f64::from(z))).exp());
            assert!(close(k3, want, 1e-6) || (k3 - want as f32).abs() < 1e-6);
            let kl = kda_log_decay(KdaGate::Softplus, a_log, z);
            let sp = if z > 20.0 {
                f64::from(z)
            } else {
                f64::from(z).exp().ln_1p()
            };
            assert!(close(kl, -f64::from(a_log).exp() * sp, 1e-6), "{kl}");
        }
    }
    assert_eq!(softplus(25.0), 25.0);
}

/// The vectorised decays, SiLU and sigmoid give the scalar functions' bits in every tier (K3's
/// bounded gate and Kimi-Linear's softplus one; lengths that leave a tail).
#[test]
fn slice_forms_match_scalar_bitwise() {
    let dim = 24;
    let a_log = [-1.0f32, 0.0, 0.7, 1.5, -0.3];
    let z: Vec<f32> = randoms(50, a_log.len() * dim)
        .iter()
        .map(|v| 12.0 * v)
        .collect();
    for kernels in Kernels::available() {
        for gate in [KdaGate::LowerBound(-5.0), KdaGate::Softplus] {
            let mut got = z.clone();
            kda_decays_in_place(&kernels, gate, &a_log, dim, &mut got);
            for (c, (&g, &zc)) in got.iter().zip(&z).enumerate() {
                let want = mxfp4_kernels::vmath::exp(kda_log_decay(gate, a_log[c / dim], zc));
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "{:?} {gate:?} channel {c}",
                    kernels.tier()
                );
            }
        }
        let (mut s, mut u) = (z.clone(), z.clone());
        kernels.sigmoid_in_place(&mut s);
        silu_in_place(&kernels, &mut u);
        for (i, &x) in z.iter().enumerate() {
            assert_eq!(s[i].to_bits(), sigmoid(x).to_bits(), "sigmoid({x})");
            assert_eq!(u[i].to_bits(), silu(x).to_bits(), "silu({x})");
        }
    }
}

#[test]
fn conv_step_is_a_causal_depthwise_conv() {
    let (channels, taps, steps) = (5, 4, 9);
    let weights = randoms(30, channels * taps);
    let inputs: Vec<Vec<f32>> = (0..steps)
        .map(|t| randoms(40 + t as u64, channels))
        .collect();
    let mut window = vec![0.0; channels * (taps - 1)];
    let mut out = vec![0.0; channels];
    for t in 0..steps {
        conv_step(&inputs[t], &weights, taps, &mut window, &mut out);
        for c in 0..channels {
            // Zero left padding; the last tap multiplies the current token.
            let acc: f64 = (0..taps)
                .filter_map(|j| {
                    (t + j + 1)
                        .checked_sub(taps)
                        .map(|s| f64::from(weights[c * taps + j]) * f64::from(inputs[s][c]))
                })
                .sum();
            // Before the SiLU, which the caller applies (`silu_in_place`).
            assert!((f64::from(out[c]) - acc).abs() < 1e-6, "t {t} c {c}");
        }
    }
}

#[test]
fn kda_step_matches_the_closed_form() {
    let (kd, vd) = (6, 5);
    let mut state = vec![0.0f32; kd * vd];
    let mut reference = vec![0.0f64; kd * vd];
    let mut out = vec![0.0; vd];
    for t in 0..7u64 {
        let q = randoms(100 + t, kd);
        let k = randoms(200 + t, kd);
        let v = randoms(300 + t, vd);
        let alpha: Vec<f32> = randoms(400 + t, kd)
            .iter()
            .map(|a| 0.5 + 0.5 * a.abs())
            .collect();
        let beta = 0.3 + 0.1 * t as f32;
        kda_step(&mut state, &q, &k, &v, &alpha, beta, &mut out);
        // S_t = (I - β k kᵀ) Diag(α) S_{t-1} + β k vᵀ;  o = S_tᵀ q.
        let decayed: Vec<f64> = (0..kd * vd)
            .map(|i| f64::from(alpha[i / vd]) * reference[i])
            .collect();
        for i in 0..kd {
            for j in 0..vd {
                let ktds: f64 = (0..kd).map(|m| f64::from(k[m]) * decayed[m * vd + j]).sum();
                reference[i * vd + j] = decayed[i * vd + j]
                    - f64::from(beta) * f64::from(k[i]) * ktds
                    + f64::from(beta) * f64::from(k[i]) * f64::from(v[j]);
            }
        }
        for j in 0..vd {
            let want: f64 = (0..kd)
                .map(|i| f64::from(q[i]) * reference[i * vd + j])
                .sum();
            assert!(
                (f64::from(out[j]) - want).abs() < 1e-5,
                "step {t} out {j}: {} vs {want}",
                out[j]
            );
        }
    }
}
