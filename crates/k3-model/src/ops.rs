//! The forward pass's element-wise and per-head primitives, in the engine's canonical f32 order
//! (docs/MODEL.md §5, §6, §8.2): RMSNorm, the KDA L2 norm, the AttnRes depth mix, the sigmoid router,
//! both KDA decay-gate forms, the causal depthwise conv step and the KDA delta-rule step.
//!
//! Canonical order: every reduction over a vector runs in a fixed order: interleaved partial
//! sums (16 for f32, 8 for f64: element `i` into sum `i % lanes`, in order), then a fixed
//! pairwise tree. The compiler vectorises that order; a single running sum would be one
//! latency-bound chain. Sums of squares are in f64, as colibri does, so the norm does not
//! depend on the vector's length. The results are the same whatever the thread count or batch,
//! and prefill equals token-by-token decode.

use mxfp4_kernels::Kernels;
use mxfp4_kernels::vmath::exp;

use crate::config::KdaGate;

/// `w ⊙ x · 1/sqrt(mean(x²) + eps)`; `weight` of `None` is the unweighted form AttnRes uses.
#[inline(always)]
pub fn rms_norm(x: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    match weight {
        Some(w) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = g * (v * inv);
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v * inv;
            }
        }
    }
}

/// `Σ a_i b_i` in the canonical f32 order (module docs), each product fused into its lane's
/// sum: `lane = a_i.mul_add(b_i, lane)`, one rounding per term (an FMA instruction where the
/// code is compiled for FMA, as the MLA attention that calls this is; the correctly rounded
/// library function elsewhere, so the bits are the same on every CPU).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    lane_sum(a, b, |lane, x, y| x.mul_add(y, lane))
}

/// `Σ a_i b_i`-style sums in 16 interleaved f32 partial sums and a fixed tree (module docs):
/// element `i` goes into lane `i % 16` as `lane = step(lane, a_i, b_i)`. Tails past a
/// multiple of 16 go to their lane like the rest.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], step: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; 16];
    let (a16, a_tail) = a.split_at(a.len() / 16 * 16);
    let (b16, b_tail) = b.split_at(a16.len());
    for (x, y) in a16.chunks_exact(16).zip(b16.chunks_exact(16)) {
        for i in 0..16 {
            lanes[i] = step(lanes[i], x[i], y[i]);
        }
    }
    for (i, (&x, &y)) in a_tail.iter().zip(b_tail).enumerate() {
        lanes[i] = step(lanes[i], x, y);
    }
    tree_sum(lanes)
}

/// `Σ x_i²` in f64 (each square exact), in 8 interleaved partial sums and a fixed tree.
#[inline(always)]
fn sum_squares(x: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let (x8, tail) = x.split_at(x.len() / 8 * 8);
    for chunk in x8.chunks_exact(8) {
        for i in 0..8 {
            lanes[i] += f64::from(chunk[i]) * f64::from(chunk[i]);
        }
    }
    for (i, &v) in tail.iter().enumerate() {
        lanes[i] += f64::from(v) * f64::from(v);
    }
    tree_sum(lanes)
}

/// The fixed pairwise tree over `N` partial sums (module docs): lane `i` takes lane
/// `i + N/2`, then `i + N/4`, ..., down to lane 0.
#[inline(always)]
fn tree_sum<T: Copy + std::ops::AddAssign, const N: usize>(mut lanes: [T; N]) -> T {
    let mut width = N;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            let upper = lanes[i + width];
            lanes[i] += upper;
        }
    }
    lanes[0]
}

/// `1/sqrt(mean(x²) + eps)`, the square sum in f64.
#[inline(always)]
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    (1.0 / (sum_squares(x) / x.len() as f64 + f64::from(eps)).sqrt()) as f32
}

