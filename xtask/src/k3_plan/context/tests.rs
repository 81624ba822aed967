//! The `--ctx` figures for the release config against counts made by hand from its fields, and
//! its state against the engine's own counts (the memory plan's and the snapshots'), and
//! docs/MEMORY.md's quote of the table against what it prints.

use k3_model::config::{AttentionKind, FfnKind, K3Config};
use k3_model::inventory::BytePlan;
use k3_model::model::state_bytes;
use k3_model::plan::{MemoryUse, RunShape};

use super::{
    ContextCost, DEFAULT_GFLOPS, Rates, TokenWeights, gb, gflop, gflop_fine, issue_check, table,
};

const RELEASE: &str = include_str!("../../../../crates/k3-model/configs/Kimi-K3.config.json");

/// The contexts docs/MEMORY.md quotes.
const CONTEXTS: [usize; 3] = [32_768, 131_072, 1_048_576];

fn release() -> (K3Config, BytePlan, TokenWeights) {
    let config = K3Config::from_json(RELEASE).unwrap();
    let plan = BytePlan::new(&config);
    let weights = TokenWeights::new(&config, &plan);
    (config, plan, weights)
}

fn layers_of(config: &K3Config, kind: AttentionKind) -> u64 {
    config.layers.iter().filter(|l| l.attention == kind).count() as u64
}

/// The cache and the KDA state by hand from the config's fields, against docs/MODEL.md's
/// figures (§7.5: 55,296 bytes per token; §6.7: 6,291,456 + 442,368 bytes per KDA layer), the
/// memory plan's count at `--ctx N`, and the bytes a snapshot of a session at N tokens holds.
#[test]
fn the_state_is_the_engines_count_of_the_configs_fields() {
    let (config, _, weights) = release();
    let (m, k) = (&config.mla, &config.kda);
    let (mla_layers, kda_layers) = (
        layers_of(&config, AttentionKind::Mla),
        layers_of(&config, AttentionKind::Kda),
    );
    let cache_per_token = mla_layers * (m.kv_lora_rank + m.qk_rope_head_dim) as u64 * 4;
    assert_eq!(cache_per_token, 55_296);
    let kda_state = kda_layers
        * (k.num_heads * k.head_dim * k.head_dim
            + 3 * k.num_heads * k.head_dim * (k.conv_kernel - 1)) as u64
        * 4;
    assert_eq!(kda_state, 69 * (6_291_456 + 442_368));
    for ctx in CONTEXTS {
        let cost = ContextCost::new(&config, weights, ctx);
        assert_eq!(cost.mla_cache, ctx as u64 * cache_per_token, "ctx {ctx}");
        assert_eq!(cost.kda_state, kda_state, "ctx {ctx}");
        let run = RunShape {
            resident_trunk: false,
            max_batch: 1,
            ctx,
        };
        let counted = MemoryUse::state(&config, run);
        assert_eq!(
            (cost.mla_cache, cost.kda_state),
            (counted.kv_cache, counted.kda_state)
        );
        assert_eq!(cost.state_total(), state_bytes(&config, ctx) as u64);
    }
}

/// The weights' multiply-adds per decoded token, matrix by matrix from the config's fields
/// (docs/MODEL.md §3.3), with `top_k` routed experts per MoE layer.
fn weight_macs_by_hand(config: &K3Config) -> u64 {
    let d = config.hidden_size;
    let (m, k) = (&config.mla, &config.kda);
    let width = k.num_heads * k.head_dim;
    // q, k, v, the output gate, o; the decay gate's two low-rank factors; β.
    let kda = 4 * width * d + d * width + k.head_dim * d + width * k.head_dim + k.num_heads * d;
    assert!(m.output_gate, "the release's MLA has an output gate");
    let v_width = m.num_heads * m.v_head_dim;
    // q_a, q_b, kv_a, kv_b, the output gate, o.
    let mla = m.q_lora_rank * d
        + m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * m.q_lora_rank
        + (m.kv_lora_rank + m.qk_rope_head_dim) * d
        + m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        + v_width * d
        + d * v_width;
    let dense = 3 * d * config.dense_intermediate;
    let moe = &config.moe;
    let latent = moe.latent.expect("the release's MoE is latent").hidden;
    // Router, latent down and up, the fused shared experts, top_k routed experts.
    let moe_layer = moe.num_experts * d
        + 2 * latent * d
        + 3 * moe.num_shared_experts * moe.expert_intermediate * d
        + moe.router.top_k * 3 * moe.expert_intermediate * latent;
    let layers: usize = config
        .layers
        .iter()
        .map(|l| {
            let attention = match l.attention {
                AttentionKind::Kda => kda,
                AttentionKind::Mla => mla,
            };
            let ffn = match l.ffn {
                FfnKind::Dense => dense,
                FfnKind::Moe => moe_layer,
            };
            attention + ffn
        })
        .sum();
    (config.vocab_size * d + layers) as u64
}

