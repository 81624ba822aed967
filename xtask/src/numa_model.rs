//! `cargo xtask numa-model [--config FILE] [--socket-gbps G] [--link-gbps G] [--efficiency E]
//! [--tokens N]`: the written model of multi-socket decode. From the config's byte plan it
//! gives the bytes per token per domain and across the socket link for three placements —
//! interleaved pages, row-split trunk with experts on a home domain, row-split trunk with every
//! expert split too — simulates the busiest domain's share of the routed experts with a flat
//! router (each token, each MoE layer: top-k distinct experts uniformly at random), and
//! predicts s/token on 2 and 4 domains.

use anyhow::{Context, Result};
use k3_model::config::{FfnKind, K3Config};
use k3_model::inventory::{BytePlan, DType, TensorClass, text_tensors};

use crate::{Options, from_root};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(
        args,
        &["config", "socket-gbps", "link-gbps", "efficiency", "tokens"],
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
    Ok(())
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
    let mut rng = 0x4B33_u64;
    let mut next = || {
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut total = 0.0;
    let mut picks: Vec<usize> = (0..experts).collect();
    for _ in 0..tokens * layers {
        // A partial Fisher-Yates shuffle: the first top_k are a uniform sample.
        for i in 0..top_k {
            let j = i + (next() % (experts - i) as u64) as usize;
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
