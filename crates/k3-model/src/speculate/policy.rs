//! How many tokens to draft: a forward pass's cost by token count, learned online
//! ([`CostModel`]); a sequence's acceptance rate ([`Acceptance`]); and the draft length that
//! maximises the step's expected tokens per second ([`choose`]).

/// Drafts per sequence and step at most. The cost curve caps it anyway ([`choose`] stops where
/// another token costs more than it is expected to bring); 8 bounds the verify pass where the
/// curve is flat and acceptance high, and little is lost by it: at p = 0.8 a pass with 8
/// drafts is expected to emit 4.3 tokens, with unboundedly many 5.
pub const DEFAULT_MAX_DRAFT: usize = 8;

/// Token counts a [`CostModel`] learns (1 to this): a decode step's, all sequences' last
/// tokens and drafts together. Longer passes (prefill chunks, wide batches) are not observed;
/// past this count the prior's cost per token is added.
pub const MAX_TOKENS: usize = 64;

/// Cost of a pass's extra token, as a fraction of a one-token pass, where nothing was
/// measured. A decode pass reads the weights once; an extra token adds its arithmetic and the
/// routed experts it picks that the others did not: in the release 16 of 896 experts per
/// token, 26 of the 137 GB a token reads (19%). Tokens of one continuation share many experts,
/// so 0.15 is a fair bound that still lets a first draft be tried at acceptance rates from
/// about 0.17; what is measured replaces it.
pub const PRIOR_TOKEN_COST: f64 = 0.15;

/// Weight of a new observation in a token count's running mean: step times wobble with the
/// experts the tokens route to, and 1/10 averages over about ten steps while still following a
/// change of load within a few dozen.
const COST_WEIGHT: f64 = 0.1;

/// Gain in expected tokens per second a draft must promise over none, so that drafting whose
/// benefit is within the estimates' noise is not done.
const MIN_GAIN: f64 = 0.02;

/// Acceptance rate assumed before anything was drafted, and its weight in drafted tokens: a
/// guess that gets a first draft tried and is outweighed by the first few tested tokens. With
/// the weight of one token, a sequence whose drafts are never accepted stops drafting after a
/// few failed passes (the estimate 0.5 / (1 + n) after n falls below the rate where one draft
/// pays): 6 drafted tokens in 64 steps on the k3-wide slice's measured curve, where the weight
/// of 4 (and every drafted token counted) gave 12-14 (PERFORMANCE.md phase 31).
const PRIOR_RATE: f64 = 0.5;
const PRIOR_WEIGHT: f64 = 1.0;

/// Tested tokens an [`Acceptance`] remembers (each recorded token discounts the older ones by
/// 1 - 1/32): long enough to average out one unlucky draft, short enough to follow a change
/// (a prompt's quoted part ends, code starts).
const MEMORY_TOKENS: f64 = 32.0;

/// Fraction of the gap to [`PRIOR_RATE`] an [`Acceptance`] closes per step without a draft.
/// At acceptance 0 the estimate settles near the rate p* where one draft starts to pay: a
/// failed probe lowers it by about p*/32, each idle step raises it by (0.5 - p*)/2048, so a
/// one-token probe comes every 64 p* / (0.5 - p*) steps (16 at 0.08 per extra token, where p*
/// is 0.10). Simulated over curves of 0.005 to 0.6 per extra token, probes took at most 0.5% of
/// the time; after acceptance returns, drafting resumes within a few dozen steps.
const IDLE_DRIFT: f64 = 1.0 / 2048.0;

/// A forward pass's time by token count, learned from the engine's steps. Only ratios are
/// used, so any time unit will do as long as one model gets one.
#[derive(Debug, Clone)]
pub struct CostModel {
    /// `mean[n - 1]`: running mean of the passes of n tokens seen; `None` until one is.
    mean: Vec<Option<f64>>,
    /// `relative[n - 1]`: estimated T(n) / T(1), recomputed on each observation.
    relative: Vec<f64>,
}

/// A running estimate of the probability that a drafted token of a sequence is accepted, given
/// that the drafts before it were.
#[derive(Debug, Clone)]
pub struct Acceptance {
    /// Discounted accepted and tested token counts ([`Acceptance::record`]), the prior's
    /// included.
    accepted: f64,
    tested: f64,
}

