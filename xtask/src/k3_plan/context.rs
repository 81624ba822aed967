//! `k3-plan --ctx N,..`: what one sequence costs at a context of N tokens — its state (the MLA
//! latent cache, the KDA states) and, per token decoded at depth N, the attention's arithmetic
//! and reads beside the weights' own — and what a cold prompt of N tokens costs the attention.
//!
//! The state is the engine's memory plan ([`MemoryUse::state`]), so the figures are the ones a
//! run at `--ctx N` is refused or admitted with. The arithmetic is counted from the config's
//! dimensions in the forms the engine runs: MLA absorbed (docs/MODEL.md §7.3), KDA as
//! `ops::kda_step` (§6.5).

use k3_model::config::{AttentionKind, K3Config};
use k3_model::inventory::{BytePlan, Role, TensorClass, expert_layout, text_tensors};
use k3_model::plan::{MemoryUse, RunShape};

use super::numbers::{fixed, group};

/// One socket of a 96-core Zen 4 (EPYC 9654) at its f32 FMA peak — two 256-bit FMA pipes, 32
/// FLOP per cycle per core, at the 2.4 GHz base clock an all-core AVX-512 load holds — times
/// 0.5, about what our blocked GEMMs reach (PERFORMANCE.md: 43% of peak in the first prefill
/// pass). The socket whose memory `--memory-gbps`'s default (345) describes.
pub(super) const DEFAULT_GFLOPS: f64 = 96.0 * 32.0 * 2.4 * 0.5;

/// The rates the times are computed at.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rates {
    /// Bytes per second read from memory (`--memory-gbps`).
    pub(super) memory: f64,
    /// Floating-point operations per second (`--gflops`).
    pub(super) flops: f64,
}

/// One sequence at a context of `ctx` tokens: its state, and what one token decoded at that
/// depth costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ContextCost {
    /// Tokens in the sequence.
    pub(super) ctx: usize,
    /// MLA latent cache (latent and rope-key rows, f32 as the engine holds it) at `ctx`.
    pub(super) mla_cache: u64,
    /// KDA recurrent states and conv windows (f32): constant in `ctx`.
    pub(super) kda_state: u64,
    /// Multiply-adds of the MLA attention over the `ctx` cached positions, every MLA layer:
    /// the scores (latent and rope key) and the weighted sum of the latents.
    pub(super) mla_context_macs: u64,
    /// Multiply-adds of the MLA attention that do not grow with `ctx`, every MLA layer: the
    /// query absorbed into the latent space and the value rows out of it — `kv_b`'s rows once
    /// each, so they are already in [`Self::weights`].
    pub(super) mla_absorb_macs: u64,
    /// FLOPs of the KDA recurrence, every KDA layer: constant in `ctx`.
    pub(super) kda_recurrence_flops: u64,
    /// The weights a decoded token reads and multiplies: constant in `ctx`.
    pub(super) weights: TokenWeights,
    /// Multiply-adds of the MLA attention over a cold prompt of `ctx` tokens, every MLA layer.
    pub(super) prefill_macs: u128,
}

/// What a decoded token's weights cost whatever the context, counted once per config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TokenWeights {
    /// Multiply-adds of the weight matrices one decoded token reads (one per active parameter
    /// of a matrix).
    pub(super) macs: u64,
    /// Weight bytes one decoded token reads, as stored (the byte plan's).
    pub(super) bytes: u64,
}

impl TokenWeights {
    /// Every linear tensor of the inventory but the embedding table (a row is copied, not
    /// multiplied), and `top_k` routed experts in every MoE layer. Left out, each under 0.1%
    /// of it: the vectors (norms, the AttnRes mixes, conv taps, biases) and the activations,
    /// O(width) per layer.
    pub(super) fn new(config: &K3Config, plan: &BytePlan) -> Self {
        let trunk: u64 = text_tensors(config)
            .iter()
            .filter(|t| t.role() == Role::Linear && t.class != TensorClass::Embedding)
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        let per_expert: u64 = expert_layout(config)
            .matrices()
            .iter()
            .map(|m| (m.rows * m.cols) as u64)
            .sum();
        Self {
            macs: trunk + (plan.moe_layers * config.moe.router.top_k) as u64 * per_expert,
            bytes: plan.bytes_per_token as u64,
        }
    }
}

