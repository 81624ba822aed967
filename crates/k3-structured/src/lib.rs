//! Structured outputs: token masks that keep K3's output inside a JSON Schema, a Lark grammar
//! or a forced XTML tool call, computed by [llguidance](https://github.com/guidance-ai/llguidance).
//!
//! Once per model, a [`Vocabulary`] turns the tokenizer into llguidance's token trie. Per
//! request, [`Grammar::compile`] turns a [`Spec`] into a parser for the output as the model
//! writes it in XTML (docs/MODEL.md §10.2): the answer inside the `response` element the
//! generation prompt opened, after free reasoning when thinking is on, then the closers, then
//! `<|end_of_msg|>`. Per sequence, a [`Matcher`] gives the [`Mask`] of allowed next tokens
//! for [`k3_model::sampling::Sampler::sample_masked`] and takes the token chosen.
//!
//! ```no_run
//! # fn demo(tokenizer: &k3_model::tokenizer::Tokenizer, logits: &[f32]) -> Result<(), k3_structured::Error> {
//! use k3_model::sampling::{Sampler, SamplingParams};
//! use k3_structured::{Grammar, Matcher, Options, Spec, Vocabulary};
//!
//! let vocab = Vocabulary::new(tokenizer, 163_840)?;
//! let grammar = Grammar::compile(&vocab, &Spec::JsonObject, &Options::default())?;
//! let mut matcher = Matcher::new(&grammar);
//! let mut sampler = Sampler::new(SamplingParams::default(), &[]);
//! while !matcher.has_ended() {
//!     let token = sampler.sample_masked(logits, Some(matcher.mask()?.words())).token;
//!     matcher.commit(token)?;
//! }
//! # Ok(()) }
//! ```
//!
//! No thread is started here: a mask is computed on the caller's thread.

mod closer;
mod error;
mod grammar;
mod mask;
mod matcher;
mod spec;
mod vocab;

pub use closer::JsonCloser;
pub use error::Error;
pub use grammar::{CONSTRAINT_STACK, Grammar};
pub use mask::Mask;
pub use matcher::Matcher;
pub use spec::{ANSWER_TRAILER, Limits, Options, Spec};
pub use vocab::Vocabulary;

/// Whatever is shared across threads is `Send + Sync`; a matcher moves between threads.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    const fn sent<T: Send>() {}
    shared::<Vocabulary>();
    shared::<Grammar>();
    sent::<Matcher>();
};
