//! What one engine step feeds ([`plan`]): every decoding sequence's next token first, then
//! chunks of the prompts being prefilled, oldest request first, within the step's token
//! budget (`--step-tokens`). One forward pass then reads each weight once for all of them
//! (`k3_model::model::Model::step`); the bits of every sequence are the same whoever shares
//! its steps and however its prompt is cut (the forward pass is batch-invariant).

use std::ops::Range;

/// Where a sequence stands, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Standing {
    /// Prompt tokens its session has consumed.
    pub(super) fed: usize,
    /// Its prompt's length.
    pub(super) prompt: usize,
    /// Where its prompt must stop once on the way (a chat's system block, for the prompt
    /// cache's snapshot there), if anywhere.
    pub(super) stop_at: Option<usize>,
    /// Drafted tokens it feeds after its last one this step (decoding sequences).
    pub(super) drafts: usize,
}

impl Standing {
    fn prefilling(self) -> bool {
        self.fed < self.prompt
    }
}

/// What a step feeds one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Feed {
    /// Its last sampled token.
    Decode,
    /// These prompt tokens (a range into its prompt).
    Prompt(Range<usize>),
}

/// The step over `standings` (in admission order, oldest first) under a budget of `budget`
/// tokens: `(index, feed)` pairs, decodes first. Decodes always go (a sequence never waits a
/// step for a token), with their drafts (chosen within the budget beforehand); prompt chunks
/// fill what is left of the budget, at least one token a step so a prompt always advances,
/// each stopping at its `stop_at` and at its end.
pub(super) fn plan(standings: &[Standing], budget: usize) -> Vec<(usize, Feed)> {
    let mut feeds: Vec<(usize, Feed)> = standings
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.prefilling())
        .map(|(i, _)| (i, Feed::Decode))
        .collect();
    let decode_tokens: usize = feeds.iter().map(|(i, _)| 1 + standings[*i].drafts).sum();
    let mut left = budget.saturating_sub(decode_tokens).max(1);
    for (i, s) in standings.iter().enumerate() {
        if left == 0 {
            break;
        }
        if !s.prefilling() {
            continue;
        }
        let end = match s.stop_at {
            Some(stop) if stop > s.fed && stop < s.prompt => stop,
            _ => s.prompt,
        };
        let n = (end - s.fed).min(left);
        feeds.push((i, Feed::Prompt(s.fed..s.fed + n)));
        left -= n;
    }
    feeds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoding() -> Standing {
        Standing {
            fed: 10,
            prompt: 10,
            stop_at: None,
            drafts: 0,
        }
    }

    fn prompt(fed: usize, len: usize, stop_at: Option<usize>) -> Standing {
        Standing {
            fed,
            prompt: len,
            stop_at,
            drafts: 0,
        }
    }

    #[test]
    fn decodes_first_then_prompts_oldest_first_within_the_budget() {
        let s = [
            prompt(0, 100, None),
            decoding(),
            prompt(5, 20, None),
            decoding(),
        ];
        assert_eq!(
            plan(&s, 16),
            [
                (1, Feed::Decode),
                (3, Feed::Decode),
                (0, Feed::Prompt(0..14)),
            ]
        );
        // The oldest prompt's end leaves room for the next one's chunk.
        let s = [prompt(90, 100, None), prompt(5, 20, None), decoding()];
        assert_eq!(
            plan(&s, 16),
            [
                (2, Feed::Decode),
                (0, Feed::Prompt(90..100)),
                (1, Feed::Prompt(5..10)),
            ]
        );
    }

    #[test]
    fn drafts_come_out_of_the_prompts_share_of_the_budget() {
        let mut drafting = decoding();
        drafting.drafts = 5;
        let s = [prompt(0, 100, None), drafting, decoding()];
        assert_eq!(
            plan(&s, 16),
            [
                (1, Feed::Decode),
                (2, Feed::Decode),
                (0, Feed::Prompt(0..9)),
            ]
        );
    }

    #[test]
    fn a_prompt_stops_at_its_system_block_and_always_advances() {
        let s = [prompt(0, 100, Some(30))];
        assert_eq!(plan(&s, 64), [(0, Feed::Prompt(0..30))]);
        let s = [prompt(30, 100, Some(30))];
        assert_eq!(plan(&s, 64), [(0, Feed::Prompt(30..94))]);
        // More decodes than the budget: every decode, and one prompt token.
        let s = [decoding(), decoding(), decoding(), prompt(0, 9, None)];
        let feeds = plan(&s, 2);
        assert_eq!(feeds.len(), 4);
        assert_eq!(feeds[3], (3, Feed::Prompt(0..1)));
    }

    /// However the budget cuts them, the chunks of each prompt are its tokens in order, once,
    /// and a step never holds more than the budget (or its decodes and one prompt token).
    #[test]
    fn chunks_cover_each_prompt_once_in_order() {
        for budget in [1, 2, 3, 7, 16, 64, 1000] {
            let mut s = vec![
                prompt(0, 37, Some(11)),
                decoding(),
                prompt(4, 9, None),
                prompt(0, 130, Some(0)),
            ];
            let mut seen: Vec<Vec<usize>> = vec![Vec::new(); s.len()];
            for _ in 0..1000 {
                let feeds = plan(&s, budget);
                if feeds.iter().all(|(_, f)| *f == Feed::Decode) {
                    break;
                }
                let decodes = feeds.iter().filter(|(_, f)| *f == Feed::Decode).count();
                let prompt_tokens: usize = feeds
                    .iter()
                    .map(|(_, f)| match f {
                        Feed::Prompt(r) => r.len(),
                        Feed::Decode => 0,
                    })
                    .sum();
                assert!(prompt_tokens >= 1);
                assert!(decodes + prompt_tokens <= budget.max(decodes + 1));
                for (i, f) in feeds {
                    if let Feed::Prompt(r) = f {
                        assert_eq!(r.start, s[i].fed);
                        assert!(
                            s[i].stop_at
                                .is_none_or(|stop| r.start >= stop || r.end <= stop)
                        );
                        seen[i].extend(r.clone());
                        s[i].fed = r.end;
                    }
                }
            }
            assert_eq!(seen[0], (0..37).collect::<Vec<_>>(), "budget {budget}");
            assert_eq!(seen[2], (4..9).collect::<Vec<_>>(), "budget {budget}");
            assert_eq!(seen[3], (0..130).collect::<Vec<_>>(), "budget {budget}");
        }
    }
}
