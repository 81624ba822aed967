//! The sampler and the stop strings: each filter, penalty and draw, and streamed stops.

use super::*;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_takes_the_largest_and_the_lower_id_on_ties() {
    let mut s = Sampler::new(params(0.0), &[]);
    assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).token, 1);
}

#[test]
fn a_seed_fixes_the_draws_and_filters_bound_them() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let run = |p: SamplingParams| -> Vec<u32> {
        let mut s = Sampler::new(p, &[]);
        (0..40).map(|_| s.sample(&logits).token).collect()
    };
    let base = SamplingParams {
        seed: 7,
        ..params(1.0)
    };
    assert_eq!(run(base.clone()), run(base.clone()));
    assert_ne!(
        run(base.clone()),
        run(SamplingParams {
            seed: 8,
            ..base.clone()
        })
    );
    // top-k 3: only the three largest logits can come out.
    let mut top3: Vec<usize> = (0..50).collect();
    top3.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let allowed: Vec<u32> = top3[..3].iter().map(|&i| i as u32).collect();
    let k3 = run(SamplingParams {
        top_k: 3,
        ..base.clone()
    });
    assert!(k3.iter().all(|t| allowed.contains(t)), "{k3:?}");
    // A tiny top-p keeps only the top token.
    let p = run(SamplingParams {
        top_p: 1e-6,
        ..base.clone()
    });
    assert!(p.iter().all(|&t| t == allowed[0]));
    // min-p 1 keeps only the top token too.
    let m = run(SamplingParams { min_p: 1.0, ..base });
    assert!(m.iter().all(|&t| t == allowed[0]));
}

#[test]
fn penalties_push_seen_tokens_down() {
    let logits = [2.0f32, 1.9, 0.0];
    let mut s = Sampler::new(
        SamplingParams {
            presence_penalty: 1.0,
            ..params(0.0)
        },
        &[],
    );
    assert_eq!(s.sample(&logits).token, 0);
    assert_eq!(s.sample(&logits).token, 1, "0 is present now");
    let mut r = Sampler::new(
        SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        },
        &[0],
    );
    assert_eq!(
        r.sample(&logits).token,
        1,
        "0 was in the prompt: 2.0 / 2 < 1.9"
    );
}

#[test]
fn logprobs_are_a_log_softmax_with_the_top_alternatives() {
    let mut s = Sampler::new(
        SamplingParams {
            top_logprobs: 2,
            ..params(0.0)
        },
        &[],
    );
    let out = s.sample(&[0.0, (2.0f32).ln(), f32::NEG_INFINITY]);
    assert_eq!(out.token, 1);
    assert!((out.logprob - (2.0f32 / 3.0).ln()).abs() < 1e-6);
    assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 0]);
    assert!((out.top[1].1 - (1.0f32 / 3.0).ln()).abs() < 1e-6);
}

#[test]
fn out_of_range_values_are_named() {
    let bad = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    };
    assert_eq!(bad.validate().unwrap_err().name, "top_p");
    assert!(params(2.5).validate().is_err());
    assert!(SamplingParams::default().validate().is_ok());
}

#[test]
fn stop_strings_are_found_across_pieces_and_their_prefixes_held() {
    let mut stops = StopStrings::new(vec!["END".into(), "\n\n".into()]);
    assert_eq!(stops.scan("abc EN"), None);
    assert_eq!(stops.pending(), 2);
    assert_eq!(stops.scan("D x"), Some((1, 3)), "END spans the two pieces");
    stops.reset();
    assert_eq!(stops.scan("abc\n"), None);
    assert_eq!(stops.pending(), 1);
    stops.reset();
    assert_eq!(stops.scan("abc"), None);
    assert_eq!(stops.pending(), 0);
    // Overlapping stops: the first to end wins; at the same end, the longer.
    let mut stops = StopStrings::new(vec!["abcd".into(), "bc".into(), "xbc".into()]);
    assert_eq!(stops.scan("zabcd"), Some((4, 2)));
    stops.reset();
    assert_eq!(stops.scan("xbc"), Some((3, 3)));
    // A failure link keeps a partial match going: "aab" ends in "ab".
    let mut stops = StopStrings::new(vec!["ab".into()]);
    assert_eq!(stops.scan("aa"), None);
    assert_eq!(stops.pending(), 1);
    assert_eq!(stops.scan("b"), Some((1, 2)));
    assert!(StopStrings::new(vec![String::new()]).is_empty());
}

#[test]
fn logit_bias_moves_the_choice_and_is_checked() {
    let params = SamplingParams {
        logit_bias: vec![(2, 10.0), (99, 5.0)],
        ..params(0.0)
    };
    assert!(params.validate().is_ok());
    let mut s = Sampler::new(params, &[]);
    assert_eq!(s.sample(&[1.0, 2.0, 0.0]).token, 2, "0.0 + 10 beats 2.0");
    let bad = SamplingParams {
        logit_bias: vec![(0, 100.5)],
        ..SamplingParams::default()
    };
    assert_eq!(bad.validate().unwrap_err().name, "logit_bias");
}

