//! The engine's use of the prompt cache ([`crate::prompt_cache`]): restore the longest cached
//! prefix of a prompt into a new session, and keep snapshots of sessions at the points a
//! later request may resume from. A cache problem never fails a request: a failed restore
//! goes cold with a warning, and a panic inside the cache turns the cache off (logged) while
//! the request carries on.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;

use k3_model::model::snapshot::file::Identity;
use k3_model::model::{Model, Session};

use crate::prompt_cache::{Namespace, PromptCache, PromptCacheStats, SpillOptions};

/// Spill files may take this many times the RAM budget on disk.
const DISK_BUDGET_FACTOR: u64 = 4;

/// The prompt cache's setup (`--prompt-cache-gb`, `--prompt-cache-dir`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptCacheOptions {
    /// Bytes of snapshots held in RAM; 0 turns the cache off.
    pub budget_bytes: usize,
    /// Where snapshots spill (at most four times `budget_bytes` of files) and
    /// are found again after a restart.
    pub dir: Option<PathBuf>,
}

/// The cache as the engine thread drives it; `None` inside when off.
pub(super) struct EngineCache {
    cache: Option<PromptCache>,
}

impl EngineCache {
    /// The cache `options` ask for; `identity` (read from the checkpoint) only when spilling.
    pub(super) fn open(options: &PromptCacheOptions, identity: impl FnOnce() -> Identity) -> Self {
        if options.budget_bytes == 0 {
            return Self { cache: None };
        }
        let spill = options.dir.as_ref().map(|dir| SpillOptions {
            dir: dir.clone(),
            budget_bytes: (options.budget_bytes as u64).saturating_mul(DISK_BUDGET_FACTOR),
            identity: identity(),
        });
        let cache = PromptCache::new(options.budget_bytes, spill);
        if let Some(dir) = &options.dir {
            let found = cache.stats();
            log::info!(
                "prompt cache: {} bytes of snapshot files found in {}, {} ignored",
                found.disk_bytes,
                dir.display(),
                found.ignored_files
            );
        }
        Self { cache: Some(cache) }
    }

    pub(super) fn is_on(&self) -> bool {
        self.cache.is_some()
    }

    pub(super) fn stats(&self) -> Option<PromptCacheStats> {
        self.cache.as_ref().map(PromptCache::stats)
    }

    /// Restores into `session` (fresh) the longest prefix of `prompt` cached for `namespace`
    /// that leaves at least its last token to prefill (whose logits the first output token is
    /// sampled from); returns the tokens restored, 0 when cold.
    pub(super) fn resume(
        &mut self,
        model: &Model<'_>,
        namespace: Namespace,
        session: &mut Session,
        prompt: &[usize],
    ) -> usize {
        let Some(lookup) = prompt.len().checked_sub(1).filter(|&n| n > 0) else {
            return 0;
        };
        let Some(hit) = self.guard("a lookup", |c| {
            c.longest_prefix(namespace, &prompt[..lookup])
        }) else {
            return 0;
        };
        let Some(hit) = hit else { return 0 };
        match model.restore(session, &hit.snapshot) {
            Ok(()) => hit.tokens,
            Err(e) => {
                log::warn!(
                    "prompt cache: a cached prefix of {} tokens not restored, prefilling cold: {e}",
                    hit.tokens
                );
                *session = model.session();
                0
            }
        }
    }

    /// Keeps a snapshot of `session`, which has been fed exactly `tokens`, for `namespace`;
    /// nothing when the cache is off, already holds `tokens` there, or the session is
    /// elsewhere.
    pub(super) fn save(&mut self, namespace: Namespace, tokens: &[usize], session: &Session) {
        if tokens.is_empty()
            || self
                .cache
                .as_ref()
                .is_none_or(|c| c.contains(namespace, tokens))
        {
            return;
        }
        if session.position() != tokens.len() {
            log::warn!(
                "prompt cache: a session at position {} offered for {} tokens: not cached",
                session.position(),
                tokens.len()
            );
            return;
        }
        let snapshot = Arc::new(session.snapshot());
        self.guard("an insert", |c| c.insert(namespace, tokens, snapshot));
    }

    /// Runs `f` on the cache, if on; a panic in it turns the cache off (logged).
    fn guard<R>(&mut self, what: &str, f: impl FnOnce(&mut PromptCache) -> R) -> Option<R> {
        let cache = self.cache.as_mut()?;
        match catch_unwind(AssertUnwindSafe(|| f(cache))) {
            Ok(r) => Some(r),
            Err(_) => {
                log::error!("prompt cache: a panic in {what}; the cache is off from now on");
                self.cache = None;
                None
            }
        }
    }
}
