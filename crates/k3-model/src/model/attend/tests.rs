//! `attend`'s tests: every score path and the blocked heads against the straightforward
//! loops, bit for bit.

use super::*;

/// One head's context by the straightforward loops the module docs name: `dot` for each
/// score, the softmax in position order, the weighted latents summed position by position
/// from 0.0 (each product fused into its sum), `dot` for the value rows.
fn one_head(d: &Dims, cache: &MlaCache, positions: usize, q: &[f32], rows: &[f32]) -> Vec<f32> {
    let (nope, rope, rank) = (d.nope, d.rope, d.rank);
    let mut q_abs = vec![0.0f32; rank];
    for i in 0..nope {
        for (a, &w) in q_abs.iter_mut().zip(&rows[i * rank..(i + 1) * rank]) {
            *a += q[i] * w;
        }
    }
    let mut scores: Vec<f32> = (0..positions)
        .map(|p| {
            (dot(&q_abs, &cache.latent[p * rank..(p + 1) * rank])
                + dot(&q[nope..], &cache.k_pe[p * rope..(p + 1) * rope]))
                * d.scale
        })
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s = mxfp4_kernels::vmath::exp(*s - max);
    }
    let total = scores.iter().fold(0.0f32, |a, &e| a + e);
    let mut latent = vec![0.0f32; rank];
    for (p, s) in scores.iter().enumerate() {
        let weight = s / total;
        for (a, &v) in latent
            .iter_mut()
            .zip(&cache.latent[p * rank..(p + 1) * rank])
        {
            *a = weight.mul_add(v, *a);
        }
    }
    let v_rows = &rows[nope * rank..];
    (0..v_rows.len() / rank)
        .map(|j| dot(&v_rows[j * rank..(j + 1) * rank], &latent))
        .collect()
}

/// `heads_context` gives every token and head the bits of the straightforward loops
/// (`one_head`), whether the tokens come alone or in groups (1, 2 and 3 consecutive tokens,
/// each attending to one more position than the last), with the cache read in blocks
/// (positions that fill none, one, and several blocks with a tail) and with each score path
/// this CPU has (the AVX-512 8-position kernel for a pair of heads and for a lone one, and its
/// two-head weighted latents in stripes of 32-position blocks, the AVX2 two-head 4-position and one-head 4-position kernels —
/// 3 heads are a pair and one alone — and plain `dot`), at k3-0.40b's widths and at widths
/// that are not multiples of 16.
#[test]
fn blocked_heads_give_each_heads_straightforward_bits() {
    let mut rng = fastrand::Rng::with_seed(5);
    #[cfg(target_arch = "x86_64")]
    let paths = [
        (false, false),
        (false, std::arch::is_x86_feature_detected!("avx2")),
        (std::arch::is_x86_feature_detected!("avx512f"), false),
    ];
    #[cfg(not(target_arch = "x86_64"))]
    let paths = [(false, false)];
    for (nope, rope, rank, v_dim) in [(64usize, 32usize, 128usize, 64usize), (8, 5, 24, 6)] {
        let heads = 3;
        let total = 73;
        let most = 3;
        let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-3..3));
        let cache = MlaCache {
            latent: (0..total * rank)
                .map(|_| value())
                .collect::<Vec<_>>()
                .into(),
            k_pe: (0..total * rope)
                .map(|_| value())
                .collect::<Vec<_>>()
                .into(),
        };
        let qs: Vec<Vec<f32>> = (0..most)
            .map(|_| (0..heads * (nope + rope)).map(|_| value()).collect())
            .collect();
        let rows: Vec<f32> = (0..heads * (nope + v_dim) * rank)
            .map(|_| value())
            .collect();
        for (avx512, avx2) in paths {
            let d = Dims {
                nope,
                rope,
                rank,
                scale: 0.09,
                avx512,
                avx2,
            };
            let mut buf = HeadBuffers::default();
            for (positions, tokens) in [
                (1usize, 1usize),
                (7, 2),
                (16, 1),
                (16, 3),
                (33, 2),
                (39, 3),
                (70, 2),
            ] {
                let q: Vec<&[f32]> = qs[..tokens].iter().map(Vec::as_slice).collect();
                let mut out = vec![0.0f32; tokens * heads * v_dim];
                let queries = HeadQueries { q: &q, rows: &rows };
                heads_context(&d, &cache, positions, queries, &mut out, &mut buf);
                for (t, q) in q.iter().enumerate() {
                    for h in 0..heads {
                        let want = one_head(
                            &d,
                            &cache,
                            positions + t,
                            &q[h * (nope + rope)..(h + 1) * (nope + rope)],
                            &rows[h * (nope + v_dim) * rank..(h + 1) * (nope + v_dim) * rank],
                        );
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let at = (t * heads + h) * v_dim;
                        assert_eq!(
                            bits(&out[at..at + v_dim]),
                            bits(&want),
                            "rank {rank}, token {t} of {tokens}, head {h}, {positions} positions, \
                             avx512 {avx512}, avx2 {avx2}"
                        );
                    }
                }
            }
        }
    }
}

