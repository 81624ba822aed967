//! The release projection: what a verify pass of n tokens reads on K3's own config (the byte
//! plan `cargo xtask k3-plan` prints), its time at a stated read bandwidth, and the speedup
//! of speculative decoding at a given acceptance rate when n is chosen to maximise the
//! expected tokens per second. A bandwidth model: a pass costs the bytes it reads, nothing
//! else; the routed experts' union is the uniform-routing expectation.

use k3_model::config::K3Config;
use k3_model::inventory::BytePlan;

/// K3's bytes as a verify pass reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Release {
    /// Every weight a one-token step reads but the routed experts (one embedding row).
    pub(crate) trunk_bytes: f64,
    /// One routed expert's bytes.
    pub(crate) expert_bytes: f64,
    /// Layers with routed experts.
    pub(crate) moe_layers: usize,
    /// Routed experts per MoE layer, and the number each token picks.
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
}

/// The best pass size at one acceptance rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Best {
    /// Tokens in the pass: the last sampled one and `tokens - 1` drafts.
    pub(crate) tokens: usize,
    /// Expected tokens the pass emits, 1 + p + ... + p^(tokens - 1).
    pub(crate) expected: f64,
    /// Expected tokens per second against one per one-token step.
    pub(crate) speedup: f64,
}

impl Release {
    /// The byte plan of `config` (the release's dtypes: BF16 trunk, MXFP4 experts).
    pub(crate) fn new(config: &K3Config) -> Self {
        let plan = BytePlan::new(config);
        Self {
            trunk_bytes: (plan.bytes_per_token - plan.routed_bytes_per_token) as f64,
            expert_bytes: plan.expert_bytes as f64,
            moe_layers: plan.moe_layers,
            experts: config.moe.num_experts,
            top_k: config.moe.router.top_k,
        }
    }

    /// Expected distinct experts per MoE layer that `tokens` tokens pick, each choosing
    /// `top_k` of `experts` uniformly and independently: E·(1 − (1 − k/E)^n).
    pub(crate) fn distinct_experts(&self, tokens: usize) -> f64 {
        let experts = self.experts as f64;
        experts * (1.0 - (1.0 - self.top_k as f64 / experts).powi(tokens as i32))
    }

    /// Bytes a pass of `tokens` tokens reads: the trunk once, and the expected distinct
    /// experts of every MoE layer.
    pub(crate) fn pass_bytes(&self, tokens: usize) -> f64 {
        self.trunk_bytes
            + self.distinct_experts(tokens) * self.expert_bytes * self.moe_layers as f64
    }

    /// The pass size of 1 to `max_tokens` tokens that maximises expected tokens per byte read
    /// at acceptance rate `p` (the first of equals).
    pub(crate) fn best(&self, p: f64, max_tokens: usize) -> Best {
        let one = self.pass_bytes(1);
        (1..=max_tokens)
            .map(|tokens| {
                let expected = expected_tokens(p, tokens);
                Best {
                    tokens,
                    expected,
                    speedup: expected / (self.pass_bytes(tokens) / one),
                }
            })
            .fold(None::<Best>, |best, b| match best {
                Some(best) if best.speedup >= b.speedup => Some(best),
                _ => Some(b),
            })
            .expect("at least one pass size")
    }
}

/// Expected tokens a pass of `tokens` tokens emits (its drafts accepted in order, each with
/// probability `p`, and the sampler's token after them): 1 + p + ... + p^(tokens - 1).
pub(crate) fn expected_tokens(p: f64, tokens: usize) -> f64 {
    (0..tokens).map(|i| p.powi(i as i32)).sum()
}