impl CostModel {
    /// A model with no observation: T(n) / T(1) = 1 + [`PRIOR_TOKEN_COST`] x (n - 1).
    pub fn new() -> Self {
        let mut model = Self {
            mean: vec![None; MAX_TOKENS],
            relative: vec![1.0; MAX_TOKENS],
        };
        model.refresh();
        model
    }

    /// A model seeded with a measured curve: `seconds[i]` is the time of a pass of `i + 1`
    /// tokens (up to [`MAX_TOKENS`] entries; later observations refine them).
    ///
    /// # Panics
    /// If the curve is longer than [`MAX_TOKENS`] or a time is not positive and finite.
    pub fn with_curve(seconds: &[f64]) -> Self {
        assert!(
            seconds.len() <= MAX_TOKENS,
            "a cost curve covers at most {MAX_TOKENS} token counts, got {}",
            seconds.len()
        );
        let mut model = Self::new();
        for (i, &time) in seconds.iter().enumerate() {
            assert!(
                time.is_finite() && time > 0.0,
                "a pass of {} tokens must take a positive time, got {time}",
                i + 1
            );
            model.mean[i] = Some(time);
        }
        model.refresh();
        model
    }

    /// Records that a pass of `tokens` tokens took `seconds`. Passes of 0 or more than
    /// [`MAX_TOKENS`] tokens and times that are not positive and finite are ignored.
    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if !(1..=MAX_TOKENS).contains(&tokens) || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let mean = &mut self.mean[tokens - 1];
        *mean = Some(match *mean {
            Some(old) => old + COST_WEIGHT * (seconds - old),
            None => seconds,
        });
        self.refresh();
    }

    /// Estimated T(n) / T(1) for a pass of `n` tokens (0 for none).
    pub fn relative(&self, n: usize) -> f64 {
        match n {
            0 => 0.0,
            1..=MAX_TOKENS => self.relative[n - 1],
            _ => self.relative[MAX_TOKENS - 1] + PRIOR_TOKEN_COST * (n - MAX_TOKENS) as f64,
        }
    }

    /// Recomputes the curve from the means: linear between observed counts; below the
    /// smallest, the prior's shape through it; above the largest, the prior's cost per token.
    /// A pass of more tokens is never cheaper, so noise cannot make a draft look free.
    fn refresh(&mut self) {
        let prior = |n: usize| 1.0 + PRIOR_TOKEN_COST * (n - 1) as f64;
        let observed: Vec<(usize, f64)> = (1..=MAX_TOKENS)
            .filter_map(|n| self.mean[n - 1].map(|time| (n, time)))
            .collect();
        let (Some(&(first, first_time)), Some(&(last, last_time))) =
            (observed.first(), observed.last())
        else {
            for n in 1..=MAX_TOKENS {
                self.relative[n - 1] = prior(n);
            }
            return;
        };
        let one = first_time / prior(first);
        let mut next = 0;
        let mut floor: f64 = 1.0;
        for n in 1..=MAX_TOKENS {
            while next < observed.len() && observed[next].0 < n {
                next += 1;
            }
            let time = if n <= first {
                one * prior(n)
            } else if n > last {
                last_time + PRIOR_TOKEN_COST * one * (n - last) as f64
            } else {
                // observed[next] is the first count >= n, observed[next - 1] the last below.
                let (hi, hi_time) = observed[next];
                let (lo, lo_time) = observed[next - 1];
                lo_time + (hi_time - lo_time) * (n - lo) as f64 / (hi - lo) as f64
            };
            floor = floor.max(time / one);
            self.relative[n - 1] = floor;
        }
    }
}

impl Default for CostModel {
    fn default() -> Self {
        Self::new()
    }
}

impl Acceptance {
    /// The prior: rate 0.5, with the weight of 1 tested token.
    pub fn new() -> Self {
        Self {
            accepted: PRIOR_RATE * PRIOR_WEIGHT,
            tested: PRIOR_WEIGHT,
        }
    }

