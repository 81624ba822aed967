//! Speculative decoding in the engine (`--spec ngram`): before a step, each decoding sequence
//! may get drafted tokens ([`Speculator::plan`]) from its own prompt and output (an n-gram
//! index) or from its tenant's earlier outputs (a suffix cache within `--spec-cache-mb`), as
//! many as pay for themselves by the pass cost measured so far and the sequence's acceptance
//! ([`k3_model::speculate::choose`]). The step feeds its last token and the drafts in one
//! group and takes logits after each; the sampler then draws token by token, drafts are kept
//! while each is the token drawn, and the session is rolled back past the first that is not
//! (`run`'s verify). The output is what decoding one token a step gives, bit for bit: the
//! forward pass is batch-invariant and the sampler draws exactly as often.

use k3_model::speculate::{Acceptance, CostModel, NgramIndex, SuffixCache, choose};

use crate::prompt_cache::Namespace;

/// How the engine speculates (from `--spec`, `--spec-max-draft`, `--spec-cache-mb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecOptions {
    /// Draft with n-grams of the sequence and the cross-request cache (`--spec ngram`); off
    /// (`--spec off`): one token a step.
    pub ngram: bool,
    /// Drafts per sequence and step at most (the cost curve usually stops sooner).
    pub max_draft: usize,
    /// Bytes of earlier outputs (and their index) kept to draft from, per server.
    pub cache_bytes: usize,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            ngram: false,
            max_draft: k3_model::speculate::DEFAULT_MAX_DRAFT,
            cache_bytes: 64 << 20,
        }
    }
}

/// One sequence's drafting: its tokens indexed, its acceptance, the drafts of the coming step
/// and its counts.
#[derive(Debug)]
pub(super) struct Drafting {
    index: NgramIndex,
    acceptance: Acceptance,
    /// Drafted tokens fed after its last token in the coming step (empty: a plain decode).
    pub(super) draft: Vec<u32>,
    pub(super) drafted: usize,
    pub(super) accepted: usize,
    pub(super) passes: usize,
}

impl Drafting {
    /// Appends a sampled token to what it drafts from.
    pub(super) fn push(&mut self, token: u32) {
        self.index.push(token);
    }

    /// Records a verify pass: `accepted` of `drafted` tokens were the sampler's.
    pub(super) fn record(&mut self, drafted: usize, accepted: usize) {
        self.acceptance.record(drafted, accepted);
        self.drafted += drafted;
        self.accepted += accepted;
        self.passes += 1;
    }
}

/// The engine's speculation: its options, the pass cost by token count, the cross-request
/// cache. Driven by the engine thread alone.
#[derive(Debug)]
pub(super) struct Speculator {
    options: SpecOptions,
    cost: CostModel,
    cache: SuffixCache<Namespace>,
}

/// A decoding sequence as the planner sees it.
pub(super) struct Candidate<'s> {
    pub(super) drafting: &'s mut Drafting,
    pub(super) namespace: Namespace,
    /// Tokens it may still generate after the next one (drafts past that are wasted).
    pub(super) room: usize,
}

impl Speculator {
    pub(super) fn new(options: SpecOptions) -> Self {
        Self {
            options,
            cost: CostModel::new(),
            cache: SuffixCache::new(if options.ngram {
                options.cache_bytes
            } else {
                0
            }),
        }
    }

    /// A sequence's drafting state, when speculation is on and the request allows it; its
    /// prompt indexed.
    pub(super) fn drafting(&self, allowed: bool, prompt: &[u32]) -> Option<Drafting> {
        (self.options.ngram && allowed && self.options.max_draft > 0).then(|| {
            let mut index = NgramIndex::new(k3_model::speculate::MIN_N, k3_model::speculate::MAX_N);
            index.extend(prompt);
            Drafting {
                index,
                acceptance: Acceptance::new(),
                draft: Vec::new(),
                drafted: 0,
                accepted: 0,
                passes: 0,
            }
        })
    }

    /// Sets the drafts of the coming step for `candidates` (in admission order), of
    /// `decodes` decoding sequences in all, within `room` drafted tokens: each draft the
    /// length that maximises the step's expected tokens per second at the cost curve measured
    /// so far, given the drafts already chosen.
    pub(super) fn plan(&mut self, candidates: Vec<Candidate<'_>>, decodes: usize, room: usize) {
        let mut step_tokens = decodes.saturating_sub(1);
        let mut step_yield = step_tokens as f64;
        let mut room = room;
        for Candidate {
            drafting,
            namespace,
            room: left,
        } in candidates
        {
            drafting.draft.clear();
            let limit = self.options.max_draft.min(room).min(left);
            let mut found = drafting.index.draft(limit);
            if found.tokens.is_empty() {
                found = self.cache.draft(&namespace, drafting.index.tokens(), limit);
            }
            let p = drafting.acceptance.rate();
            let k = choose(
                p,
                found.tokens.len(),
                limit,
                step_tokens,
                step_yield,
                &self.cost,
            );
            if k == 0 {
                // Nothing to draft says nothing about acceptance; a draft declined lets the
                // estimate drift back so it is tried again now and then.
                if !found.tokens.is_empty() {
                    drafting.acceptance.idle();
                }
                continue;
            }
            drafting.draft.extend_from_slice(&found.tokens[..k]);
            room -= k;
            // This sequence now counts as the rest of the step for those after it.
            step_tokens += k;
            step_yield += (0..k).map(|i| p.powi(i as i32 + 1)).sum::<f64>();
        }
    }

    /// A step of `tokens` tokens took `seconds`: the cost curve learns it.
    pub(super) fn observe(&mut self, tokens: usize, seconds: f64) {
        if self.options.ngram {
            self.cost.observe(tokens, seconds);
        }
    }

    /// A finished answer's tokens, for later requests of its namespace to draft from.
    pub(super) fn remember(&mut self, namespace: Namespace, output: &[u32]) {
        if self.options.ngram {
            self.cache.insert(namespace, output);
        }
    }
}
