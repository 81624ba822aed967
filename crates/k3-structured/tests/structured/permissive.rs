//! A constraint allowing every token changes nothing: the same tokens, log-probabilities and
//! alternatives as unconstrained sampling, greedy and at temperature 1.

use k3_model::sampling::{Sampler, SamplingParams};
use k3_structured::{Grammar, Matcher, Options, Spec, Vocabulary};
use k3_testkit::Rng;

use crate::generate::random_logits;
use crate::{TOKENIZER_IDS, special, tokenizer};

fn allows(words: &[u32], id: usize) -> bool {
    words[id / 32] >> (id % 32) & 1 == 1
}

#[test]
fn allowing_everything_gives_the_unconstrained_tokens() {
    // A model vocabulary exactly the tokenizer's, so every id has bytes and may be allowed.
    let vocab = Vocabulary::new(tokenizer(), TOKENIZER_IDS).unwrap();
    let grammar = Grammar::compile(&vocab, &Spec::Any, &Options::default()).unwrap();
    let end = special("<|end_of_msg|>");
    // The ids with bytes: the tiny BPE learns fewer merges than it has slots, and a model
    // never proposes an id its tokenizer lacks (its logit is -inf here), so every token
    // that exists is allowed everywhere.
    let mut has_bytes = vec![0u32; TOKENIZER_IDS / 32];
    for id in 0..TOKENIZER_IDS {
        if !tokenizer().decode_bytes(&[id as u32]).is_empty() {
            has_bytes[id / 32] |= 1 << (id % 32);
        }
    }
    assert!(
        has_bytes.iter().any(|&w| w != u32::MAX),
        "the tokenizer has gaps"
    );
    for temperature in [0.0, 1.0] {
        for seed in 0..4u64 {
            let params = SamplingParams {
                temperature,
                seed,
                top_logprobs: 2,
                ..SamplingParams::default()
            };
            let mut free = Sampler::new(params.clone(), &[]);
            let mut constrained = Sampler::new(params, &[]);
            let mut matcher = Matcher::new(&grammar);
            let mut rng = Rng::new(seed);
            for _ in 0..100 {
                let mut logits = random_logits(&mut rng, TOKENIZER_IDS);
                for (id, logit) in logits.iter_mut().enumerate() {
                    if !allows(&has_bytes, id) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
                let mask = matcher.mask().unwrap();
                assert_eq!(mask.words(), &has_bytes[..]);
                let want = free.sample(&logits);
                let got = constrained.sample_masked(&logits, Some(mask.words()));
                assert_eq!(got, want, "seed {seed}");
                matcher.commit(got.token).unwrap();
                if got.token == end {
                    break;
                }
            }
        }
    }
}