/// The 4-position AVX2 scores have `ops::dot`'s bits, for K3's widths and k3-0.40b's.
#[cfg(target_arch = "x86_64")]
#[test]
fn four_scores_at_once_have_the_dot_bits() {
    if !std::arch::is_x86_feature_detected!("avx2") {
        eprintln!("no avx2 on this CPU: nothing to compare");
        return;
    }
    let mut rng = fastrand::Rng::with_seed(12);
    for (rank, rope) in [(128usize, 32usize), (512, 64), (16, 16)] {
        let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-8..8));
        let q: Vec<f32> = (0..rank).map(|_| value()).collect();
        let q_pe: Vec<f32> = (0..rope).map(|_| value()).collect();
        let latent: Vec<f32> = (0..4 * rank).map(|_| value()).collect();
        let pe: Vec<f32> = (0..4 * rope).map(|_| value()).collect();
        let scale = 0.0723;
        // SAFETY: avx2 was detected above.
        let got = unsafe { x86::scores4(&q, &q_pe, &latent, &pe, scale) };
        for l in 0..4 {
            let want = (dot(&q, &latent[l * rank..(l + 1) * rank])
                + dot(&q_pe, &pe[l * rope..(l + 1) * rope]))
                * scale;
            assert_eq!(got[l].to_bits(), want.to_bits(), "rank {rank}, row {l}");
        }
    }
}

/// The AVX2 two-head, 4-position scores give each head `ops::dot`'s bits, for K3's widths
/// and k3-0.40b's: the two heads' queries differ, so a mixed-up head or half would show.
#[cfg(target_arch = "x86_64")]
#[test]
fn two_heads_four_scores_at_once_have_the_dot_bits() {
    if !std::arch::is_x86_feature_detected!("avx2") {
        eprintln!("no avx2 on this CPU: nothing to compare");
        return;
    }
    let widths = [(128usize, 32usize), (512, 64), (16, 16)];
    // SAFETY: avx2 was detected above.
    check_pair_scores(13, &widths, |q, q_pe, latent, pe, scale| unsafe {
        x86::scores2x4(q, q_pe, latent, pe, scale)
    });
}

/// Checks a two-query kernel of `N` rows' scores against `(dot(q[h], latent[l]) + dot(q_pe[h],
/// pe[l])) * scale` at each `(rank, rope)` of `widths`, on values of mixed sign and magnitude.
#[cfg(target_arch = "x86_64")]
fn check_pair_scores<const N: usize>(
    seed: u64,
    widths: &[(usize, usize)],
    kernel: impl Fn([&[f32]; 2], [&[f32]; 2], &[f32], &[f32], f32) -> [[f32; N]; 2],
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for &(rank, rope) in widths {
        let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-8..8));
        let q: Vec<f32> = (0..2 * rank).map(|_| value()).collect();
        let q_pe: Vec<f32> = (0..2 * rope).map(|_| value()).collect();
        let latent: Vec<f32> = (0..N * rank).map(|_| value()).collect();
        let pe: Vec<f32> = (0..N * rope).map(|_| value()).collect();
        let scale = 0.0723;
        let (q, q_pe) = ([&q[..rank], &q[rank..]], [&q_pe[..rope], &q_pe[rope..]]);
        let got = kernel(q, q_pe, &latent, &pe, scale);
        for h in 0..2 {
            for l in 0..N {
                let want = (dot(q[h], &latent[l * rank..(l + 1) * rank])
                    + dot(q_pe[h], &pe[l * rope..(l + 1) * rope]))
                    * scale;
                assert_eq!(
                    got[h][l].to_bits(),
                    want.to_bits(),
                    "rank {rank}, head {h}, row {l} of {N}"
                );
            }
        }
    }
}