    /// Records a verified draft: `accepted` of its `drafted` tokens (at most all) were taken.
    /// What is counted is the tokens the pass tested: the accepted ones and the first
    /// rejected one, if any. The drafts after a rejection were never compared with what the
    /// model would emit there (the sequence left the draft's path), so they say nothing of the
    /// rate [`choose`] takes, the chance that a draft is accepted given the ones before it
    /// were. Counted as rejections, they held the estimate of an oracle drafter right with
    /// probability 0.7 per token near 0.5 at 3-4 drafts per pass, and drafts short.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let accepted = accepted.min(drafted);
        let tested = accepted + usize::from(accepted < drafted);
        let keep = (1.0 - 1.0 / MEMORY_TOKENS).powf(tested as f64);
        self.accepted = self.accepted * keep + accepted as f64;
        self.tested = self.tested * keep + tested as f64;
    }

    /// Records a step without a draft: the estimate drifts toward the prior, so a sequence
    /// that stopped drafting probes again now and then.
    pub fn idle(&mut self) {
        self.accepted += IDLE_DRIFT * (PRIOR_RATE * self.tested - self.accepted);
    }

    /// The estimated probability that a drafted token is accepted.
    pub fn rate(&self) -> f64 {
        self.accepted / self.tested
    }
}

impl Default for Acceptance {
    fn default() -> Self {
        Self::new()
    }
}

