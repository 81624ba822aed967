//! A sequence's output constraint in the engine ([`Constrained`]): its matcher, the mask of its
//! next token computed on a thread of its own while the step's forward pass runs, and the
//! bound on that mask's time. A mask that is not ready within the bound fails its request
//! (the thread finishes on its own and its result is dropped): one request's grammar never
//! stalls the batch.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use k3_structured::{Error, Grammar, Limits, Matcher, Options, Vocabulary};

use crate::api::error::ApiError;
use crate::api::structured::OutputConstraint;

/// Compiles a request's output constraint against the model's vocabulary within `limits`
/// (`--max-constraint-compile-ms`, and `--max-mask-ms` for each mask): the 400 naming the
/// request's field when the library refuses it (a schema keyword it does not support is
/// named).
pub(crate) fn compile_constraint(
    vocabulary: &Arc<Vocabulary>,
    constraint: &OutputConstraint,
    limits: &crate::api::limits::Limits,
) -> Result<Grammar, ApiError> {
    let options = Options {
        thinking: constraint.thinking,
        limits: Limits {
            compile: limits.max_compile,
            mask: limits.max_mask,
            ..Limits::default()
        },
    };
    Grammar::compile(vocabulary, &constraint.spec, &options).map_err(|e| {
        let field = constraint.field;
        ApiError::invalid(field, format!("{field}: {e}"))
    })
}

/// A matcher, with the outcome of its last mask computation.
type Computed = (Box<Matcher>, Result<(), Error>);

/// Where the matcher is.
enum Slot {
    /// Here, its next mask computed (or not yet asked for).
    Here(Box<Matcher>),
    /// On a thread computing its next mask since `.1`.
    Away(Receiver<Computed>, Instant),
    /// Lost, for this reason: a failed computation or a mask past the bound ended the
    /// request.
    Gone(String),
}

/// One sequence's constraint.
pub(super) struct Constrained {
    slot: Slot,
    /// How long one token's mask may take.
    limit: Duration,
    /// Time spent waiting for masks on the step's path (the rest overlapped the forward pass).
    pub(super) waited: Duration,
    /// Masks computed.
    pub(super) masks: u64,
    /// The matcher's mask time when the last mask was taken.
    computed: Duration,
}

/// A token's mask: the allowed tokens (bit `i % 32` of word `i / 32`) and how long computing
/// it took.
pub(super) struct TokenMask<'a> {
    pub(super) words: &'a [u32],
    pub(super) took: Duration,
}

impl Constrained {
    /// A fresh matcher of `grammar`; its first mask was computed with the grammar.
    pub(super) fn new(grammar: &Grammar, limit: Duration) -> Self {
        Self {
            slot: Slot::Here(Box::new(Matcher::new(grammar))),
            limit,
            waited: Duration::ZERO,
            masks: 0,
            computed: Duration::ZERO,
        }
    }

    /// Starts computing the next mask on a thread of its own.
    fn prefetch(&mut self) {
        let Slot::Here(_) = &self.slot else { return };
        let gone = Slot::Gone(String::new());
        let Slot::Here(mut matcher) = std::mem::replace(&mut self.slot, gone) else {
            unreachable!("matched above")
        };
        let (tx, rx) = channel();
        // The compile's stack (see `CONSTRAINT_STACK`): a mask walks the same grammar.
        let spawned = std::thread::Builder::new()
            .name("k3-mask".into())
            .stack_size(k3_structured::CONSTRAINT_STACK)
            .spawn(move || {
                let outcome = matcher.mask().map(|_| ());
                // The sequence may have ended meanwhile: then nobody waits.
                let _ = tx.send((matcher, outcome));
            });
        self.slot = match spawned {
            Ok(_) => Slot::Away(rx, Instant::now()),
            Err(e) => Slot::Gone(format!("no thread for the output constraint's mask: {e}")),
        };
    }

    /// The next token's mask, once ready; an error (the request fails with it) if its
    /// computation failed or took longer than the bound.
    pub(super) fn mask(&mut self) -> Result<TokenMask<'_>, String> {
        if let Slot::Away(rx, since) = &self.slot {
            let waited_from = Instant::now();
            let left = self.limit.saturating_sub(since.elapsed());
            let computed = rx.recv_timeout(left);
            self.waited += waited_from.elapsed();
            self.slot = match computed {
                Ok((matcher, Ok(()))) => Slot::Here(matcher),
                Ok((_, Err(e))) => Slot::Gone(failure(&e)),
                Err(RecvTimeoutError::Timeout) => Slot::Gone(format!(
                    "the output constraint's mask took longer than the limit of {} ms per token \
                     (--max-mask-ms); the request was stopped",
                    self.limit.as_millis()
                )),
                Err(RecvTimeoutError::Disconnected) => {
                    Slot::Gone("the output constraint's mask thread panicked".into())
                }
            };
        }
        let matcher = match &mut self.slot {
            Slot::Here(matcher) => matcher,
            Slot::Gone(why) => return Err(why.clone()),
            Slot::Away(..) => unreachable!("taken back above"),
        };
        // Computed on the thread (then this returns it from the matcher's cache), or here.
        matcher.mask().map_err(|e| failure(&e))?;
        let total = matcher.mask_time();
        let took = total.saturating_sub(self.computed);
        self.computed = total;
        self.masks += 1;
        let mask = matcher.mask().map_err(|e| failure(&e))?;
        Ok(TokenMask {
            words: mask.words(),
            took,
        })
    }

    /// Takes the sampled token and starts the next mask; an error if the grammar refuses it
    /// (a forced token of a test script can be refused).
    pub(super) fn commit(&mut self, token: u32, more: bool) -> Result<(), String> {
        let matcher = match &mut self.slot {
            Slot::Here(matcher) => matcher,
            Slot::Gone(why) => return Err(why.clone()),
            Slot::Away(..) => return Err("the next token's mask was not taken".into()),
        };
        matcher
            .commit(token)
            .map_err(|e| format!("the output constraint refused token {token}: {e}"))?;
        if more {
            self.prefetch();
        }
        Ok(())
    }

    /// Total time the matcher spent computing masks (on its thread or here).
    pub(super) fn mask_time(&self) -> Option<Duration> {
        match &self.slot {
            Slot::Here(matcher) => Some(matcher.mask_time()),
            _ => None,
        }
    }
}

/// Why a request's constraint failed, naming the flag where it is the mask-time bound.
fn failure(e: &Error) -> String {
    match e {
        Error::MaskTime { .. } => format!("the output constraint failed: {e} (--max-mask-ms)"),
        other => format!("the output constraint failed: {other}"),
    }
}
