//! What k3's tests and benches share instead of each writing its own: a seeded generator
//! ([`Rng`]), a scratch directory removed on drop ([`Scratch`]), and a FIFO to feed a reader
//! that must refuse it ([`make_fifo`]) within a bound ([`promptly`]).
//!
//! A leaf crate with no dependency, so any crate of the workspace, the kernels at the bottom
//! included, takes it as a dev-dependency without a cycle. Not published: `cargo package`
//! drops a path-only dev-dependency, so the crates that use it still package.
//!
//! One generator stays outside: `k3_model::synth`'s, whose stream defines the synthetic
//! checkpoints (every fingerprint test depends on it), so it belongs to the generator.

#![warn(missing_docs)]

mod rng;
mod scratch;
mod special;

pub use rng::Rng;
pub use scratch::Scratch;
pub use special::{make_fifo, promptly, replace_with_special};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
