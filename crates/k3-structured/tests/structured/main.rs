//! k3-structured's integration tests: constrained generation from a random-logit "model" over
//! the tiny synthetic tokenizer, checked by k3-model's output parser and the `jsonschema`
//! crate (validators independent of llguidance), the errors, and the limits.

mod generate;
mod json;
mod limits;
mod permissive;
mod tools;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use k3_model::synth::tokenizer::{learn_bpe, tiktoken_model, tokenizer_config};
use k3_model::tokenizer::Tokenizer;
use k3_structured::Vocabulary;

/// The tiny preset's vocabulary: 768 BPE tokens, then 256 special slots.
pub(crate) const TOKENIZER_IDS: usize = 1024;
/// The model's vocabulary in most tests: 64 ids past the tokenizer's, which have no bytes.
pub(crate) const N_VOCAB: usize = TOKENIZER_IDS + 64;

/// The tokenizer `cargo xtask gen-k3-synth --preset tiny` writes, built in memory.
pub(crate) fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let model = tiktoken_model(&learn_bpe(TOKENIZER_IDS - 256));
        let config = tokenizer_config(TOKENIZER_IDS);
        let specials: HashMap<String, u32> = config["added_tokens_decoder"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(id, token)| {
                let name = token["content"].as_str().unwrap().to_owned();
                (name, id.parse().unwrap())
            })
            .collect();
        Tokenizer::new(Path::new("tiny/tiktoken.model"), &model, specials).unwrap()
    })
}

/// The vocabulary over [`N_VOCAB`] ids.
pub(crate) fn vocab() -> Arc<Vocabulary> {
    static VOCAB: OnceLock<Arc<Vocabulary>> = OnceLock::new();
    VOCAB
        .get_or_init(|| Vocabulary::new(tokenizer(), N_VOCAB).unwrap())
        .clone()
}

/// Feeds `text` (special tokens allowed) to `matcher` token by token: the first refused
/// token's index, or `None` when all were taken.
pub(crate) fn feed(matcher: &mut k3_structured::Matcher, text: &str) -> Option<usize> {
    let tokens = tokenizer().encode(text, true);
    tokens
        .iter()
        .position(|&token| matcher.commit(token).is_err())
}

pub(crate) fn special(name: &str) -> u32 {
    tokenizer().special(name).unwrap()
}
