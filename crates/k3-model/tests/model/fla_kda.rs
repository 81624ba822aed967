//! Our KDA primitives against flash-linear-attention's pure-PyTorch references (fla-core 0.6.0):
//! `kda_log_decay` against `naive_kda_lowerbound_gate` (K3) and `naive_kda_gate` (Kimi-Linear),
//! and `l2_norm` + `kda_step` against `naive_recurrent_kda`, on small random inputs with K ≠ V.
//! The vector is frozen in `tests/data/fla_kda` by `cargo xtask oracle-fla-kda`, which records
//! its exact command and package versions.

use k3_model::config::KdaGate;
use k3_model::ops::{kda_log_decay, kda_step, l2_norm, sigmoid};

use crate::frozen::read_frozen;

const FILE: &str = "kda.json";
/// The forward-pass acceptance: the KDA vector matches fla to ≤ 1e-5 relative to its largest
/// magnitude.
const REL_TOL: f32 = 1e-5;
/// Gates are compared element by element: relative, with a floor for values near zero.
const GATE_REL_TOL: f32 = 1e-6;
const GATE_ABS_FLOOR: f32 = 1e-9;

/// f32 values from the hex of their little-endian bits; `len` is the expected count.
fn f32s(value: &serde_json::Value, what: &str, len: usize) -> Vec<f32> {
    let hex = value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string"));
    assert_eq!(hex.len(), len * 8, "{what}: wrong length");
    hex.as_bytes()
        .chunks_exact(8)
        .map(|word| {
            let word = std::str::from_utf8(word).unwrap();
            let byte = |i: usize| u8::from_str_radix(&word[2 * i..2 * i + 2], 16).unwrap();
            f32::from_le_bytes([byte(0), byte(1), byte(2), byte(3)])
        })
        .collect()
}

/// Max |a − b| over the pair, after checking both are finite and of equal length.
fn max_abs_diff(ours: &[f32], theirs: &[f32], what: &str) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    ours.iter()
        .zip(theirs)
        .map(|(&a, &b)| {
            assert!(
                a.is_finite() && b.is_finite(),
                "{what}: non-finite {a} / {b}"
            );
            (a - b).abs()
        })
        .fold(0.0, f32::max)
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().map(|v| v.abs()).fold(0.0, f32::max)
}

