//! The random-logit "model" and the decode loop: a matcher's mask into the sampler, the
//! sampled token back into the matcher, until the end token.

use k3_model::chat::{Delta, OutputParser, ToolCall};
use k3_model::sampling::{Sampler, SamplingParams};
use k3_structured::{Grammar, Matcher};
use k3_testkit::Rng;
use std::sync::OnceLock;

use crate::{N_VOCAB, TOKENIZER_IDS, special, tokenizer};

/// Most tokens one sequence may take before the test calls it a runaway.
const MAX_TOKENS: usize = 4000;

/// Random logits for `n_vocab` ids, leaning (by a few nats) towards JSON's punctuation and the
/// markup's special tokens so that sequences end in tens of tokens rather than thousands; the
/// ids past the tokenizer get the largest logits of all, so a mask that let one through would
/// be caught at once.
pub(crate) fn random_logits(rng: &mut Rng, n_vocab: usize) -> Vec<f32> {
    static BONUS: OnceLock<Vec<f32>> = OnceLock::new();
    let bonus = BONUS.get_or_init(|| {
        let tokenizer = tokenizer();
        (0..N_VOCAB)
            .map(|id| {
                if id >= TOKENIZER_IDS {
                    20.0
                } else if id >= TOKENIZER_IDS - 256 {
                    3.0 // special tokens: markers and the end
                } else {
                    match tokenizer.decode_bytes(&[id as u32]).as_slice() {
                        b"\"" => 3.5,
                        b"}" | b"]" | b"{" | b"[" | b"," | b":" => 2.5,
                        [b'0'..=b'9'] | b"true" | b"false" | b"null" => 2.5,
                        _ => 0.0,
                    }
                }
            })
            .collect()
    });
    (0..n_vocab)
        .map(|id| rng.unit() * 2.0 + bonus[id])
        .collect()
}

/// What one constrained sequence produced.
#[derive(Debug)]
pub(crate) struct Output {
    pub(crate) tokens: Vec<u32>,
    pub(crate) reasoning: String,
    pub(crate) content: String,
    pub(crate) calls: Vec<ToolCall>,
}

/// Decodes one sequence under `grammar` with seeded random logits, checking each step's mask
/// on the way: no id without bytes, the end token only where the grammar is finished.
pub(crate) fn generate(grammar: &Grammar, temperature: f32, seed: u64, thinking: bool) -> Output {
    let end = special("<|end_of_msg|>");
    let mut rng = Rng::new(seed);
    let mut matcher = Matcher::new(grammar);
    let mut sampler = Sampler::new(
        SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        },
        &[],
    );
    let mut tokens = Vec::new();
    while !matcher.has_ended() {
        assert!(tokens.len() < MAX_TOKENS, "seed {seed}: runaway {tokens:?}");
        let finished = matcher.is_finished();
        let mask = matcher.mask().unwrap();
        assert!(
            (TOKENIZER_IDS..N_VOCAB).all(|id| !mask.allows(id as u32)),
            "an id without bytes is allowed"
        );
        assert_eq!(
            mask.allows(end),
            finished,
            "seed {seed}: end allowed at {tokens:?}"
        );
        let words = mask.words().to_vec();
        let token = sampler
            .sample_masked(&random_logits(&mut rng, N_VOCAB), Some(&words))
            .token;
        matcher.commit(token).unwrap();
        tokens.push(token);
    }
    assert_eq!(tokens.last(), Some(&end));
    assert!(matcher.is_finished());
    parse(&tokens[..tokens.len() - 1], thinking)
}

/// The output as the server would read it: k3-model's streaming parser over every token
/// before the end.
pub(crate) fn parse(tokens: &[u32], thinking: bool) -> Output {
    let tokenizer = tokenizer();
    let mut parser = OutputParser::new(tokenizer, thinking).unwrap();
    let mut deltas = Vec::new();
    for &id in tokens {
        deltas.extend(parser.push(id, &tokenizer.decode_bytes(&[id])));
    }
    deltas.extend(parser.finish());
    let mut out = Output {
        tokens: tokens.to_vec(),
        reasoning: String::new(),
        content: String::new(),
        calls: Vec::new(),
    };
    for delta in deltas {
        match delta {
            Delta::Reasoning(text) => out.reasoning += &text,
            Delta::Content(text) => out.content += &text,
            Delta::ToolCall(call) => out.calls.push(call),
        }
    }
    out
}

/// The seeds of `n` sequences, distinct per test (`salt`).
pub(crate) fn seeds(salt: u64, n: u64) -> impl Iterator<Item = u64> {
    (0..n).map(move |i| salt << 32 | i)
}
