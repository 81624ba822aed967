//! Drafting for exact speculative decoding: the engine verifies a sequence's last token and k
//! drafted ones in one forward pass (the weights read once), keeps the drafts the model would
//! have produced itself and the model's token at the first mismatch, so the output is what
//! decoding one token at a time gives. What is here proposes the drafts without a model.
//!
//! - [`NgramIndex`] drafts from the sequence's own tokens (prompt and output so far): what
//!   followed the latest earlier occurrence of its last few tokens. It suits outputs that
//!   quote or edit their input (code changes, summaries, extraction).
//!
//! A leaf of the crate: nothing here imports the rest of it, does I/O or starts a thread.

mod ngram;

pub use ngram::{Draft, MAX_N, MIN_N, NgramIndex};