impl ContextCost {
    /// The costs of one sequence at `ctx` tokens under `config`.
    pub(super) fn new(config: &K3Config, weights: TokenWeights, ctx: usize) -> Self {
        let state = MemoryUse::state(config, one_sequence(ctx));
        let m = &config.mla;
        let mla_layers = config.layers_of(AttentionKind::Mla).len() as u64;
        let kda_layers = config.layers_of(AttentionKind::Kda).len() as u64;
        let k = &config.kda;
        // `ops::kda_step` passes over each head's K×V state four times: the decay (a multiply
        // per element), the read kᵀS, the delta write S += k⊗Δ and the output qᵀS (a
        // multiply-add each): 1 + 2 + 2 + 2 = 7 FLOPs per element. The spec's "about 6.3M MACs
        // per layer" is the same four passes counted as 4 K·V multiply-adds. The O(K + V) work
        // (β, Δ, the norms) and the short convolution (3 × width × kernel multiply-adds,
        // under 3% of it) are left out.
        let kda_recurrence_flops = kda_layers * (k.num_heads * 7 * k.head_dim * k.head_dim) as u64;
        let ctx128 = ctx as u128;
        Self {
            ctx,
            mla_cache: state.kv_cache,
            kda_state: state.kda_state,
            mla_context_macs: mla_layers * mla_macs_per_position(config) * ctx as u64,
            mla_absorb_macs: mla_layers
                * (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank) as u64,
            kda_recurrence_flops,
            weights,
            // Token t of the prompt (from 1) attends to t positions: Σ t = N (N + 1) / 2.
            prefill_macs: (mla_layers * mla_macs_per_position(config)) as u128
                * (ctx128 * (ctx128 + 1) / 2),
        }
    }

    /// Bytes of one sequence's state: the f32 cache and the KDA states.
    pub(super) fn state_total(&self) -> u64 {
        self.mla_cache + self.kda_state
    }

    /// FLOPs of the MLA attention over the context (a multiply-add is two).
    pub(super) fn mla_context_flops(&self) -> u64 {
        2 * self.mla_context_macs
    }

    /// FLOPs of the weight matrices a decoded token reads.
    pub(super) fn weight_flops(&self) -> u64 {
        2 * self.weights.macs
    }

    /// Bytes of the MLA cache one attention task reads per token: the engine's
    /// `attend::heads_context` passes over the cache twice (scores, then the weighted
    /// latents), each block of positions for all of the task's heads. A layer's heads are
    /// split into `min(threads, heads)` tasks, each making these passes, from memory once a
    /// layer's cache outgrows the L3 (at 32k tokens one layer's is 75 MB).
    pub(super) fn mla_cache_read_per_task(&self) -> u64 {
        2 * self.mla_cache
    }

    /// Seconds of the MLA attention over the context per token: its arithmetic or one pass
    /// over the cache, whichever is slower.
    fn mla_seconds(&self, rates: Rates) -> f64 {
        (self.mla_context_flops() as f64 / rates.flops).max(self.mla_cache as f64 / rates.memory)
    }

    /// Seconds of the weights per token: their read or their arithmetic, whichever is slower.
    fn weight_seconds(&self, rates: Rates) -> f64 {
        (self.weights.bytes as f64 / rates.memory).max(self.weight_flops() as f64 / rates.flops)
    }
}

/// The run shape of one sequence at `ctx` tokens.
fn one_sequence(ctx: usize) -> RunShape {
    RunShape {
        resident_trunk: false,
        max_batch: 1,
        ctx,
    }
}

/// Multiply-adds of one MLA layer's attention per cached position, all heads: the score reads
/// the latent and the rope key (rank + rope), the weighted sum the latent again (rank). Left
/// out: the softmax, an `exp` per head and position (under 1% of it).
fn mla_macs_per_position(config: &K3Config) -> u64 {
    let m = &config.mla;
    (m.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)) as u64
}