/// `weighted_rows` sums each value in position order from 0.0, as the loop over positions
/// with the whole vector per position did: the same bits, for widths that are and are not
/// multiples of its 64- and 32-value stripes (K3: rank 512; k3-0.40b: 128; 96 and 40 take
/// the 32-value stripes), in one call or a call per block of positions continuing the sums
/// (`heads_context`'s blocks).
#[test]
fn weighted_rows_keep_the_position_order() {
    let mut rng = fastrand::Rng::with_seed(7);
    for width in [128usize, 512, 96, 40, 33, 5] {
        for positions in [1usize, 2, 17, 100] {
            let weights: Vec<f32> = (0..positions).map(|_| rng.f32()).collect();
            let latent: Vec<f32> = (0..positions * width).map(|_| rng.f32() - 0.5).collect();
            let mut plain = vec![0.0f32; width];
            for (p, &w) in weights.iter().enumerate() {
                for (a, &v) in plain.iter_mut().zip(&latent[p * width..(p + 1) * width]) {
                    *a = w.mul_add(v, *a);
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            #[cfg(target_arch = "x86_64")]
            let avx2 = std::arch::is_x86_feature_detected!("avx2");
            #[cfg(not(target_arch = "x86_64"))]
            let avx2 = false;
            for (block, avx2) in [
                (positions, false),
                (16, false),
                (3, false),
                (16, avx2),
                (3, avx2),
            ] {
                let mut striped = vec![0.0f32; width];
                for start in (0..positions).step_by(block) {
                    let end = (start + block).min(positions);
                    weighted_rows(
                        &weights[start..end],
                        &latent[start * width..end * width],
                        &mut striped,
                        avx2,
                    );
                }
                assert_eq!(
                    bits(&plain),
                    bits(&striped),
                    "width {width}, {positions} positions in blocks of {block}, avx2 {avx2}"
                );
            }
        }
    }
}

/// Not a check: the time of `heads_context` at K3's widths (48 heads, one task of a
/// 2-thread run, rank 512, rope 64) over 4096 and 65,536 positions for one token and for a
/// group of [`TOKEN_GROUP`], in multiply-adds per second on one core, through `wide` as the
/// engine runs it. `cargo test --release -p k3-model attend_timing -- --ignored --nocapture`;
/// PERFORMANCE.md reports it against the core's ceiling.
#[test]
#[ignore = "a timing, not a check"]
fn attend_timing() {
    for positions in [4096, 65_536] {
        time_heads(positions);
    }
}

/// [`attend_timing`] at one depth.
fn time_heads(positions: usize) {
    let (heads, nope, rope, rank, v_dim) = (48usize, 128usize, 64usize, 512usize, 128usize);
    let kernels = mxfp4_kernels::Kernels::detect();
    let mut rng = fastrand::Rng::with_seed(3);
    let last = positions + TOKEN_GROUP;
    let cache = MlaCache {
        latent: (0..last * rank)
            .map(|_| rng.f32() - 0.5)
            .collect::<Vec<_>>()
            .into(),
        k_pe: (0..last * rope)
            .map(|_| rng.f32() - 0.5)
            .collect::<Vec<_>>()
            .into(),
    };
    let qs: Vec<Vec<f32>> = (0..TOKEN_GROUP)
        .map(|_| {
            (0..heads * (nope + rope))
                .map(|_| rng.f32() - 0.5)
                .collect()
        })
        .collect();
    let rows: Vec<f32> = (0..heads * (nope + v_dim) * rank)
        .map(|_| rng.f32() * 0.01)
        .collect();
    let d = Dims {
        nope,
        rope,
        rank,
        scale: 0.07,
        avx512: super::super::wide::has_avx512(&kernels),
        avx2: kernels.tier() == mxfp4_kernels::Tier::Avx2,
    };
    let mut buf = HeadBuffers::default();
    for tokens in [1, TOKEN_GROUP] {
        let q: Vec<&[f32]> = qs[..tokens].iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0f32; tokens * heads * v_dim];
        let mut best = f64::INFINITY;
        for _ in 0..7 {
            let start = std::time::Instant::now();
            super::super::wide::wide(
                &kernels,
                #[inline(always)]
                || {
                    let queries = HeadQueries { q: &q, rows: &rows };
                    heads_context(&d, &cache, positions, queries, &mut out, &mut buf)
                },
            );
            best = best.min(start.elapsed().as_secs_f64());
        }
        // Scores (rank + rope) and weighted latents (rank) per head and position.
        let work = (tokens * heads * positions * (2 * rank + rope)) as f64;
        println!(
            "{tokens} token(s), {heads} heads, {positions} positions, tier {:?}: {:.2} ms per \
             token, {:.1} G multiply-adds/s",
            kernels.tier(),
            best * 1e3 / tokens as f64,
            work / best / 1e9
        );
    }
}

/// The AVX-512 two-query, 8-position scores give each query `ops::dot`'s bits, and the
/// two-head weighted latents each head's position-order sums, at K3's widths (rank 512,
/// rope 64: 8 stripes of 16), k3-0.40b's (128, 32) and a rank of 64 (4 stripes).
#[cfg(target_arch = "x86_64")]
#[test]
fn two_heads_at_once_on_avx512_have_each_heads_bits() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        eprintln!("no avx512f on this CPU: nothing to compare");
        return;
    }
    let widths = [(512usize, 64usize), (128, 32), (64, 16)];
    // SAFETY: avx512f was detected above.
    check_pair_scores(17, &widths, |q, q_pe, latent, pe, scale| unsafe {
        x86::scores2x8(q, q_pe, latent, pe, scale)
    });
    let mut rng = fastrand::Rng::with_seed(18);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (rank, _) in widths {
        let mut value = || (rng.f32() - 0.5) * 2f32.powi(rng.i32(-8..8));
        let latent: Vec<f32> = (0..8 * rank).map(|_| value()).collect();
        let weights: Vec<Vec<f32>> = (0..2).map(|_| (0..8).map(|_| value()).collect()).collect();
        let start: Vec<Vec<f32>> = (0..2)
            .map(|_| (0..rank).map(|_| value()).collect())
            .collect();
        let mut plain = start.clone();
        for (h, sums) in plain.iter_mut().enumerate() {
            weighted_rows(&weights[h], &latent, sums, false);
        }
        let (mut first, mut second) = (start[0].clone(), start[1].clone());
        let pair = [weights[0].as_slice(), weights[1].as_slice()];
        // SAFETY: avx512f was detected above; `latent` holds 8 rows of `rank` values.
        unsafe {
            if rank.is_multiple_of(128) {
                for start in (0..rank).step_by(128) {
                    let ctx = [&mut first[..], &mut second[..]];
                    x86::weighted_stripe2::<8>(pair, &latent, ctx, rank, start);
                }
            } else {
                for start in (0..rank).step_by(64) {
                    let ctx = [&mut first[..], &mut second[..]];
                    x86::weighted_stripe2::<4>(pair, &latent, ctx, rank, start);
                }
            }
        }
        assert_eq!(bits(&first), bits(&plain[0]), "rank {rank}, head 0");
        assert_eq!(bits(&second), bits(&plain[1]), "rank {rank}, head 1");
    }
}