/// A bitset over `n` ids with the ids `allowed` returns true for.
fn mask(n: usize, allowed: impl Fn(usize) -> bool) -> Vec<u32> {
    let mut words = vec![0u32; n.div_ceil(32)];
    for i in (0..n).filter(|&i| allowed(i)) {
        words[i / 32] |= 1 << (i % 32);
    }
    words
}

fn varied_logits(n: usize, salt: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + salt).sin() * 3.0)
        .collect()
}

#[test]
fn an_all_ones_mask_or_none_changes_nothing_bit_for_bit() {
    let n: usize = 100;
    let ones = vec![u32::MAX; n.div_ceil(32)];
    for (temperature, top_k, top_p, min_p) in
        [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.05)]
    {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 11,
            top_logprobs: 3,
            presence_penalty: 0.5,
            repetition_penalty: 1.3,
            logit_bias: vec![(4, 2.0)],
            ..SamplingParams::default()
        };
        let mut plain = Sampler::new(params.clone(), &[1, 2]);
        let mut none = Sampler::new(params.clone(), &[1, 2]);
        let mut all = Sampler::new(params, &[1, 2]);
        for step in 0..60 {
            let logits = varied_logits(n, step as f32);
            let want = plain.sample(&logits);
            assert_eq!(none.sample_masked(&logits, None), want);
            let got = all.sample_masked(&logits, Some(&ones));
            assert_eq!(got.token, want.token);
            assert_eq!(got.logprob.to_bits(), want.logprob.to_bits());
            assert_eq!(got.top, want.top);
        }
    }
}

#[test]
fn greedy_and_draws_choose_only_allowed_tokens() {
    let n = 70; // not a multiple of 32: the last word is partial
    let allowed = |i: usize| i % 7 == 3 || i == 69;
    let words = mask(n, allowed);
    for temperature in [0.0, 1.0, 2.0] {
        let mut s = Sampler::new(
            SamplingParams {
                temperature,
                seed: 5,
                top_logprobs: 20,
                logit_bias: vec![(0, 100.0)], // a huge bias on a disallowed token
                ..SamplingParams::default()
            },
            &[],
        );
        for step in 0..200 {
            let out = s.sample_masked(&varied_logits(n, step as f32), Some(&words));
            assert!(allowed(out.token as usize), "{} chosen", out.token);
            assert!(out.logprob.is_finite() && out.logprob <= 0.0);
            assert!(
                out.top
                    .iter()
                    .all(|&(t, lp)| allowed(t as usize) && lp.is_finite())
            );
            // Over the allowed tokens only: their probabilities sum to 1.
            assert_eq!(out.top.len(), (0..n).filter(|&i| allowed(i)).count());
            let total: f32 = out.top.iter().map(|&(_, lp)| lp.exp()).sum();
            assert!((total - 1.0).abs() < 1e-4, "{total}");
        }
    }
    // Greedy takes the best allowed token even when a disallowed one is far larger.
    let mut s = Sampler::new(params(0.0), &[]);
    let one = mask(4, |i| i == 2 || i == 3);
    assert_eq!(s.sample_masked(&[9.0, 8.0, 1.0, 0.5], Some(&one)).token, 2);
    // Ids past the mask's end are not allowed.
    let short = mask(32, |i| i == 31);
    assert_eq!(s.sample_masked(&[0.0; 40], Some(&short)).token, 31);
}

#[test]
#[should_panic(expected = "allows none")]
fn an_empty_mask_is_a_caller_bug() {
    let mut s = Sampler::new(params(0.0), &[]);
    s.sample_masked(&[1.0, 2.0], Some(&[0]));
}

/// The sampler's choices, log-probabilities and alternatives on fixed inputs, fingerprinted
/// (FNV-1a). The value was taken from the sampler before masks existed, so the masked path
/// with no mask provably changed nothing.
#[test]
fn unmasked_sampling_is_what_it_was_before_masks() {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for byte in x.to_le_bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3);
        }
    };
    for (temperature, top_k, top_p, min_p) in
        [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.05)]
    {
        let mut s = Sampler::new(
            SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 11,
                top_logprobs: 3,
                frequency_penalty: 0.25,
                repetition_penalty: 1.3,
                logit_bias: vec![(4, 2.0)],
                ..SamplingParams::default()
            },
            &[1, 2],
        );
        for step in 0..60 {
            let out = s.sample(&varied_logits(100, step as f32 * 0.3));
            eat(u64::from(out.token));
            eat(u64::from(out.logprob.to_bits()));
            for (t, lp) in out.top {
                eat(u64::from(t) << 32 | u64::from(lp.to_bits()));
            }
        }
    }
    assert_eq!(hash, 0x1885_91c8_ae40_87b4, "{hash:#x}");
}