/// The table `k3-plan --ctx` prints: a column per context length.
pub(super) fn table(costs: &[ContextCost], max_batch: usize, rates: Rates) -> Vec<String> {
    let mut lines = Vec::new();
    let mut header = "| per sequence, at a context of |".to_owned();
    let mut rule = "|---|".to_owned();
    for cost in costs {
        header += &format!(" {} tokens |", group(cost.ctx));
        rule += "---:|";
    }
    lines.push(header);
    lines.push(rule);
    let mut row = |label: &str, cell: &dyn Fn(&ContextCost) -> String| {
        let cells: String = costs.iter().map(|c| format!(" {} |", cell(c))).collect();
        lines.push(format!("| {label} |{cells}"));
    };
    let batch = max_batch as u64;
    let (flops, memory) = (rates.flops, rates.memory);
    row("MLA latent cache, f32 (as the engine holds it)", &|c| {
        gb(c.mla_cache)
    });
    row(
        "MLA latent cache, bf16 (a `--mla-cache bf16` would hold)",
        &|c| gb(c.mla_cache / 2),
    );
    row("KDA states and conv windows, f32 (constant)", &|c| {
        gb(c.kda_state)
    });
    row("state, one sequence", &|c| gb(c.state_total()));
    row(&format!("state, --max-batch {max_batch}"), &|c| {
        gb(batch * c.state_total())
    });
    row("**per decoded token at that depth**", &|_| String::new());
    row("MLA attention over the context", &|c| {
        format!(
            "{} G multiply-adds, {}",
            fixed(c.mla_context_macs as f64 / 1e9, 1),
            gflop(c.mla_context_flops() as f64)
        )
    });
    row(
        "MLA q absorption and value rows (kv_b, in the weights)",
        &|c| gflop(2.0 * c.mla_absorb_macs as f64),
    );
    row("KDA recurrence (constant)", &|c| {
        gflop(c.kda_recurrence_flops as f64)
    });
    row("weights (2 × active matrix parameters)", &|c| {
        gflop(c.weight_flops() as f64)
    });
    row("MLA cache read, one pass per layer", &|c| gb(c.mla_cache));
    row(
        "MLA cache read per attention task (two passes; a task per thread, up to the heads)",
        &|c| gb(c.mla_cache_read_per_task()),
    );
    row("KDA state read and written", &|c| gb(2 * c.kda_state));
    row("weights read (as stored)", &|c| gb(c.weights.bytes));
    row(
        &format!(
            "MLA attention time: compute at {flops_g:.0} GFLOP/s",
            flops_g = flops / 1e9
        ),
        &|c| seconds(c.mla_context_flops() as f64 / flops),
    );
    row(
        &format!(
            "MLA attention time: one cache pass at {:.0} GB/s",
            memory / 1e9
        ),
        &|c| seconds(c.mla_cache as f64 / memory),
    );
    row(
        "MLA attention time: one task's two passes from memory",
        &|c| seconds(c.mla_cache_read_per_task() as f64 / memory),
    );
    row("KDA time: state read and written", &|c| {
        seconds(2.0 * c.kda_state as f64 / memory)
    });
    row("weight time: read", &|c| {
        seconds(c.weights.bytes as f64 / memory)
    });
    row("weight time: compute", &|c| {
        seconds(c.weight_flops() as f64 / flops)
    });
    row(
        "MLA attention ÷ weights (the slower of compute and read, each)",
        &|c| format!("{:.2}x", c.mla_seconds(rates) / c.weight_seconds(rates)),
    );
    row("**a cold prompt of that many tokens**", &|_| String::new());
    row("MLA attention over the prompt (quadratic)", &|c| {
        tflop(2.0 * c.prefill_macs as f64)
    });
    row(&format!("its time at {:.0} GFLOP/s", flops / 1e9), &|c| {
        seconds(2.0 * c.prefill_macs as f64 / flops)
    });
    lines
}

/// Issue 35's figures beside the config's: the MLA attention per 1k tokens of context per
/// layer, at 128k over every MLA layer, and the weights' own arithmetic per token.
pub(super) fn issue_check(config: &K3Config, weights: TokenWeights) -> Vec<String> {
    let mla_layers = config.layers_of(AttentionKind::Mla).len();
    let flops_at = |ctx: u64| (2 * mla_layers as u64 * mla_macs_per_position(config) * ctx) as f64;
    let per_1k_per_layer = flops_at(1000) / mla_layers as f64;
    // The issue's ≈640 counts 128k as 128,000 tokens; at 131,072 the same count is 657.
    let (at_128k, at_128_000) = (flops_at(131_072), flops_at(128_000));
    let weight_flops = 2.0 * weights.macs as f64;
    vec![
        format!(
            "issue 35's figures, from the config: MLA attention {} per 1k tokens of context per \
             MLA layer (issue: ≈0.21)",
            gflop_fine(per_1k_per_layer)
        ),
        format!(
            "  at 131,072 tokens over the {mla_layers} MLA layers {} per decoded token (issue: \
             ≈640, which is 128,000 tokens: {})",
            gflop(at_128k),
            gflop(at_128_000)
        ),
        format!(
            "  the weights {} per decoded token (issue: ~210), so the attention at 131,072 \
             tokens is {:.2}x the weights' arithmetic (issue: three times)",
            gflop(weight_flops),
            at_128k / weight_flops
        ),
    ]
}

/// Bytes in GB, three decimals.
fn gb(bytes: u64) -> String {
    format!("{} GB", fixed(bytes as f64 / 1e9, 3))
}

/// FLOPs in GFLOP, one decimal.
fn gflop(flops: f64) -> String {
    format!("{} GFLOP", fixed(flops / 1e9, 1))
}

/// FLOPs in GFLOP, three decimals (for the per-1k figure).
fn gflop_fine(flops: f64) -> String {
    format!("{} GFLOP", fixed(flops / 1e9, 3))
}

/// FLOPs in TFLOP, whole.
fn tflop(flops: f64) -> String {
    format!("{} TFLOP", fixed(flops / 1e12, 0))
}

/// Seconds: three decimals below 100 s, whole seconds and minutes, hours or days above.
fn seconds(s: f64) -> String {
    match s {
        s if s < 100.0 => format!("{s:.3} s"),
        s if s < 3600.0 => format!("{} s ({:.0} min)", fixed(s, 0), s / 60.0),
        s if s < 86_400.0 => format!("{} s ({:.1} h)", fixed(s, 0), s / 3600.0),
        s => format!("{} s ({:.1} days)", fixed(s, 0), s / 86_400.0),
    }
}

#[cfg(test)]
mod tests;