/// Each arithmetic figure by hand from the config's fields.
#[test]
fn the_costs_per_token_are_the_configs_fields_multiplied_out() {
    let (config, plan, weights) = release();
    let (m, k) = (&config.mla, &config.kda);
    let (mla_layers, kda_layers) = (
        layers_of(&config, AttentionKind::Mla),
        layers_of(&config, AttentionKind::Kda),
    );
    let heads = m.num_heads as u64;
    let (rank, rope) = (m.kv_lora_rank as u64, m.qk_rope_head_dim as u64);
    let weights_by_hand = weight_macs_by_hand(&config);
    // docs/MODEL.md §12's 104.19B active parameters count the vectors too (a few tens of M).
    let spec_active = 104.19e9;
    assert!(
        (weights_by_hand as f64 - spec_active).abs() < 0.001 * spec_active,
        "{weights_by_hand}"
    );
    for ctx in CONTEXTS {
        let n = ctx as u64;
        let cost = ContextCost::new(&config, weights, ctx);
        let scores = heads * n * (rank + rope);
        let weighted_latents = heads * n * rank;
        assert_eq!(
            cost.mla_context_macs,
            mla_layers * (scores + weighted_latents)
        );
        let q_absorption = heads * m.qk_nope_head_dim as u64 * rank;
        let value_rows = heads * m.v_head_dim as u64 * rank;
        assert_eq!(
            cost.mla_absorb_macs,
            mla_layers * (q_absorption + value_rows)
        );
        // Decay (a multiply), read, write and output (a multiply-add each) per state element.
        let state_elements = (k.num_heads * k.head_dim * k.head_dim) as u64;
        assert_eq!(
            cost.kda_recurrence_flops,
            kda_layers * state_elements * (1 + 2 + 2 + 2)
        );
        assert_eq!(cost.weights.macs, weights_by_hand);
        assert_eq!(cost.weights.bytes, plan.bytes_per_token as u64);
        let prefill_per_layer =
            heads as u128 * (2 * rank + rope) as u128 * (n as u128 * (n as u128 + 1) / 2);
        assert_eq!(cost.prefill_macs, mla_layers as u128 * prefill_per_layer);
    }
}