/// The number of drafts k in `0..=min(available, max_draft)` that maximises the step's
/// expected throughput, (`step_yield` + E(k)) / T(`step_tokens` + 1 + k), where E(k) = 1 + p +
/// ... + p^k is what a pass feeding this sequence's last token and k drafts emits for it (the
/// drafts accepted in order, and the sampled token at the first mismatch or after the last).
/// `step_tokens` and `step_yield` are the tokens and expected output tokens of the rest of the
/// step so far (0 and 0.0 for a lone sequence). 0 unless the best k beats none by 2%, so that
/// a gain within the estimates' noise does not start drafting.
pub fn choose(
    p: f64,
    available: usize,
    max_draft: usize,
    step_tokens: usize,
    step_yield: f64,
    cost: &CostModel,
) -> usize {
    let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
    let none = (step_yield + 1.0) / cost.relative(step_tokens + 1);
    let (mut best, mut best_k) = (none * (1.0 + MIN_GAIN), 0);
    let (mut expected, mut power) = (1.0, 1.0);
    for k in 1..=available.min(max_draft) {
        power *= p;
        expected += power;
        let throughput = (step_yield + expected) / cost.relative(step_tokens + 1 + k);
        if throughput > best {
            (best, best_k) = (throughput, k);
        }
    }
    best_k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cost model with T(n) = 1 + `slope` x (n - 1) measured at every count.
    fn linear(slope: f64) -> CostModel {
        let curve: Vec<f64> = (0..MAX_TOKENS).map(|i| 1.0 + slope * i as f64).collect();
        CostModel::with_curve(&curve)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn without_observations_the_prior_alone() {
        let cost = CostModel::new();
        assert_eq!(cost.relative(0), 0.0);
        assert_eq!(cost.relative(1), 1.0);
        assert!(close(cost.relative(9), 1.0 + 8.0 * PRIOR_TOKEN_COST));
        assert!(close(
            cost.relative(MAX_TOKENS + 10),
            1.0 + (MAX_TOKENS + 9) as f64 * PRIOR_TOKEN_COST
        ));
    }

    #[test]
    fn interpolates_between_and_extrapolates_beyond_observed_counts() {
        let mut cost = CostModel::new();
        cost.observe(1, 0.2);
        cost.observe(5, 0.28);
        assert!(close(cost.relative(3), 1.2));
        assert!(close(cost.relative(5), 1.4));
        assert!(close(cost.relative(7), 1.4 + 2.0 * PRIOR_TOKEN_COST));
        // Below the smallest observed count, the prior's shape through it.
        let mut cost = CostModel::new();
        cost.observe(3, 2.6);
        assert!(close(cost.relative(3), 1.0 + 2.0 * PRIOR_TOKEN_COST));
        assert!(close(cost.relative(2) - 1.0, PRIOR_TOKEN_COST));
        // Ignored: no tokens, too many, no time.
        for (tokens, seconds) in [(0, 1.0), (MAX_TOKENS + 1, 1.0), (2, 0.0), (2, f64::NAN)] {
            cost.observe(tokens, seconds);
        }
        assert!(close(cost.relative(2) - 1.0, PRIOR_TOKEN_COST));
    }

    #[test]
    fn observations_are_a_running_mean_and_never_make_more_tokens_cheaper() {
        let mut cost = CostModel::new();
        cost.observe(1, 1.0);
        cost.observe(2, 2.0);
        cost.observe(2, 1.0);
        assert!(close(cost.relative(2), 2.0 - COST_WEIGHT));
        // A noisy fast pass of 3 tokens reads as no cheaper than 2.
        cost.observe(3, 0.5);
        assert!(close(cost.relative(3), cost.relative(2)));
        let seeded = CostModel::with_curve(&[2.0, 2.5]);
        assert!(close(seeded.relative(2), 1.25));
        assert!(close(seeded.relative(4), 1.25 + 2.0 * PRIOR_TOKEN_COST));
    }

    #[test]
    fn choose_drafts_nothing_at_acceptance_zero() {
        for cost in [linear(0.0), linear(0.01), CostModel::new()] {
            assert_eq!(choose(0.0, 8, 8, 0, 0.0, &cost), 0);
            assert_eq!(choose(f64::NAN, 8, 8, 0, 0.0, &cost), 0);
        }
    }

    #[test]
    fn choose_drafts_all_it_may_when_acceptance_is_high_and_tokens_are_free() {
        let flat = linear(0.0);
        assert_eq!(choose(0.99, 20, 8, 0, 0.0, &flat), 8);
        assert_eq!(choose(0.99, 3, 8, 0, 0.0, &flat), 3);
        assert_eq!(choose(0.99, 20, 8, 12, 6.0, &flat), 8);
        assert_eq!(choose(1.0, 0, 8, 0, 0.0, &flat), 0);
    }

    #[test]
    fn a_steep_cost_curve_keeps_drafts_short() {
        assert_eq!(choose(0.7, 8, 8, 0, 0.0, &linear(0.5)), 1);
        assert_eq!(choose(0.7, 8, 8, 0, 0.0, &linear(1.0)), 0);
        assert!(choose(0.7, 8, 8, 0, 0.0, &linear(0.02)) >= 4);
        // Within the noise margin of no draft: none.
        assert_eq!(choose(0.015, 8, 8, 0, 0.0, &linear(0.0)), 0);
    }

    #[test]
    fn choose_is_monotone_in_acceptance() {
        for slope in [0.0, 0.02, 0.08, 0.15, 0.4] {
            for (step_tokens, step_yield) in [(0, 0.0), (3, 2.5), (20, 30.0)] {
                let cost = linear(slope);
                let ks: Vec<usize> = (0..=100)
                    .map(|i| choose(i as f64 / 100.0, 8, 8, step_tokens, step_yield, &cost))
                    .collect();
                assert!(
                    ks.windows(2).all(|w| w[0] <= w[1]),
                    "{slope} {step_tokens}: {ks:?}"
                );
            }
        }
    }

    #[test]
    fn acceptance_follows_what_is_recorded() {
        let mut acceptance = Acceptance::new();
        assert_eq!(acceptance.rate(), PRIOR_RATE);
        for _ in 0..50 {
            acceptance.record(4, 4);
        }
        assert!(acceptance.rate() > 0.99);
        // Each rejected draft tests one token (its first): 200 of them.
        for _ in 0..200 {
            acceptance.record(4, 0);
        }
        assert!(acceptance.rate() < 0.01, "{}", acceptance.rate());
        // Three of four accepted, the fourth rejected: four tested, three taken.
        let mut partial = Acceptance::new();
        for _ in 0..500 {
            partial.record(8, 3);
        }
        assert!((partial.rate() - 0.75).abs() < 1e-6, "{}", partial.rate());
        acceptance.record(0, 0);
        acceptance.record(2, 5);
        assert!(acceptance.rate() <= 1.0);
        // Idle steps drift it back toward the prior, slowly.
        let before = acceptance.rate();
        acceptance.idle();
        assert!(acceptance.rate() > before && acceptance.rate() < before + 0.001);
        for _ in 0..20_000 {
            acceptance.idle();
        }
        assert!((acceptance.rate() - PRIOR_RATE).abs() < 1e-3);
    }
}
