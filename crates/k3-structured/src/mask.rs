//! A set of allowed token ids over the model's vocabulary, as the sampler takes it.

use llguidance::toktrie::SimpleVob;

use crate::vocab::Vocabulary;

/// Allowed next tokens: a bitset over the vocabulary, bit `i % 32` of word `i / 32` for id `i`
/// (what [`k3_model::sampling::Sampler::sample_masked`] takes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mask {
    words: Vec<u32>,
    n_vocab: usize,
}

impl Mask {
    /// llguidance's mask restricted to the vocabulary and, unless `every_id` (the permissive
    /// constraint, [`crate::Spec::Any`]: no constraint at all), to the ids that have bytes.
    pub(crate) fn from_vob(vob: &SimpleVob, vocab: &Vocabulary, every_id: bool) -> Self {
        let has_bytes = vocab.has_bytes();
        let n_vocab = vocab.n_vocab();
        let from = vob.as_slice();
        let words = has_bytes
            .iter()
            .enumerate()
            .map(|(i, &valid)| {
                if every_id {
                    // Every id below n_vocab (the last word's bits past it stay clear).
                    let ids = (n_vocab - 32 * i).min(32);
                    if ids == 32 {
                        u32::MAX
                    } else {
                        (1u32 << ids) - 1
                    }
                } else {
                    valid & from.get(i).copied().unwrap_or(0)
                }
            })
            .collect();
        Self {
            words,
            n_vocab: vocab.n_vocab(),
        }
    }

    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        self.words
            .get(token as usize / 32)
            .is_some_and(|w| w >> (token % 32) & 1 == 1)
    }

    /// The bitset's words (`n_vocab.div_ceil(32)` of them; bits past `n_vocab` are clear).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// The vocabulary size the mask covers.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Sets the logits of disallowed tokens (and of ids past the vocabulary) to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, logit) in logits.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}