/// The printed table's state rows: the hand counts, per sequence and for `--max-batch`.
#[test]
fn the_table_prints_the_hand_counted_state() {
    let (config, _, weights) = release();
    let m = &config.mla;
    let mla_layers = layers_of(&config, AttentionKind::Mla);
    let costs: Vec<_> = CONTEXTS
        .iter()
        .map(|&ctx| ContextCost::new(&config, weights, ctx))
        .collect();
    let rates = Rates {
        memory: 345e9,
        flops: DEFAULT_GFLOPS * 1e9,
    };
    let lines = table(&costs, 8, rates);
    let row = |label: &str| -> Vec<String> {
        let line = lines
            .iter()
            .find(|l| l.starts_with(&format!("| {label} |")))
            .unwrap_or_else(|| panic!("no row {label:?} in {lines:#?}"));
        line.split('|')
            .skip(2)
            .filter(|c| !c.is_empty())
            .map(|c| c.trim().to_owned())
            .collect()
    };
    let cache =
        |ctx: usize| ctx as u64 * mla_layers * (m.kv_lora_rank + m.qk_rope_head_dim) as u64 * 4;
    let k = &config.kda;
    let kda = layers_of(&config, AttentionKind::Kda)
        * (k.num_heads * k.head_dim * (k.head_dim + 3 * (k.conv_kernel - 1))) as u64
        * 4;
    let expect = |f: &dyn Fn(usize) -> u64| -> Vec<String> {
        CONTEXTS.iter().map(|&ctx| gb(f(ctx))).collect()
    };
    assert_eq!(
        row("MLA latent cache, f32 (as the engine holds it)"),
        expect(&cache)
    );
    assert_eq!(
        row("MLA latent cache, bf16 (a `--mla-cache bf16` would hold)"),
        expect(&|ctx| cache(ctx) / 2)
    );
    assert_eq!(
        row("state, --max-batch 8"),
        expect(&|ctx| 8 * (cache(ctx) + kda))
    );
    // docs/MODEL.md §7.5's "about 55.3 GB at 1M tokens" counts 1M as 10^6; 2^20 hold 58.0.
    assert_eq!(
        row("MLA latent cache, f32 (as the engine holds it)")[0],
        "1.812 GB"
    );
    assert_eq!(
        row("MLA latent cache, f32 (as the engine holds it)")[2],
        "57.982 GB"
    );
}

/// Issue 35's three figures, recomputed from the config: 0.21 GFLOP per 1k tokens per MLA
/// layer, ≈640 GFLOP per token at 128k over 24 layers (the issue's 128k is 128,000 tokens),
/// ~210 GFLOP of weights.
#[test]
fn the_issue_check_prints_the_configs_figures() {
    let (config, _, weights) = release();
    let m = &config.mla;
    let mla_layers = layers_of(&config, AttentionKind::Mla);
    let per_token_and_layer =
        2 * m.num_heads as u64 * (2 * m.kv_lora_rank + m.qk_rope_head_dim) as u64;
    let lines = issue_check(&config, weights).join("\n");
    let per_1k = per_token_and_layer * 1000;
    assert_eq!(gflop_fine(per_1k as f64), "0.209 GFLOP");
    let at_128k = mla_layers * per_token_and_layer * 131_072;
    let at_128_000 = mla_layers * per_token_and_layer * 128_000;
    let weights = 2 * weight_macs_by_hand(&config);
    for figure in [
        gflop_fine(per_1k as f64),
        gflop(at_128k as f64),
        gflop(at_128_000 as f64),
        gflop(weights as f64),
    ] {
        assert!(lines.contains(&figure), "{figure} not in:\n{lines}");
    }
    assert!((at_128_000 as f64 / 640e9 - 1.0).abs() < 0.01);
    assert!((weights as f64 / 210e9 - 1.0).abs() < 0.01);
}

/// docs/MEMORY.md quotes what `k3-plan --ctx 32768,131072,1048576` prints for the release at
/// the default rates, between `<!-- k3-plan-ctx -->` markers: the quote is the output now.
#[test]
fn the_memory_page_quotes_the_table_as_it_prints_now() {
    let (config, _, weights) = release();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/MEMORY.md");
    let page = std::fs::read_to_string(path).expect("docs/MEMORY.md");
    let quoted: Vec<&str> = page
        .lines()
        .skip_while(|l| *l != "<!-- k3-plan-ctx -->")
        .skip(1)
        .take_while(|l| *l != "<!-- end k3-plan-ctx -->")
        .collect();
    let costs: Vec<_> = CONTEXTS
        .iter()
        .map(|&ctx| ContextCost::new(&config, weights, ctx))
        .collect();
    let rates = Rates {
        memory: 345e9,
        flops: DEFAULT_GFLOPS * 1e9,
    };
    let mut printed = table(&costs, 1, rates);
    printed.push(String::new());
    printed.push("```text".into());
    printed.extend(issue_check(&config, weights));
    printed.push("```".into());
    assert_eq!(
        quoted, printed,
        "docs/MEMORY.md's k3-plan --ctx quote is stale: paste the table and the issue lines"
    );
}
