//! The model's vocabulary as llguidance sees it: every token id's bytes in a token trie, the
//! special tokens as `0xFF` + their name, and the parser factory built over it once per model.

use std::sync::Arc;

use k3_model::chat::END_OF_MSG;
use k3_model::tokenizer::Tokenizer;
use llguidance::ParserFactory;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::Error;

/// The XTML markers a constraint writes (special tokens of K3's tokenizer).
pub(crate) const MARKERS: [&str; 3] = ["<|open|>", "<|close|>", "<|sep|>"];

/// llguidance's view of one model's tokens, built once per model and shared by every request.
///
/// Token ids the tokenizer has no bytes for (the model's vocabulary can be larger than the
/// tokenizer's) are empty in the trie and never allowed by any mask.
pub struct Vocabulary {
    factory: ParserFactory,
    n_vocab: usize,
    end: u32,
    /// Bitset of the ids that have bytes (the only ids a mask may allow).
    has_bytes: Vec<u32>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("n_vocab", &self.n_vocab)
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// Builds the token trie and parser factory for `tokenizer` with a model vocabulary of
    /// `n_vocab` ids (the logits' length). The end of the output is `<|end_of_msg|>`.
    pub fn new(tokenizer: &Tokenizer, n_vocab: usize) -> Result<Arc<Self>, Error> {
        let id = |token: &str| {
            tokenizer
                .special(token)
                .filter(|&id| (id as usize) < n_vocab)
                .ok_or_else(|| Error::Tokenizer {
                    token: token.to_owned(),
                    n_vocab,
                })
        };
        let end = id(END_OF_MSG)?;
        for marker in MARKERS {
            id(marker)?;
        }
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(n_vocab);
        let mut has_bytes = vec![0u32; n_vocab.div_ceil(32)];
        for token in 0..n_vocab as u32 {
            let mut bytes = tokenizer.decode_bytes(&[token]);
            // A special token decodes to its name; llguidance marks specials with 0xFF.
            let special = std::str::from_utf8(&bytes)
                .ok()
                .and_then(|name| tokenizer.special(name))
                == Some(token);
            if special {
                bytes.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
            if !bytes.is_empty() {
                has_bytes[token as usize / 32] |= 1 << (token % 32);
            }
            words.push(bytes);
        }
        let mut info = TokRxInfo::new(n_vocab as u32, end);
        info.tok_end_of_turn = Some(end);
        let trie = TokTrie::from(&info, &words);
        // Not canonical: our BPE is not the trie's greedy split, and XTML encodes each segment
        // on its own anyway, so llguidance must not force a tokenization of its choosing;
        // every tokenization of the allowed bytes stays allowed.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| Error::Invalid(e.to_string()))?;
        factory.quiet();
        Ok(Arc::new(Self {
            factory,
            n_vocab,
            end,
            has_bytes,
        }))
    }

    /// The model's vocabulary size (a mask's length in bits).
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The end token, `<|end_of_msg|>`.
    pub fn end_token(&self) -> u32 {
        self.end
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }

    pub(crate) fn has_bytes(&self) -> &[u32] {
        &self.has_bytes
    }
}
