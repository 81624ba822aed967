//! Greedy decoding, plain or speculative, as the engine would run one sequence: a prompt
//! prefilled, then passes of the last sampled token and up to k drafts (k chosen by the
//! policy from the sequence's acceptance and the cost curve), logits after every token of the
//! pass, the drafts kept while the sampler agrees, the sampler's token at the first mismatch,
//! and the session rolled back to the kept tokens.

use std::time::Instant;

use anyhow::{Result, ensure};
use k3_model::model::{Model, Session, Want};
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
    /// Wall time of the passes after the prompt (drafting, rollbacks and sampling included),
    /// summed pass by pass: what the `tokens.len() - 1` decoded tokens took.
    pub(crate) seconds: f64,
    /// Drafted tokens fed to the passes, and how many of them were accepted.
    pub(crate) drafted: usize,
    pub(crate) accepted: usize,
    /// `forward[n - 1]`: the passes of n tokens, their count and their seconds inside the
    /// forward pass (`step_rows`); the rest of `seconds` went to checkpoints, rollbacks,
    /// sampling and drafting.
    pub(crate) forward: Vec<(usize, f64)>,
}

impl Decoded {
    /// Forward passes after the prompt, all sizes together.
    pub(crate) fn passes(&self) -> usize {
        self.forward.iter().map(|&(count, _)| count).sum()
    }

    /// Decoded tokens per second (the prompt's token left out).
    pub(crate) fn tokens_per_second(&self) -> f64 {
        (self.tokens.len() - 1) as f64 / self.seconds
    }

    /// Tokens emitted per pass.
    pub(crate) fn tokens_per_pass(&self) -> f64 {
        (self.tokens.len() - 1) as f64 / self.passes() as f64
    }

    /// Seconds inside the forward passes, all sizes together.
    pub(crate) fn forward_seconds(&self) -> f64 {
        self.forward.iter().map(|&(_, s)| s).sum()
    }