/// `softmax_heads` (sums of several heads side by side, the max over lanes) gives each head
/// the bits of the straightforward loops: the max in order, `e^(s - max)`, the sum in position
/// order, each divided — for head counts that fill the side-by-side groups and leave a tail,
/// and positions that fill the 16 lanes and leave a tail, with scores of mixed magnitude
/// (signed zeros among them).
#[test]
fn softmax_of_heads_side_by_side_has_each_heads_straightforward_bits() {
    let mut rng = fastrand::Rng::with_seed(21);
    for (heads, positions) in [(1usize, 1usize), (3, 16), (11, 37), (16, 100), (9, 5)] {
        let scores: Vec<f32> = (0..heads * positions)
            .map(|i| match i % 13 {
                0 => 0.0,
                1 => -0.0,
                _ => (rng.f32() - 0.5) * 2f32.powi(rng.i32(-6..7)),
            })
            .collect();
        let mut want = scores.clone();
        for row in want.chunks_exact_mut(positions) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for s in row.iter_mut() {
                *s = mxfp4_kernels::vmath::exp(*s - max);
            }
            let total = row.iter().fold(0.0f32, |a, &e| a + e);
            for s in row.iter_mut() {
                *s /= total;
            }
        }
        let mut got = scores;
        softmax_heads(&mut got, heads, positions);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{heads} heads, {positions} positions"
        );
    }
}
