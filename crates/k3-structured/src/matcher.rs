//! One sequence following a [`Grammar`]: the mask of allowed next tokens, and each token the
//! sampler chose taken in turn.

use std::time::{Duration, Instant};

use llguidance::api::StopReason;

use crate::error::Error;
use crate::grammar::Grammar;
use crate::mask::Mask;

/// One sequence's place in a [`Grammar`]. Driven by one thread at a time (`&mut self`).
pub struct Matcher {
    grammar: Grammar,
    inner: llguidance::Matcher,
    /// The mask for the next token, until a token is committed.
    mask: Option<Mask>,
    mask_time: Duration,
    /// The end token has been committed.
    ended: bool,
    /// The error that stopped this matcher; every later call returns it.
    failed: Option<Error>,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher")
            .field("mask_time", &self.mask_time)
            .field("ended", &self.ended)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Matcher {
    /// A matcher at the start of the output.
    pub fn new(grammar: &Grammar) -> Self {
        Self {
            grammar: grammar.clone(),
            inner: grammar.inner.start.clone(),
            mask: Some(grammar.inner.first_mask.clone()),
            mask_time: Duration::ZERO,
            ended: false,
            failed: None,
        }
    }

    /// The tokens allowed next (computed once per position). The end token
    /// (`<|end_of_msg|>`) is allowed only where the constraint may end; once it has ended,
    /// only the end token is.
    pub fn mask(&mut self) -> Result<&Mask, Error> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.mask.is_none() && self.grammar.inner.permissive {
            self.mask = Some(self.grammar.inner.first_mask.clone());
        }
        if self.mask.is_none() {
            let started = Instant::now();
            let vob = self.inner.compute_mask_or_eos();
            let took = started.elapsed();
            self.mask_time += took;
            let limit = self.grammar.inner.mask_limit;
            let mask = match vob {
                Err(e) => Err(Error::Failed(e.to_string())),
                Ok(_) if took > limit => Err(Error::MaskTime { limit, took }),
                Ok(vob) => {
                    let mask = Mask::from_vob(&vob, &self.grammar.inner.vocab, false);
                    if mask.count() == 0 {
                        Err(Error::Failed("no token is allowed next".into()))
                    } else {
                        Ok(mask)
                    }
                }
            };
            match mask {
                Ok(mask) => self.mask = Some(mask),
                Err(e) => {
                    self.failed = Some(e.clone());
                    return Err(e);
                }
            }
        }
        Ok(self.mask.as_ref().expect("computed above"))
    }

    /// Takes the sampled `token`. [`Error::Rejected`] (nothing changes) if the mask does not
    /// allow it or the output has ended.
    pub fn commit(&mut self, token: u32) -> Result<(), Error> {
        if self.ended || !self.mask()?.allows(token) {
            return Err(Error::Rejected { token });
        }
        self.mask = None;
        let end = self.grammar.inner.vocab.end_token();
        if token == end && self.inner.is_stopped() {
            // The grammar had already finished (llguidance stops there and takes no token).
            self.ended = true;
            return Ok(());
        }
        if let Err(e) = self.inner.consume_token(token) {
            let e = Error::Failed(e.to_string());
            self.failed = Some(e.clone());
            return Err(e);
        }
        self.ended = token == end;
        Ok(())
    }

    /// Whether nothing but the end token may follow (or it already has).
    pub fn is_finished(&self) -> bool {
        self.ended
            || matches!(
                self.inner.stop_reason(),
                StopReason::NoExtension | StopReason::EndOfSentence
            )
    }

    /// Whether the end token has been committed.
    pub fn has_ended(&self) -> bool {
        self.ended
    }

    /// The total time spent computing masks for this sequence (the first mask is computed
    /// while compiling and not counted).
    pub fn mask_time(&self) -> Duration {
        self.mask_time
    }
}
