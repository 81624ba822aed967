//! The k3 binaries' command line, shared by `k3-serve` and the decode bench: a table of
//! [`Flag`]s (name, aliases, value kind, default, group, help), a parser over it ([`parse`])
//! that accepts `--flag value`, `--flag=value`, short and long aliases and repeated flags where
//! the table allows them, grouped `--help` text ([`render_help`]), and the flags of the
//! libraries' options with the code that applies them ([`library`]), the checks a binary's
//! tests run on its table ([`table_problems`], [`flags_not_named_in`]), and the reading of a
//! docs page's first example that its tests run ([`first_sh_block`], [`shell_words`]).
//!
//! The parser checks each value against its flag's [`Kind`] while parsing, so every usage
//! error (one line, naming the flag and the bad value, or the unknown flag with a "did you
//! mean") surfaces before anything is loaded. Nothing here reads the environment: the binary
//! passes its arguments and, for flags with an environment variable, a lookup
//! ([`Parsed::fill_from_env`]).

#![warn(missing_docs)]

mod check;
mod error;
mod examples;
mod flag;
mod help;
mod knobs;
pub mod library;
mod parse;
mod suggest;

pub use check::{flags_not_named_in, table_problems};
pub use error::UsageError;
pub use examples::{args_after, first_sh_block, shell_words};
pub use flag::{Flag, Group, Kind, all_spellings, is_flag_spelling};
pub use help::{flags_in_help, groups, render_help, render_version, spelled};
pub use knobs::{FlagHints, flag_of, hint_of, with_flags};
pub use library::{apply_library_flags, library_flags, library_flags_with_threads, model_flag};
pub use parse::{Outcome, Parsed, parse, parse_or_answer, parse_or_exit};

/// The README's example, run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

#[cfg(test)]
mod tests;
