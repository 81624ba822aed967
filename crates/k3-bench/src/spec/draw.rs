//! The oracle drafter: it knows the true continuation (a plain greedy decode's) and proposes,
//! for each drafted position, the true token with probability p, drawn independently from a
//! seeded generator; from its first wrong token on, every draft is wrong. So a draft of k is
//! accepted up to its first miss, exactly as a drafter of acceptance rate p would be, and the
//! rate is the only thing that varies between runs.

use crate::generate::Drafter;

/// Proposes the true continuation, each token right with probability `p`.
#[derive(Debug, Clone)]
pub(crate) struct Oracle {
    /// The true tokens after the prompt (the first is the prompt's own).
    truth: Vec<u32>,
    /// Tokens the sequence has emitted: the next draft starts at `truth[emitted]`.
    emitted: usize,
    p: f64,
    vocab: u32,
    rng: SplitMix64,
}

impl Oracle {
    /// An oracle over `truth` (ids below `vocab`, at least 2 of them) of acceptance rate `p`,
    /// its draws seeded by `seed`.
    pub(crate) fn new(truth: Vec<u32>, p: f64, vocab: u32, seed: u64) -> Self {
        assert!(vocab >= 2, "a wrong token needs a vocabulary of two");
        Self {
            truth,
            emitted: 0,
            p,
            vocab,
            rng: SplitMix64(seed),
        }
    }
}

impl Drafter for Oracle {
    fn propose(&mut self, limit: usize) -> Vec<u32> {
        let next = &self.truth[self.emitted.min(self.truth.len())..];
        let mut right = true;
        next.iter()
            .take(limit)
            .map(|&true_token| {
                right = right && self.rng.uniform() < self.p;
                if right {
                    true_token
                } else {
                    // Any other id: 1 to vocab - 1 past the true one, wrapped.
                    let shift = 1 + self.rng.next() % u64::from(self.vocab - 1);
                    ((u64::from(true_token) + shift) % u64::from(self.vocab)) as u32
                }
            })
            .collect()
    }

    fn emitted(&mut self, tokens: &[u32]) {
        self.emitted += tokens.len();
    }
}

/// SplitMix64: small, seeded, and good enough for Bernoulli draws.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 bits.
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn truth(n: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 % 50).collect()
    }

    /// The length of the draft's prefix that is the truth's.
    fn right_prefix(draft: &[u32], truth: &[u32]) -> usize {
        draft.iter().zip(truth).take_while(|(d, t)| d == t).count()
    }

    #[test]
    fn at_rates_zero_and_one_every_draft_is_wrong_or_right() {
        let truth = truth(40);
        let mut never = Oracle::new(truth.clone(), 0.0, 50, 1);
        let mut always = Oracle::new(truth.clone(), 1.0, 50, 1);
        never.emitted(&truth[..3]);
        always.emitted(&truth[..3]);
        let wrong = never.propose(8);
        assert_eq!(wrong.len(), 8);
        assert!(
            wrong
                .iter()
                .zip(&truth[3..])
                .all(|(d, t)| d != t && *d < 50)
        );
        assert_eq!(always.propose(8), truth[3..11]);
        // Never past the truth's end.
        always.emitted(&truth[3..38]);
        assert_eq!(always.propose(8), truth[38..]);
    }

    #[test]
    fn once_wrong_the_rest_of_the_draft_is_wrong() {
        let truth = truth(40);
        let mut oracle = Oracle::new(truth.clone(), 0.6, 50, 7);
        for _ in 0..2000 {
            let draft = oracle.propose(12);
            let right = right_prefix(&draft, &truth);
            assert!(
                draft.iter().zip(&truth).skip(right).all(|(d, t)| d != t),
                "{draft:?}"
            );
        }
    }

    /// A draft of k is right up to position i with probability p^i: the accepted length of a
    /// verify pass is what a drafter of acceptance rate p gives.
    #[test]
    fn the_right_prefix_is_geometric_in_p() {
        let truth = truth(40);
        let draws = 40_000;
        for p in [0.3, 0.5, 0.7, 0.9] {
            let mut oracle = Oracle::new(truth.clone(), p, 50, 42);
            let mut at_least = [0usize; 9];
            for _ in 0..draws {
                let right = right_prefix(&oracle.propose(8), &truth);
                for count in &mut at_least[..=right] {
                    *count += 1;
                }
            }
            for (i, &count) in at_least.iter().enumerate() {
                let expected = p.powi(i as i32);
                let seen = count as f64 / draws as f64;
                // Four standard deviations of a binomial proportion.
                let sd = (expected * (1.0 - expected) / draws as f64).sqrt();
                assert!(
                    (seen - expected).abs() <= 4.0 * sd + 1e-12,
                    "p {p}, {i} right: {seen} against {expected}"
                );
            }
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_drafts() {
        let drafts = |seed| {
            let mut oracle = Oracle::new(truth(40), 0.5, 50, seed);
            (0..50).map(|_| oracle.propose(6)).collect::<Vec<_>>()
        };
        assert_eq!(drafts(3), drafts(3));
        assert_ne!(drafts(3), drafts(4));
    }
}