/// KDA's L2 norm of one head, in place: `x · 1/sqrt(Σx² + 1e-6)` (fla's eps inside the sqrt;
/// docs/MODEL.md §5 follows fla over llama.cpp's 1e-5).
#[inline(always)]
pub fn l2_norm(x: &mut [f32]) {
    let inv = (1.0 / (sum_squares(x) + 1e-6).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The AttnRes mix of `candidates` (block snapshots in creation order, the current stream
/// last): scores `<rms_norm(V_i) (no weight), score>` with `score = norm.w ⊙ proj.w`, softmax
/// over candidates, and the weighted sum of the **raw** candidates. With one candidate the
/// result is that candidate exactly.
#[inline(always)]
pub fn attn_res_mix(candidates: &[&[f32]], score: &[f32], eps: f32, out: &mut [f32]) {
    if let [only] = candidates {
        out.copy_from_slice(only);
        return;
    }
    let logits: Vec<f32> = candidates
        .iter()
        .map(|v| {
            let inv = inv_rms(v, eps);
            lane_sum(v, score, |lane, a, s| lane + (a * inv) * s)
        })
        .collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| exp(l - max)).collect();
    let total: f32 = exps.iter().fold(0.0, |a, &e| a + e);
    out.fill(0.0);
    for (v, &e) in candidates.iter().zip(&exps) {
        let p = e / total;
        for (o, &a) in out.iter_mut().zip(v.iter()) {
            *o += p * a;
        }
    }
}

/// The router's choice for one token (docs/MODEL.md §8.2): sigmoid scores, the selection bias added
/// for choosing only, the `top_k` highest (ties to the lower expert id), weights from the raw
/// scores, renormalised (`+ 1e-20`, when `renormalize` and `top_k > 1`) and scaled. Returns
/// `(expert ids in descending choice order, weights)`.
pub fn route(
    logits: &[f32],
    bias: &[f32],
    top_k: usize,
    renormalize: bool,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    let choice = |e: usize| scores[e] + bias[e];
    // Stable sort by descending choice keeps ascending ids among exact ties.
    order.sort_by(|&a, &b| choice(b).total_cmp(&choice(a)));
    order.truncate(top_k);
    let mut weights: Vec<f32> = order.iter().map(|&e| scores[e]).collect();
    if renormalize && top_k > 1 {
        let sum = weights.iter().fold(0.0f32, |a, &w| a + w) + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= scaling);
    (order, weights)
}

/// `1 / (1 + e^-x)`, on the engine's own exp (`mxfp4_kernels::vmath`), so
/// `Kernels::sigmoid_in_place` gives the same bits 16 at a time.
pub fn sigmoid(x: f32) -> f32 {
    mxfp4_kernels::vmath::sigmoid(x)
}

/// torch's softplus: `ln(1 + e^x)`, and `x` itself above 20 (`mxfp4_kernels::vmath`'s, so
/// the KDA gate's slice form gives the same bits).
pub fn softplus(x: f32) -> f32 {
    mxfp4_kernels::vmath::softplus(x)
}

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `x[i] = silu(x[i])`, vectorised where the kernels' tier is; the bits of [`silu`].
#[inline]
pub fn silu_in_place(kernels: &Kernels, x: &mut [f32]) {
    let mut gate = x.to_vec();
    kernels.sigmoid_in_place(&mut gate);
    x.iter_mut().zip(&gate).for_each(|(v, &s)| *v *= s);
}

/// The KDA log-decay of one channel from `z = f + dt_bias` and its head's `A_log`
/// (docs/MODEL.md §6.3): K3's bounded form `lb · sigmoid(exp(A_log) · z)`, or Kimi-Linear's
/// `-exp(A_log) · softplus(z)`. The decay itself is `exp(g)`.
pub fn kda_log_decay(gate: KdaGate, a_log: f32, z: f32) -> f32 {
    match gate {
        KdaGate::LowerBound(lb) => lb * sigmoid(exp(a_log) * z),
        KdaGate::Softplus => -exp(a_log) * softplus(z),
    }
}

/// The decays `exp(kda_log_decay(gate, a_log[c / dim], z[c]))` of a run of whole heads'
/// channels (`dim` per head, `a_log` per head), in place over `z`, with the bits of the scalar
/// functions, vectorised where the kernels' tier is.
#[inline]
pub fn kda_decays_in_place(
    kernels: &Kernels,
    gate: KdaGate,
    a_log: &[f32],
    dim: usize,
    z: &mut [f32],
) {
    match gate {
        KdaGate::LowerBound(lb) => {
            for (head, &a) in z.chunks_mut(dim).zip(a_log) {
                let rate = exp(a);
                head.iter_mut().for_each(|v| *v *= rate);
            }
            kernels.sigmoid_in_place(z);
            z.iter_mut().for_each(|v| *v *= lb);
            kernels.exp_in_place(z);
        }
        KdaGate::Softplus => {
            kernels.softplus_in_place(z);
            for (head, &a) in z.chunks_mut(dim).zip(a_log) {
                let rate = -exp(a);
                head.iter_mut().for_each(|v| *v *= rate);
            }
            kernels.exp_in_place(z);
        }
    }
}

/// One step of the causal depthwise conv for `channels` channels, before its SiLU (the caller
/// applies [`silu_in_place`] to a whole head group at once): `window` holds the previous
/// `taps - 1` inputs per channel, oldest first (`[channel][tap]`), `weights` is the
/// checkpoint's `[channels, 1, taps]`; the last tap multiplies the current input. The window
/// advances by one.
#[inline(always)]
pub fn conv_step(input: &[f32], weights: &[f32], taps: usize, window: &mut [f32], out: &mut [f32]) {
    let history = taps - 1;
    for (c, (&x, o)) in input.iter().zip(out.iter_mut()).enumerate() {
        let w = &weights[c * taps..(c + 1) * taps];
        let past = &mut window[c * history..(c + 1) * history];
        let mut acc = 0.0f32;
        for (j, &p) in past.iter().enumerate() {
            acc += w[j] * p;
        }
        acc += w[history] * x;
        *o = acc;
        past.copy_within(1.., 0);
        if let Some(last) = past.last_mut() {
            *last = x;
        }
    }
}

/// One KDA delta-rule step for one head (docs/MODEL.md §6.5), in the order decay → read → write →
/// output from the updated state. `state` is `[K][V]` row-major; `q` already carries the
/// `K^-0.5` scale; `alpha` is the per-key decay `exp(g)`; `beta` the head's write strength.
#[inline(always)]
pub fn kda_step(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: f32,
    out: &mut [f32],
) {
    let vdim = v.len();
    for (row, &a) in state.chunks_exact_mut(vdim).zip(alpha) {
        row.iter_mut().for_each(|s| *s *= a);
    }
    // u = kᵀ S, then Δ = β (v − u).
    let mut delta = vec![0.0f32; vdim];
    for (row, &kk) in state.chunks_exact(vdim).zip(k) {
        for (d, &s) in delta.iter_mut().zip(row) {
            *d += kk * s;
        }
    }
    for (d, &vv) in delta.iter_mut().zip(v) {
        *d = beta * (vv - *d);
    }
    for (row, &kk) in state.chunks_exact_mut(vdim).zip(k) {
        for (s, &d) in row.iter_mut().zip(&delta) {
            *s += kk * d;
        }
    }
    out.fill(0.0);
    for (row, &qq) in state.chunks_exact(vdim).zip(q) {
        for (o, &s) in out.iter_mut().zip(row) {
            *o += qq * s;
        }
    }
}
