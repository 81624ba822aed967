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
