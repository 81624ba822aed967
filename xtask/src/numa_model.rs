//! `cargo xtask numa-model [--config FILE] [--socket-gbps G] [--link-gbps G] [--efficiency E]
//! [--tokens N]`: the written model of multi-socket decode. From the config's byte plan it
//! gives the bytes per token per domain and across the socket link for three placements —
//! interleaved pages, row-split trunk with experts on a home domain, row-split trunk with every
//! expert split too — simulates the busiest domain's share of the routed experts with a flat
//! router (each token, each MoE layer: top-k distinct experts uniformly at random), and
//! predicts s/token on 2 and 4 domains.
//!
//! Then hosts as domains (issue 19, ranks over MPI, `[--host-gbps G] [--link-latency-us U]`):
//! for 2, 4 and 8 hosts over 100, 200 and 400 Gb/s links, each host reads 1/N of every
//! row-split matrix, and the activations move the way `numa_sched::Ranks` moves them: one
//! all-gather per dispatch of matrices (each rank receives the other ranks' rows), rank 0's
//! attention outputs broadcast, one announcement per step. Predicted s/token = the host's
//! weight bytes at its reached bandwidth + collectives x latency x ceil(log2 N) + the bytes a
//! host receives at the link's rate (no overlap of the two assumed).

use anyhow::{Context, Result};
use k3_model::config::{AttentionKind, FfnKind, K3Config};
use k3_model::inventory::{BytePlan, DType, TensorClass, text_tensors};
use k3_testkit::Rng;