#[test]
fn kda_gates_and_recurrence_match_fla_naive() {
    let bytes = read_frozen("fla_kda", FILE, "cargo xtask oracle-fla-kda");
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(json["packages"]["fla-core"], "0.6.0");
    let dim = |name: &str| json["shape"][name].as_u64().unwrap() as usize;
    let (t_len, heads, kd, vd) = (dim("T"), dim("H"), dim("K"), dim("V"));
    assert!(t_len >= 8 && heads >= 2 && kd >= 8 && vd >= 8 && kd != vd);

    let inputs = &json["inputs"];
    let input = |name: &str, len: usize| f32s(&inputs[name], name, len);
    let q_raw = input("q_raw", t_len * heads * kd);
    let k_raw = input("k_raw", t_len * heads * kd);
    let q_l2 = input("q_l2", t_len * heads * kd);
    let k_l2 = input("k_l2", t_len * heads * kd);
    let v = input("v", t_len * heads * vd);
    let f = input("f", t_len * heads * kd);
    let dt_bias = input("dt_bias", heads * kd);
    let a_log = input("a_log", heads);
    let beta_logit = input("beta_logit", t_len * heads);
    let beta_fla = input("beta", t_len * heads);
    let scale = f32s(&json["scale"], "scale", 1)[0];
    assert_eq!(scale, (kd as f32).powf(-0.5));

    // q and k: our l2_norm against fla's formula, per (t, h) row of K.
    let mut q = q_raw.clone();
    let mut k = k_raw.clone();
    q.chunks_exact_mut(kd).for_each(l2_norm);
    k.chunks_exact_mut(kd).for_each(l2_norm);
    let norm_err = max_abs_diff(&q, &q_l2, "q_l2").max(max_abs_diff(&k, &k_l2, "k_l2"));
    assert!(norm_err <= 1e-6, "l2_norm differs from fla's by {norm_err}");
    q.iter_mut().for_each(|x| *x *= scale);

    // β: ours against torch.sigmoid.
    let beta: Vec<f32> = beta_logit.iter().map(|&x| sigmoid(x)).collect();
    let beta_err = max_abs_diff(&beta, &beta_fla, "beta");
    assert!(
        beta_err <= 1e-6,
        "sigmoid β differs from torch's by {beta_err}"
    );

    let cases = json["cases"].as_array().unwrap();
    let names: Vec<&str> = cases.iter().map(|c| c["gate"].as_str().unwrap()).collect();
    assert_eq!(names, ["lower_bound", "softplus"]);
    let mut compared = 0usize;
    for case in cases {
        let name = case["gate"].as_str().unwrap();
        let gate = match name {
            "lower_bound" => KdaGate::LowerBound(case["lower_bound"].as_f64().unwrap() as f32),
            "softplus" => KdaGate::Softplus,
            other => panic!("unknown gate form {other}"),
        };
        let g_fla = f32s(&case["g"], "g", t_len * heads * kd);
        let o_fla = f32s(&case["o"], "o", t_len * heads * vd);
        let s_fla = f32s(&case["final_state"], "final_state", heads * kd * vd);

        // g[t,h,d] = gate(A_log[h], f[t,h,d] + dt_bias[h*K + d]): A_log per head.
        let g: Vec<f32> = (0..t_len * heads * kd)
            .map(|i| {
                let (h, d) = ((i / kd) % heads, i % kd);
                kda_log_decay(gate, a_log[h], f[i] + dt_bias[h * kd + d])
            })
            .collect();
        let mut g_worst = 0.0f32;
        for (i, (&ours, &theirs)) in g.iter().zip(&g_fla).enumerate() {
            assert!(ours.is_finite() && theirs.is_finite() && theirs < 0.0);
            let err = (ours - theirs).abs() / theirs.abs().max(GATE_ABS_FLOOR);
            assert!(
                (ours - theirs).abs() <= GATE_REL_TOL * theirs.abs() + GATE_ABS_FLOOR,
                "{name}: g[{i}] = {ours}, fla {theirs}"
            );
            g_worst = g_worst.max(err);
        }
        compared += g.len();

        // The recurrence, per head, state [K][V] zero-initialised, α = exp(our g).
        let mut state = vec![0.0f32; heads * kd * vd];
        let mut o = vec![0.0f32; t_len * heads * vd];
        for t in 0..t_len {
            for h in 0..heads {
                let kr = (t * heads + h) * kd..(t * heads + h + 1) * kd;
                let vr = (t * heads + h) * vd..(t * heads + h + 1) * vd;
                let alpha: Vec<f32> = g[kr.clone()].iter().map(|x| x.exp()).collect();
                kda_step(
                    &mut state[h * kd * vd..(h + 1) * kd * vd],
                    &q[kr.clone()],
                    &k[kr],
                    &v[vr.clone()],
                    &alpha,
                    beta[t * heads + h],
                    &mut o[vr],
                );
            }
        }
        let o_scale = max_abs(&o_fla);
        let s_scale = max_abs(&s_fla);
        assert!(
            o_scale > 0.05 && s_scale > 0.05,
            "{name}: a degenerate vector"
        );
        let o_rel = max_abs_diff(&o, &o_fla, "o") / o_scale;
        let s_rel = max_abs_diff(&state, &s_fla, "final_state") / s_scale;
        eprintln!(
            "fla {name}: g max rel {g_worst:.2e}, o max |Δ|/max|o| {o_rel:.2e}, \
             final state max |Δ|/max|S| {s_rel:.2e}"
        );
        assert!(
            o_rel <= REL_TOL,
            "{name}: outputs differ by {o_rel} relative"
        );
        assert!(
            s_rel <= REL_TOL,
            "{name}: final state differs by {s_rel} relative"
        );
        compared += o.len() + state.len();
    }
    // Two forms × (g + o + final state): nothing above can have passed on empty data.
    assert_eq!(
        compared,
        2 * (t_len * heads * kd + t_len * heads * vd + heads * kd * vd)
    );
}
