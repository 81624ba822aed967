//! Greedy decoding, plain or speculative, as the engine would run one sequence: a prompt
//! prefilled, then passes of the last sampled token and up to k drafts (k chosen by the
//! policy from the sequence's acceptance and the cost curve), logits after every token of the
//! pass, the drafts kept while the sampler agrees, the sampler's token at the first mismatch,
//! and the session rolled back to the kept tokens.

use std::time::Instant;

use anyhow::{Result, ensure};
use k3_model::model::{Model, Want};
use k3_model::sampling::{Sampler, SamplingParams};
use k3_model::speculate::{Acceptance, CostModel, choose};

/// What proposes a sequence's next tokens.
pub(crate) trait Drafter {
    /// Up to `limit` tokens proposed to follow the sequence's output so far (fewer, or none,
    /// where it has nothing to propose).
    fn propose(&mut self, limit: usize) -> Vec<u32>;

    /// The tokens the sequence just emitted, in order.
    fn emitted(&mut self, tokens: &[u32]);
}

/// How a decode drafts.
pub(crate) enum Mode<'d> {
    /// No drafts: one token per pass.
    Off,
    /// Drafts from `drafter`, at most `max_draft` per pass, k chosen by the policy with a cost
    /// model seeded from `curve` (seconds of a pass of 1, 2, ... tokens) and refined by the
    /// passes' own times.
    On {
        drafter: &'d mut dyn Drafter,
        curve: &'d [f64],
        max_draft: usize,
    },
}

/// One decode's output and what it took.
#[derive(Debug, Clone)]
pub(crate) struct Decoded {
    /// The tokens after the prompt, the first sampled from the prompt's logits.
    pub(crate) tokens: Vec<u32>,
    /// Wall time of the passes after the prompt (the rollbacks and sampling included): what
    /// the `tokens.len() - 1` decoded tokens took.
    pub(crate) seconds: f64,
    /// Forward passes after the prompt.
    pub(crate) passes: usize,
    /// Drafted tokens fed to the passes, and how many of them were accepted.
    pub(crate) drafted: usize,
    pub(crate) accepted: usize,
}

impl Decoded {
    /// Decoded tokens per second (the prompt's token left out).
    pub(crate) fn tokens_per_second(&self) -> f64 {
        (self.tokens.len() - 1) as f64 / self.seconds
    }

    /// Tokens emitted per pass.
    pub(crate) fn tokens_per_pass(&self) -> f64 {
        (self.tokens.len() - 1) as f64 / self.passes as f64
    }

    /// Fraction of the drafted tokens accepted (0 where none was drafted).
    pub(crate) fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Greedy decoding of `count` tokens after `prompt` on a fresh session of `model`.
pub(crate) fn decode(
    model: &Model<'_>,
    prompt: &[u32],
    count: usize,
    mut mode: Mode<'_>,
) -> Result<Decoded> {
    ensure!(!prompt.is_empty(), "a decode needs a prompt");
    let mut session = model.session();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(greedy, prompt);
    let ids: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let logits = model.prefill(&mut session, &ids, ids.len())?;
    let first = sampler.sample(&logits).token;
    let mut tokens = vec![first];
    let (mut cost, mut acceptance) = match &mut mode {
        Mode::Off => (CostModel::new(), Acceptance::new()),
        Mode::On { drafter, curve, .. } => {
            drafter.emitted(&tokens);
            (CostModel::with_curve(curve), Acceptance::new())
        }
    };
    let (mut passes, mut drafted, mut accepted) = (0, 0, 0);
    let start = Instant::now();
    while tokens.len() < count {
        // A pass emits at most its drafts and one more: no draft past the count.
        let room = count - tokens.len() - 1;
        let drafts = match &mut mode {
            Mode::Off => Vec::new(),
            Mode::On {
                drafter, max_draft, ..
            } => {
                let mut proposed = drafter.propose(room.min(*max_draft));
                proposed.truncate(room.min(*max_draft));
                let k = choose(acceptance.rate(), proposed.len(), *max_draft, 0, 0.0, &cost);
                proposed.truncate(k);
                proposed
            }
        };
        let last = *tokens.last().expect("the prompt's token");
        let feed: Vec<usize> = std::iter::once(last)
            .chain(drafts.iter().copied())
            .map(|t| t as usize)
            .collect();
        if !drafts.is_empty() {
            session.checkpoint();
        }
        let at = session.position();
        let pass = Instant::now();
        let rows = model
            .step_rows(&mut [(&mut session, &feed[..])], &[Want::All])?
            .pop()
            .expect("one group in, one out");
        cost.observe(feed.len(), pass.elapsed().as_secs_f64());
        passes += 1;
        let mut kept = 0;
        let before = tokens.len();
        for (i, row) in rows.iter().enumerate() {
            let token = sampler.sample(row).token;
            tokens.push(token);
            if drafts.get(i) != Some(&token) {
                break;
            }
            kept += 1;
        }
        if drafts.is_empty() {
            acceptance.idle();
        } else {
            if kept == drafts.len() {
                session.commit();
            } else {
                // The last token and the kept drafts stay; the rest is taken back.
                model.rollback(&mut session, at + 1 + kept)?;
            }
            acceptance.record(drafts.len(), kept);
            drafted += drafts.len();
            accepted += kept;
        }
        if let Mode::On { drafter, .. } = &mut mode {
            drafter.emitted(&tokens[before..]);
        }
    }
    Ok(Decoded {
        tokens,
        seconds: start.elapsed().as_secs_f64(),
        passes,
        drafted,
        accepted,
    })
}