    /// The passes by size, `n×count (mean ms)` for each size run, e.g. `1×12 (201.3 ms),
    /// 3×20 (236.0 ms)`: what a run's passes cost beside the cost curve.
    pub(crate) fn passes_by_size(&self) -> String {
        let sizes: Vec<String> = self
            .forward
            .iter()
            .enumerate()
            .filter(|(_, (count, _))| *count > 0)
            .map(|(i, &(count, s))| format!("{}×{count} ({:.1} ms)", i + 1, 1e3 * s / count as f64))
            .collect();
        sizes.join(", ")
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

/// One greedy decode in progress: its session, sampler and tokens, and what its passes took.
/// [`decode`] runs one alone; [`decode_pair`] runs a plain and a speculative one pass by pass.
pub(crate) struct Decoder<'m, 'd> {
    model: &'m Model<'m>,
    session: Session,
    sampler: Sampler,
    tokens: Vec<u32>,
    count: usize,
    mode: Mode<'d>,
    cost: CostModel,
    acceptance: Acceptance,
    done: Decoded,
}

impl<'m, 'd> Decoder<'m, 'd> {
    /// A decode of `count` tokens after `prompt` on a fresh session of `model`: the prompt
    /// prefilled (untimed) and its token sampled.
    pub(crate) fn new(
        model: &'m Model<'m>,
        prompt: &[u32],
        count: usize,
        mut mode: Mode<'d>,
    ) -> Result<Self> {
        ensure!(!prompt.is_empty(), "a decode needs a prompt");
        let mut session = model.session();
        let greedy = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(greedy, prompt);
        let ids: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
        let logits = model.prefill(&mut session, &ids, ids.len())?;
        let tokens = vec![sampler.sample(&logits).token];
        let cost = match &mut mode {
            Mode::Off => CostModel::new(),
            Mode::On { drafter, curve, .. } => {
                drafter.emitted(&tokens);
                CostModel::with_curve(curve)
            }
        };
        Ok(Self {
            model,
            session,
            sampler,
            tokens,
            count,
            mode,
            cost,
            acceptance: Acceptance::new(),
            done: Decoded {
                tokens: Vec::new(),
                seconds: 0.0,
                drafted: 0,
                accepted: 0,
                forward: Vec::new(),
            },
        })
    }

    /// All `count` tokens are out.
    fn finished(&self) -> bool {
        self.tokens.len() >= self.count
    }

    /// The fraction of its tokens out.
    fn progress(&self) -> f64 {
        self.tokens.len() as f64 / self.count as f64
    }

    /// One pass: the last token and the drafts the policy keeps, the sampler's tokens, the
    /// rollback; its wall time (drafting and sampling included) added to the decode's.
    fn pass(&mut self) -> Result<()> {
        let start = Instant::now();
        let (model, tokens) = (self.model, &mut self.tokens);
        // A pass emits at most its drafts and one more: no draft past the count.
        let room = self.count - tokens.len() - 1;
        let drafts = match &mut self.mode {
            Mode::Off => Vec::new(),
            Mode::On {
                drafter, max_draft, ..
            } => {
                let mut proposed = drafter.propose(room.min(*max_draft));
                proposed.truncate(room.min(*max_draft));
                let rate = self.acceptance.rate();
                let k = choose(rate, proposed.len(), *max_draft, 0, 0.0, &self.cost);
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
            self.session.checkpoint();
        }
        let at = self.session.position();
        let pass = Instant::now();
        let rows = model
            .step_rows(&mut [(&mut self.session, &feed[..])], &[Want::All])?
            .pop()
            .expect("one group in, one out");
        let took = pass.elapsed().as_secs_f64();
        self.cost.observe(feed.len(), took);
        let d = &mut self.done;
        if d.forward.len() < feed.len() {
            d.forward.resize(feed.len(), (0, 0.0));
        }
        d.forward[feed.len() - 1].0 += 1;
        d.forward[feed.len() - 1].1 += took;
        let mut kept = 0;
        let before = tokens.len();
        for (i, row) in rows.iter().enumerate() {
            let token = self.sampler.sample(row).token;
            tokens.push(token);
            if drafts.get(i) != Some(&token) {
                break;
            }
            kept += 1;
        }
        if drafts.is_empty() {
            self.acceptance.idle();
        } else {
            if kept == drafts.len() {
                self.session.commit();
            } else {
                // The last token and the kept drafts stay; the rest is taken back.
                model.rollback(&mut self.session, at + 1 + kept)?;
            }
            self.acceptance.record(drafts.len(), kept);
            d.drafted += drafts.len();
            d.accepted += kept;
        }
        if let Mode::On { drafter, .. } = &mut self.mode {
            drafter.emitted(&tokens[before..]);
        }
        d.seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// The decode's tokens and what its passes took.
    fn finish(self) -> Decoded {
        Decoded {
            tokens: self.tokens,
            ..self.done
        }
    }
}

/// Greedy decoding of `count` tokens after `prompt` on a fresh session of `model`.
pub(crate) fn decode(
    model: &Model<'_>,
    prompt: &[u32],
    count: usize,
    mode: Mode<'_>,
) -> Result<Decoded> {
    let mut decoder = Decoder::new(model, prompt, count, mode)?;
    while !decoder.finished() {
        decoder.pass()?;
    }
    Ok(decoder.finish())
}

/// A plain and a speculative decode run pass by pass, the one whose fraction of its tokens is
/// behind going next (on a tie the plain one where `off_leads`, else the speculative one:
/// callers take turns, so neither leads every pair), so both spread over the same seconds: on
/// this shared host the read rate moves by 20% from one minute to the next, and a decode run
/// after the other (12 s each) took that drift into their ratio. Each decode's time is the sum
/// of its own passes. Returns (off, on).
pub(crate) fn decode_pair<'m, 'd>(
    off: Decoder<'m, 'd>,
    on: Decoder<'m, 'd>,
    off_leads: bool,
) -> Result<(Decoded, Decoded)> {
    let (mut a, mut b) = if off_leads { (off, on) } else { (on, off) };
    while !(a.finished() && b.finished()) {
        let first = (a.finished(), a.progress());
        match first_goes_next(first, (b.finished(), b.progress())) {
            true => a.pass()?,
            false => b.pass()?,
        }
    }
    let (a, b) = (a.finish(), b.finish());
    Ok(if off_leads { (a, b) } else { (b, a) })
}

/// Whether the first of two decodes, each `(finished, progress)`, runs the next pass: the one
/// behind, the first on a tie, never a finished one (called while one is not).
fn first_goes_next(a: (bool, f64), b: (bool, f64)) -> bool {
    !a.0 && (b.0 || a.1 <= b.1)
}

#[cfg(test)]
mod tests {
    use super::first_goes_next;

    /// Two decodes of 64 tokens, one emitting a token per pass and one 2-3 per pass: run by
    /// [`first_goes_next`], neither gets ahead of the other by more than one of its passes,
    /// both finish, and the slower one's passes are spread over the whole run.
    #[test]
    fn a_pair_runs_pass_by_pass_at_the_same_pace() {
        let count = 64;
        let per_pass = [1usize, 1, 1]; // the plain decode
        let spec = [2usize, 3, 2]; // the speculative one, by turns
        let (mut a, mut b) = (1usize, 1usize);
        let (mut a_passes, mut b_passes) = (0usize, 0usize);
        let mut order = Vec::new();
        while a < count || b < count {
            let progress = |t: usize| t as f64 / count as f64;
            if first_goes_next((a >= count, progress(a)), (b >= count, progress(b))) {
                a = (a + per_pass[a_passes % 3]).min(count);
                a_passes += 1;
                order.push('a');
            } else {
                b = (b + spec[b_passes % 3]).min(count);
                b_passes += 1;
                order.push('b');
            }
            if a < count && b < count {
                let gap = a.abs_diff(b);
                assert!(gap <= 3, "{a} against {b} tokens after {order:?}");
            }
        }
        assert_eq!((a_passes, b_passes), (63, 27), "{order:?}");
        // The speculative decode's last pass comes in the last few passes of the run, not
        // half-way (as it would if each ran alone).
        let last_b = order.iter().rposition(|&c| c == 'b').unwrap();
        assert!(last_b + 4 >= order.len(), "{order:?}");
        // A finished decode is never picked, whatever its progress.
        assert!(!first_goes_next((true, 1.0), (false, 2.0)));
        assert!(first_goes_next((false, 0.9), (true, 1.0)));
    }
}
