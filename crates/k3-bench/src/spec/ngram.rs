//! The real drafter on a code-editing prompt: a chat turn that gives a block of code and asks
//! for it back with an edit, decoded greedily without drafts and with the n-gram drafter over
//! prompt and output (`k3_model::speculate::NgramIndex`), in pairs run pass by pass. A model
//! that quotes its input gets long drafts accepted; a synthetic checkpoint's random weights
//! never quote it, which the report says rather than hides.

use anyhow::{Result, ensure};
use k3_model::model::Model;
use k3_model::speculate::{MAX_N, MIN_N, NgramIndex};

use crate::generate::{Decoded, Decoder, Drafter, Mode, decode_pair};
use crate::oracle::first_difference;
use crate::stats::median;

/// Drafts from the sequence's own tokens.
struct Ngram {
    index: NgramIndex,
    /// Passes it was asked for a draft, and how many it had one for.
    asked: usize,
    found: usize,
}

impl Drafter for Ngram {
    fn propose(&mut self, limit: usize) -> Vec<u32> {
        let draft = self.index.draft(limit).tokens;
        self.asked += 1;
        self.found += usize::from(!draft.is_empty());
        draft
    }

    fn emitted(&mut self, tokens: &[u32]) {
        self.index.extend(tokens);
    }
}

/// Decodes `count` tokens after `prompt` off and on in `pairs` pairs, each run pass by pass;
/// prints each pair, the median speedup, the acceptance and whether the output quotes the
/// prompt at all.
pub(crate) fn run(
    model: &Model<'_>,
    prompt: &[u32],
    count: usize,
    curve: &[f64],
    max_draft: usize,
    pairs: usize,
) -> Result<()> {
    let mut ratios = Vec::with_capacity(pairs);
    let mut last = None;
    for pair in 0..pairs {
        let mut drafter = Ngram {
            index: NgramIndex::new(MIN_N, MAX_N),
            asked: 0,
            found: 0,
        };
        drafter.index.extend(prompt);
        let plain = Decoder::new(model, prompt, count, Mode::Off)?;
        let (off, on) = {
            let mode = Mode::On {
                drafter: &mut drafter,
                curve,
                max_draft,
            };
            let on = Decoder::new(model, prompt, count, mode)?;
            // Pass by pass; off or on first on a tie by turns.
            decode_pair(plain, on, pair % 2 == 0)?
        };
        ensure!(
            on.tokens == off.tokens,
            "pair {pair}: the n-gram run's tokens differ from the plain decode's (first at {})",
            first_difference(&on.tokens, &off.tokens)
        );
        let ratio = on.tokens_per_second() / off.tokens_per_second();
        println!(
            "n-gram pair {pair}: off {:.3} tokens/s, on {:.3} tokens/s ({} passes, {:.2} tokens per pass, a draft found at {} of {} passes, {} of {} drafts accepted): {ratio:.3}×; tokens identical: yes",
            off.tokens_per_second(),
            on.tokens_per_second(),
            on.passes(),
            on.tokens_per_pass(),
            drafter.found,
            drafter.asked,
            on.accepted,
            on.drafted,
        );
        ratios.push(ratio);
        last = Some(on);
    }
    let on: Decoded = last.expect("at least one pair");
    let quoted = longest_quote(&on.tokens, prompt);
    println!(
        "n-gram drafter: prompt {} tokens, {} generated; acceptance {:.2}, {:.2} tokens per pass, on/off {:.3}× (median of {pairs}); the output's longest run found in the prompt: {quoted} tokens",
        prompt.len(),
        on.tokens.len(),
        on.acceptance(),
        on.tokens_per_pass(),
        median(&ratios),
    );
    if quoted <= MIN_N {
        println!(
            "the output never repeats the prompt (no run longer than the drafter's {MIN_N}-token \
             match): synthetic weights do not follow the request, so the n-gram drafter has \
             little or nothing to propose and this figure says nothing of a real model's"
        );
    }
    Ok(())
}

/// The length of the longest run of `output` that occurs somewhere in `prompt`.
fn longest_quote(output: &[u32], prompt: &[u32]) -> usize {
    // Longest common substring, one row of the table at a time.
    let mut best = 0;
    let mut previous = vec![0usize; prompt.len() + 1];
    for &o in output {
        let mut row = vec![0usize; prompt.len() + 1];
        for (j, &p) in prompt.iter().enumerate() {
            if o == p {
                row[j + 1] = previous[j] + 1;
                best = best.max(row[j + 1]);
            }
        }
        previous = row;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_quote_is_the_longest_common_run() {
        assert_eq!(longest_quote(&[9, 1, 2, 3, 8], &[0, 1, 2, 3, 4, 1, 2]), 3);
        assert_eq!(longest_quote(&[5, 6], &[1, 2]), 0);
        assert_eq!(longest_quote(&[], &[1]), 0);
    }
}
