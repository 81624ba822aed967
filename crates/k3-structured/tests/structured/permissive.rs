//! A constraint allowing every token changes nothing: the same tokens, log-probabilities and
//! alternatives as unconstrained sampling, greedy and at temperature 1.

use k3_model::sampling::{Sampler, SamplingParams};
use k3_structured::{Grammar, Matcher, Options, Spec, Vocabulary};
use k3_testkit::Rng;

use crate::generate::random_logits;
use crate::{TOKENIZER_IDS, special, tokenizer};

#[test]
fn allowing_everything_gives_the_unconstrained_tokens() {
    let vocab = Vocabulary::new(tokenizer(), TOKENIZER_IDS).unwrap();
    let grammar = Grammar::compile(&vocab, &Spec::Any, &Options::default()).unwrap();
    let end = special("<|end_of_msg|>");
    // The tiny BPE learns fewer merges than it has slots: ids without bytes exist, and the
    // permissive constraint allows them too (a model may propose any id of its vocabulary).
    assert!(
        (0..TOKENIZER_IDS).any(|id| tokenizer().decode_bytes(&[id as u32]).is_empty()),
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
                let logits = random_logits(&mut rng, TOKENIZER_IDS);
                let mask = matcher.mask().unwrap();
                assert!(mask.words().iter().all(|&w| w == u32::MAX));
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