use crate::{Options, from_root};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(
        args,
        &[
            "config",
            "socket-gbps",
            "link-gbps",
            "efficiency",
            "tokens",
            "host-gbps",
            "link-latency-us",
        ],
    )?;
    let path = from_root(
        o.get("config")
            .unwrap_or("crates/k3-model/configs/Kimi-K3.config.json"),
    );
    let config = K3Config::from_json(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    let number = |name: &str, default: f64| -> Result<f64> {
        o.get(name)
            .map(|v| v.parse().with_context(|| format!("--{name} is a number")))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    // A 2 x 12-channel DDR5-4800 server: 12 x 38.4 GB/s per socket, ~900 GB/s in all.
    let socket = number("socket-gbps", 460.8)? * 1e9;
    // xGMI between two EPYC sockets: 3-4 links, ~64 GB/s each per direction usable.
    let link = number("link-gbps", 200.0)? * 1e9;
    // Fraction of theoretical bandwidth a streaming read reaches (STREAM-like ~80%) times
    // our kernels' fraction of that read (89-95% measured here): ~0.72.
    let efficiency = number("efficiency", 0.72)?;
    let tokens = number("tokens", 2000.0)? as usize;

    let plan = BytePlan::new(&config);
    let routed_per_token = plan.bytes_per_token as f64
        - plan
            .by_class
            .iter()
            .filter(|(c, _)| *c != TensorClass::RoutedExperts)
            .map(|(c, b)| {
                if *c == TensorClass::Embedding {
                    (config.hidden_size * 2) as f64
                } else {
                    *b as f64
                }
            })
            .sum::<f64>();
    let trunk_per_token = plan.bytes_per_token as f64 - routed_per_token;
    let moe_layers = config
        .layers
        .iter()
        .filter(|l| l.ffn == FfnKind::Moe)
        .count();
    let experts = config.moe.num_experts;
    let top_k = config.moe.router.top_k;
    println!(
        "config: {} — {:.2} GB per token: trunk {:.2} GB (every weight but the routed experts), routed experts {:.2} GB ({top_k} of {experts} per layer x {moe_layers} MoE layers x {:.1} MB)\n",
        path.display(),
        plan.bytes_per_token as f64 / 1e9,
        trunk_per_token / 1e9,
        routed_per_token / 1e9,
        plan.expert_bytes as f64 / 1e6
    );
    println!(
        "machine: {:.0} GB/s per socket theoretical, x{efficiency} reached = {:.0} GB/s; socket link {:.0} GB/s per direction\n",
        socket / 1e9,
        socket * efficiency / 1e9,
        link / 1e9
    );
    println!(
        "| domains | placement | busiest domain's bytes/token | cross-domain bytes/token (per direction) | expert share of the busiest domain (mean per layer) | predicted s/token |"
    );
    println!("|---|---|---|---|---|---|");
    let expert_bytes = plan.expert_bytes as f64;
    // Row-split placements move activations, not weights: for every matrix a token reads,
    // each other domain reads the f32 input vector once and the home of the next step reads
    // the other domains' output rows. Matrices: every 2-D BF16 trunk tensor but the
    // embedding table, and each selected expert's three.
    let (mut inputs, mut outputs) = (0usize, 0usize);
    for t in text_tensors(&config) {
        let routed = t.class == TensorClass::RoutedExperts;
        if t.class == TensorClass::Embedding || (routed && t.expert != Some(0)) {
            continue;
        }
        if let [rows, cols] = t.shape[..]
            && (t.dtype == DType::Bf16 || routed)
        {
            // Expert 0's tensors stand for the top_k selected (packed codes carry the shape
            // of half the columns; scales are skipped).
            let (rows, cols, times) = if routed {
                if !t.name.ends_with("weight_packed") {
                    continue;
                }
                (rows, cols * 2, top_k)
            } else {
                (rows, cols, 1)
            };
            inputs += cols * 4 * times;
            outputs += rows * 4 * times;
        }
    }
    let activations = |domains: usize| {
        (inputs * (domains - 1) + outputs * (domains - 1) / domains) as f64 / domains as f64
    };
    for domains in [2usize, 4] {
        let share = busiest_share(experts, top_k, domains, moe_layers, tokens);
        let reach = socket * efficiency;
        // Interleaved pages: every domain reads 1/D of everything, (D-1)/D of that from other
        // sockets. A remote byte costs about two local ones (the forward-pass issue's
        // public figure: "every byte read across the socket link halves the bandwidth"), and
        // no domain can pull remote bytes faster than the link carries them.
        let per_domain = plan.bytes_per_token as f64 / domains as f64;
        let remote = per_domain * (domains - 1) as f64 / domains as f64;
        let local = per_domain - remote;
        let interleaved = ((local + 2.0 * remote) / reach).max(remote / link);
        println!(
            "| {domains} | interleaved pages (numactl --interleave) | {:.1} GB ({:.1} of it remote) | {:.1} GB | — | {:.3} |",
            per_domain / 1e9,
            remote / 1e9,
            remote / 1e9,
            interleaved,
        );
        // Row-split trunk, experts whole on a home domain: the busiest domain reads its trunk
        // rows and, per layer, its experts; the layer ends when the busiest is done.
        let home_bytes =
            trunk_per_token / domains as f64 + share * (top_k * moe_layers) as f64 * expert_bytes;
        println!(
            "| {domains} | trunk rows split, experts on a home domain | {:.1} GB | {:.0} MB of activations | {:.3} (ideal {:.3}) | {:.3} |",
            home_bytes / 1e9,
            activations(domains) / 1e6,
            share,
            1.0 / domains as f64,
            home_bytes / reach
        );
        let split_bytes = plan.bytes_per_token as f64 / domains as f64;
        println!(
            "| {domains} | trunk rows split, every expert's rows split | {:.1} GB | {:.0} MB of activations | {:.3} | {:.3} |",
            split_bytes / 1e9,
            activations(domains) / 1e6,
            1.0 / domains as f64,
            split_bytes / reach
        );
    }
    // One 12-channel DDR5-4800 socket per host by default.
    let host = number("host-gbps", 460.8)? * 1e9;
    // RDMA (InfiniBand/RoCE) small-message latency is ~2-5 us; TCP over the same links ~20-50.
    let latency = number("link-latency-us", 5.0)? * 1e-6;
    hosts_table(&config, &plan, host * efficiency, latency);
    Ok(())
}

/// Collectives per decoded token in our MPI split, and the f32 values each covers: one
/// all-gather per dispatch of matrices (`gemm_many`), per expert phase and per lm_head; one
/// broadcast of each attention layer's output; one announcement.
fn collectives(config: &K3Config) -> (usize, Vec<(usize, bool)>) {
    let d = config.hidden_size;
    let moe = &config.moe;
    let top_k = moe.router.top_k;
    let io = moe.expert_io(d);
    // (values, broadcast?) of each collective.
    let mut calls: Vec<(usize, bool)> = vec![(0, true)];
    for layer in &config.layers {
        match layer.attention {
            AttentionKind::Kda => {
                let w = config.kda_width();
                let heads = config.kda.num_heads;
                // q, k, v, g, f_a (rank), beta; f_b; the output broadcast; o.
                calls.push((4 * w + config.kda.head_dim + heads, false));
                calls.push((w, false));
                calls.push((w, true));
                calls.push((d, false));
            }
            AttentionKind::Mla => {
                let m = &config.mla;
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                let gate = if m.output_gate {
                    m.num_heads * m.v_head_dim
                } else {
                    0
                };
                calls.push((
                    m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + gate,
                    false,
                ));
                calls.push((m.num_heads * qk, false));
                calls.push((m.num_heads * m.v_head_dim, true));
                calls.push((d, false));
            }
        }
        match layer.ffn {
            FfnKind::Dense => {
                calls.push((2 * config.dense_intermediate, false));
                calls.push((d, false));
            }
            FfnKind::Moe => {
                calls.push((moe.num_experts + io, false));
                if moe.num_shared_experts > 0 {
                    calls.push((2 * moe.shared_intermediate(), false));
                    calls.push((d, false));
                }
                calls.push((top_k * moe.expert_intermediate, false));
                calls.push((top_k * io, false));
                if moe.latent.is_some() {
                    calls.push((d, false));
                }
            }
        }
    }
    calls.push((config.vocab_size, false));
    (calls.len(), calls)
}

/// The multi-host table: predicted s/token for 2, 4, 8 hosts over 100/200/400 Gb/s links.
fn hosts_table(config: &K3Config, plan: &BytePlan, reach: f64, latency: f64) {
    let (count, calls) = collectives(config);
    println!(
        "\nhosts as domains (ranks over MPI): a host reaches {:.0} GB/s; {count} collectives per token; link latency {:.1} us per message\n",
        reach / 1e9,
        latency * 1e6
    );
    println!(
        "| hosts | link | weight bytes per host per token | bytes a host receives per token | time in collectives | predicted s/token | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    let one = plan.bytes_per_token as f64 / reach;
    println!(
        "| 1 | — | {:.1} GB | — | — | {one:.3} | {:.2} |",
        plan.bytes_per_token as f64 / 1e9,
        1.0 / one
    );
    for hosts in [2usize, 4, 8] {
        let n = hosts as f64;
        // An all-gather brings each host the other hosts' (n-1)/n of the values; a broadcast
        // brings all of them to every host but rank 0.
        let received: f64 = calls
            .iter()
            .map(|&(values, broadcast)| {
                let share = if broadcast { 1.0 } else { (n - 1.0) / n };
                values as f64 * 4.0 * share
            })
            .sum();
        let steps = (hosts as f64).log2().ceil();
        let weights = plan.bytes_per_token as f64 / n;
        for gbit in [100.0, 200.0, 400.0] {
            let link = gbit * 1e9 / 8.0;
            let collective = count as f64 * latency * steps + received / link;
            let total = weights / reach + collective;
            println!(
                "| {hosts} | {gbit:.0} Gb/s | {:.1} GB | {:.2} MB | {:.1} ms | {total:.3} | {:.2} |",
                weights / 1e9,
                received / 1e6,
                collective * 1e3,
                1.0 / total
            );
        }
    }
}

/// Mean over tokens and MoE layers of the busiest domain's fraction of the `top_k` experts a
/// token picks, with experts homed round-robin (`e % domains`) and a flat router (top-k
/// distinct experts uniformly at random). A layer waits for its busiest domain, so the mean
/// of the per-layer maximum is what costs time.
fn busiest_share(
    experts: usize,
    top_k: usize,
    domains: usize,
    layers: usize,
    tokens: usize,
) -> f64 {
    let mut rng = Rng::new(0x4B33);
    let mut total = 0.0;
    let mut picks: Vec<usize> = (0..experts).collect();
    for _ in 0..tokens * layers {
        // A partial Fisher-Yates shuffle: the first top_k are a uniform sample.
        for i in 0..top_k {
            let j = i + rng.below(experts - i);
            picks.swap(i, j);
        }
        let mut per_domain = vec![0usize; domains];
        for &e in &picks[..top_k] {
            per_domain[e % domains] += 1;
        }
        total += *per_domain.iter().max().expect("domains") as f64 / top_k as f64;
    }
    total / (tokens * layers) as f64
}
