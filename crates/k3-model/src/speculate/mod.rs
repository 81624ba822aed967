//! Drafting for exact speculative decoding: the engine verifies a sequence's last token and k
//! drafted ones in one forward pass (the weights read once), keeps the drafts the model would
//! have produced itself and the model's token at the first mismatch, so the output is what
//! decoding one token at a time gives. What is here proposes the drafts without a model.
//!
//! - [`NgramIndex`] drafts from the sequence's own tokens (prompt and output so far): what
//!   followed the latest earlier occurrence of its last few tokens. It suits outputs that
//!   quote or edit their input (code changes, summaries, extraction).
//! - [`SuffixCache`] drafts from earlier requests' outputs in the same tenant namespace,
//!   within a byte budget: repeated questions, templated answers.
//!
//! A leaf of the crate: nothing here imports the rest of it, does I/O or starts a thread.
//! `ngram` holds the hashing both drafters share; `suffix` builds on it.

mod ngram;
mod suffix;

pub use ngram::{Draft, MAX_N, MIN_N, NgramIndex};
pub use suffix::{ENTRY_BYTES, SuffixCache};