/// Prints the projection for `release` at `bandwidth` bytes per second: each pass size's
/// distinct experts, bytes and time, then the best size and the speedup at each of `rates`.
pub(crate) fn print(release: &Release, bandwidth: f64, max_tokens: usize, rates: &[f64]) {
    println!(
        "trunk {:.2} GB per pass (read once), one routed expert {:.2} MB, {} MoE layers, top-{} of {} experts; bandwidth {:.0} GB/s",
        release.trunk_bytes / 1e9,
        release.expert_bytes / 1e6,
        release.moe_layers,
        release.top_k,
        release.experts,
        bandwidth / 1e9,
    );
    println!(
        "| n tokens | distinct experts per layer (uniform) | routed GB | pass GB | ms at {:.0} GB/s | × 1-token step |",
        bandwidth / 1e9
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let one = release.pass_bytes(1);
    for tokens in 1..=max_tokens {
        let bytes = release.pass_bytes(tokens);
        println!(
            "| {tokens} | {:.1} | {:.2} | {:.2} | {:.1} | {:.3} |",
            release.distinct_experts(tokens),
            (bytes - release.trunk_bytes) / 1e9,
            bytes / 1e9,
            bytes / bandwidth * 1e3,
            bytes / one,
        );
    }
    for &p in rates {
        let best = release.best(p, max_tokens);
        println!(
            "p = {p}: best pass {} tokens ({} drafts), E = {:.3} tokens per pass, {:.2} tokens/s against {:.2} plain: {:.2}× (n up to {max_tokens})",
            best.tokens,
            best.tokens - 1,
            best.expected,
            best.expected / (release.pass_bytes(best.tokens) / bandwidth),
            bandwidth / one,
            best.speedup,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    fn release() -> Release {
        let config = K3Config::from_json(k3_model::synth::RELEASE_CONFIG).unwrap();
        Release::new(&config)
    }

    #[test]
    fn one_token_reads_what_the_byte_plan_says_a_token_reads() {
        let config = K3Config::from_json(k3_model::synth::RELEASE_CONFIG).unwrap();
        let plan = BytePlan::new(&config);
        let release = release();
        assert_eq!((release.experts, release.top_k), (896, 16));
        assert!(close(release.distinct_experts(1), 16.0));
        assert!(close(release.pass_bytes(1), plan.bytes_per_token as f64));
        assert!(close(
            release.pass_bytes(1) - release.trunk_bytes,
            plan.routed_bytes_per_token as f64
        ));
    }

    #[test]
    fn the_union_of_experts_is_the_uniform_expectation() {
        let release = release();
        // Two tokens: 16 + 16 - the expected overlap 16·16/896.
        assert!(close(release.distinct_experts(2), 32.0 - 256.0 / 896.0));
        assert!(close(
            release.distinct_experts(5),
            896.0 * (1.0 - (880.0f64 / 896.0).powi(5))
        ));
        // Never more than every expert; nearly all of them for many tokens.
        assert!(release.distinct_experts(200) < 896.0);
        assert!(release.distinct_experts(10_000) <= 896.0);
        assert!(release.distinct_experts(10_000) > 895.9);
        // Each more token adds fewer new experts.
        let gains: Vec<f64> = (1..16)
            .map(|n| release.distinct_experts(n + 1) - release.distinct_experts(n))
            .collect();
        assert!(gains.windows(2).all(|g| g[1] < g[0]));
    }

    #[test]
    fn expected_tokens_are_the_geometric_sum() {
        assert!(close(expected_tokens(0.5, 1), 1.0));
        assert!(close(expected_tokens(0.5, 3), 1.75));
        assert!(close(expected_tokens(0.0, 8), 1.0));
        assert!(close(expected_tokens(1.0, 8), 8.0));
        assert!(close(expected_tokens(0.7, 4), 1.0 + 0.7 + 0.49 + 0.343));
    }

    #[test]
    fn the_best_pass_weighs_tokens_against_bytes() {
        let release = release();
        // At p = 0 a draft is never worth its bytes.
        assert_eq!(
            release.best(0.0, 16),
            Best {
                tokens: 1,
                expected: 1.0,
                speedup: 1.0
            }
        );
        // With free routed experts a pass costs the same at any size: the largest wins.
        let free = Release {
            expert_bytes: 0.0,
            ..release
        };
        let best = free.best(0.9, 16);
        assert_eq!(best.tokens, 16);
        assert!(close(best.speedup, expected_tokens(0.9, 16)));
        // The real bytes: a gain, less than the token count, and larger at higher acceptance.
        let (half, most) = (release.best(0.5, 16), release.best(0.7, 16));
        assert!(half.speedup > 1.0 && half.speedup < half.expected);
        assert!(most.speedup > half.speedup && most.tokens >= half.tokens);
        // Checked by hand: speedup is E(n) over bytes(n)/bytes(1) at the chosen n.
        assert!(close(
            most.speedup,
            expected_tokens(0.7, most.tokens)
                / (release.pass_bytes(most.tokens) / release.pass_bytes(1))
        ));
    }
}
