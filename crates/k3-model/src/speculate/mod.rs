//! Drafting for exact speculative decoding: the engine verifies a sequence's last token and k
//! drafted ones in one forward pass (the weights read once), keeps the drafts the model would
//! have produced itself and the model's token at the first mismatch, so the output is what
//! decoding one token at a time gives. What is here proposes the drafts without a model and
//! decides how many are worth verifying.
//!
//! - [`NgramIndex`] drafts from the sequence's own tokens (prompt and output so far): what
//!   followed the latest earlier occurrence of its last few tokens. It suits outputs that
//!   quote or edit their input (code changes, summaries, extraction).
//! - [`SuffixCache`] drafts from earlier requests' outputs in the same tenant namespace,
//!   within a byte budget: repeated questions, templated answers.
//! - [`choose`] picks the draft length from a learned [`CostModel`] of the pass's time by
//!   token count and the sequence's [`Acceptance`] rate: 0 unless drafting is expected to pay,
//!   so a sequence whose drafts keep failing costs only an occasional one-token probe.
//!
//! A leaf of the crate: nothing here imports the rest of it, does I/O or starts a thread.
//! `ngram` holds the hashing both drafters share; `suffix` builds on it; `policy` stands alone.

mod ngram;
mod policy;
mod suffix;

pub use ngram::{Draft, MAX_N, MIN_N, NgramIndex};
pub use policy::{Acceptance, CostModel, DEFAULT_MAX_DRAFT, MAX_TOKENS, PRIOR_TOKEN_COST, choose};
pub use suffix::{ENTRY_BYTES, SuffixCache};

/// The speculation knobs an engine is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    /// Drafts per sequence and step at most (0: no speculation).
    pub max_draft: usize,
    /// Shortest suffix that drafts.
    pub min_n: usize,
    /// Longest suffix tried.
    pub max_n: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Self {
            max_draft: DEFAULT_MAX_DRAFT,
            min_n: MIN_N,
            max_n: MAX_N,
        }
    }
}
