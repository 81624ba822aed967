//! A compiled constraint: llguidance's parser for a [`Spec`] over one model's vocabulary,
//! built once per request and shared by its sequences.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::Logger;
use llguidance::api::GrammarInit;
use llguidance::toktrie::InferenceCapabilities;

use crate::error::Error;
use crate::mask::Mask;
use crate::spec::{Options, Spec, top_level};
use crate::vocab::Vocabulary;

/// The stack of the threads that compile a constraint or compute its masks (reserved, not
/// committed: only the pages a deep grammar touches are used). llguidance recurses once per
/// level of a `$ref` or rule chain: a 2,000-rule chain overflowed the 8 MB main thread, and a
/// 20,000-rule one compiled here with 175 MB more peak RSS (stack and heap), so at most ~9 KB a
/// level. llguidance itself refuses grammars of 65,535 symbols or more and JSON schemas past
/// its size limit, so no chain is deeper than that: ~0.6 GB at 9 KB, within 1 GiB.
pub const CONSTRAINT_STACK: usize = 1 << 30;

/// A compiled constraint, cheap to clone; each sequence follows it with its own
/// [`crate::Matcher`].
#[derive(Clone)]
pub struct Grammar {
    pub(crate) inner: Arc<Compiled>,
}

pub(crate) struct Compiled {
    pub(crate) vocab: Arc<Vocabulary>,
    /// The parser at the start of the output (every matcher starts as a clone of it; clones
    /// share llguidance's lexer cache).
    pub(crate) start: llguidance::Matcher,
    /// The mask at the start, computed while compiling.
    pub(crate) first_mask: Mask,
    pub(crate) mask_limit: Duration,
    /// [`Spec::Any`]: every id is allowed, those without bytes too, and llguidance is not asked.
    pub(crate) permissive: bool,
    compile_time: Duration,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("compile_time", &self.inner.compile_time)
            .field("first_mask_allows", &self.inner.first_mask.count())
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// Compiles `spec` for `vocab` and computes its first mask, within `options.limits`.
    ///
    /// It runs on a thread of its own with a stack of [`CONSTRAINT_STACK`] bytes: llguidance
    /// builds the grammar recursively, so a schema whose `$ref`s chain a few hundred
    /// definitions deep (or a Lark grammar of a few thousand chained rules) overflowed a 2 MB
    /// thread's stack, which aborts the whole process (a server taken down by one request).
    pub fn compile(vocab: &Arc<Vocabulary>, spec: &Spec, options: &Options) -> Result<Self, Error> {
        std::thread::scope(|scope| {
            let compiling = std::thread::Builder::new()
                .name("k3-compile".into())
                .stack_size(CONSTRAINT_STACK)
                .spawn_scoped(scope, || Self::compile_here(vocab, spec, options))
                .map_err(|e| {
                    Error::Invalid(format!("no thread to compile the constraint on: {e}"))
                })?;
            compiling
                .join()
                .unwrap_or_else(|_| Err(Error::Invalid("compiling the constraint failed".into())))
        })
    }

    fn compile_here(
        vocab: &Arc<Vocabulary>,
        spec: &Spec,
        options: &Options,
    ) -> Result<Self, Error> {
        let limits = &options.limits;
        let started = Instant::now();
        let parser = vocab.factory().create_parser_from_init_ext(
            GrammarInit::Serialized(top_level(spec, options)?),
            Logger::new(0, 0),
            InferenceCapabilities::default(),
            limits.parser_limits(),
        );
        let parser = parser.map_err(|e| Error::from_compile(e.to_string()))?;
        let mut start = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = start.get_error() {
            return Err(Error::from_compile(e));
        }
        let vob = start
            .compute_mask_or_eos()
            .map_err(|e| Error::from_compile(e.to_string()))?;
        let permissive = *spec == Spec::Any;
        let first_mask = Mask::from_vob(&vob, vocab, permissive);
        let took = started.elapsed();
        if took > limits.compile {
            return Err(Error::CompileTime {
                limit: limits.compile,
                took,
            });
        }
        if first_mask.count() == 0 {
            return Err(Error::Invalid("no token can start the output".into()));
        }
        Ok(Self {
            inner: Arc::new(Compiled {
                vocab: vocab.clone(),
                start,
                first_mask,
                mask_limit: limits.mask,
                permissive,
                compile_time: took,
            }),
        })
    }

    /// How long compiling took (with the first mask).
    pub fn compile_time(&self) -> Duration {
        self.inner.compile_time
    }

    /// The vocabulary it was compiled for.
    pub fn vocabulary(&self) -> &Arc<Vocabulary> {
        &self.inner.vocab
    }
}
