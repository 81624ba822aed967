//! The crate's one error type.

use std::time::Duration;

/// Why a constraint could not be built or followed. Messages name the bad value and the limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The tokenizer lacks a token the chat markup needs (or it lies outside the vocabulary).
    #[error("the tokenizer has no {token} token below the vocabulary size {n_vocab}")]
    Tokenizer {
        /// The token's name, e.g. `<|end_of_msg|>`.
        token: String,
        /// The model's vocabulary size.
        n_vocab: usize,
    },
    /// A JSON Schema keyword that llguidance does not implement (it refuses rather than
    /// ignore a rule the output would then break).
    #[error("JSON Schema keyword {keyword:?} is not supported")]
    Unsupported {
        /// The keyword, e.g. `uniqueItems`.
        keyword: String,
    },
    /// The schema or grammar is malformed, unsatisfiable or over a size limit (llguidance's
    /// words).
    #[error("invalid constraint: {0}")]
    Invalid(String),
    /// Compiling took longer than [`crate::Limits::compile`].
    #[error("compiling the constraint took {took:?}, over the limit of {limit:?}")]
    CompileTime {
        /// The limit.
        limit: Duration,
        /// How long it took.
        took: Duration,
    },
    /// One token mask took longer than [`crate::Limits::mask`].
    #[error("a token mask took {took:?}, over the limit of {limit:?}")]
    MaskTime {
        /// The limit.
        limit: Duration,
        /// How long that mask took.
        took: Duration,
    },
    /// The token is not allowed here (or the output had already ended).
    #[error("token {token} is not allowed by the constraint here")]
    Rejected {
        /// The token id.
        token: u32,
    },
    /// The matcher failed while computing a mask or taking a token (a per-step work limit
    /// hit, or no token left to allow); it stays failed.
    #[error("the constraint failed: {0}")]
    Failed(String),
}

impl Error {
    /// An llguidance compile error: [`Error::Unsupported`] when it names an unimplemented
    /// keyword (`Unimplemented keys: ["uniqueItems"]`), else [`Error::Invalid`].
    pub(crate) fn from_compile(message: String) -> Self {
        const MARK: &str = "Unimplemented keys: ";
        let keyword = message.find(MARK).and_then(|at| {
            let list = &message[at + MARK.len()..];
            let list = &list[..=list.find(']')?];
            let keys: Vec<String> = serde_json::from_str(list).ok()?;
            keys.into_iter().next()
        });
        match keyword {
            Some(keyword) => Self::Unsupported { keyword },
            None => Self::Invalid(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unimplemented_key_becomes_unsupported() {
        let e = Error::from_compile(
            "at /properties/x: Unimplemented keys: [\"contains\", \"uniqueItems\"]".into(),
        );
        assert_eq!(
            e,
            Error::Unsupported {
                keyword: "contains".into()
            }
        );
        let e = Error::from_compile("Unsatisfiable schema: minimum > maximum".into());
        assert!(matches!(e, Error::Invalid(_)));
    }
}
