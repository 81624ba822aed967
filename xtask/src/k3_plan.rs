//! `cargo xtask k3-plan --config FILE`: the byte plan of a K3 checkpoint for any config —
//! bytes per tensor class and per layer kind, the total, and the weight bytes one decoded token
//! reads, and the same for each `--trunk-format` (the requantised matrices at their format's
//! bytes). For the release config the total plus the vision tower equals the index's
//! `total_size` (1,560,860,324,864 bytes), which pins the tensor inventory. With
//! `--machine-gb` the memory plan is projected too, for `--trunk-format F` (default bf16).
//! With `--ctx N,..` it prints what one sequence costs at each context length (`context`).

use anyhow::{Context, Result};
use k3_model::config::K3Config;
use k3_model::inventory::BytePlan;
use k3_model::plan::{TrunkFormat, WeightSizes};

use crate::{Options, from_root};

mod context;
mod numbers;

use numbers::group;

/// The release's vision tower and projector (docs/MODEL.md §3.5): not text, not in the inventory.
const VISION_BYTES: usize = 894_717_952;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let options = Options::parse(
        args,
        &[
            "config",
            "machine-gb",
            "drives",
            "drive-gbps",
            "memory-gbps",
            "ctx",
            "max-batch",
            "trunk-format",
            "gflops",
        ],
    )?;
    let path = from_root(options.get("config").context("--config FILE is required")?);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config =
        K3Config::from_json(&text).with_context(|| format!("parsing {}", path.display()))?;
    let plan = BytePlan::new(&config);

    println!(
        "config: {} ({} layers, hidden {})\n",
        path.display(),
        config.num_layers(),
        config.hidden_size
    );
    println!("| tensor class | bytes |");
    println!("|---|---:|");
    for (class, bytes) in &plan.by_class {
        println!("| {} | {} |", class.name(), group(*bytes));
    }
    println!(
        "\n| layer kind (attention, ffn) | layers | bytes per layer, without routed experts |"
    );
    println!("|---|---:|---:|");
    for ((attention, ffn), bytes, count) in &plan.by_layer_kind {
        println!("| {attention:?}, {ffn:?} | {count} | {} |", group(*bytes));
    }
    println!();
    println!(
        "routed expert:            {} bytes",
        group(plan.expert_bytes)
    );
    println!("text tensors:             {}", group(plan.text_tensors));
    println!("text bytes:               {}", group(plan.text_bytes));
    println!(
        "with the release's vision tower ({}): {}",
        group(VISION_BYTES),
        group(plan.text_bytes + VISION_BYTES)
    );
    println!(
        "weight bytes per decoded token: {} ({:.2} GB)",
        group(plan.bytes_per_token),
        plan.bytes_per_token as f64 / 1e9
    );
    let number = |name: &str, default: f64| -> Result<f64> {
        match options.get(name) {
            None => Ok(default),
            Some(v) => {
                let x: f64 = v
                    .parse()
                    .with_context(|| format!("--{name} {v:?} is not a number"))?;
                anyhow::ensure!(x > 0.0 && x.is_finite(), "--{name} {v:?} must be above 0");
                Ok(x)
            }
        }
    };
    // One socket of 12 DDR5-4800 channels, at the ~75% of peak a streaming read gets.
    let memory_gbps = number("memory-gbps", 345.0)?;
    print_formats(&config, &plan, memory_gbps);
    let max_batch = number("max-batch", 1.0)? as usize;
    let contexts = match options.get("ctx") {
        Some(list) => context_list(list)?,
        None => Vec::new(),
    };
    if !contexts.is_empty() {
        let rates = context::Rates {
            memory: memory_gbps * 1e9,
            flops: number("gflops", context::DEFAULT_GFLOPS)? * 1e9,
        };
        let weights = context::TokenWeights::new(&config, &plan);
        let costs: Vec<_> = contexts
            .iter()
            .map(|&ctx| context::ContextCost::new(&config, weights, ctx))
            .collect();
        println!();
        for line in context::table(&costs, max_batch, rates) {
            println!("{line}");
        }
        println!();
        for line in context::issue_check(&config, weights) {
            println!("{line}");
        }
    }
    let trunk_format: TrunkFormat = options
        .get("trunk-format")
        .unwrap_or("bf16")
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--trunk-format: {e}"))?;
    if let Some(machines) = options.get("machine-gb") {
        let drives = options
            .get("drives")
            .unwrap_or("1,4")
            .split(',')
            .map(|d| {
                d.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .with_context(|| format!("--drives {d:?} is not a positive count"))
            })
            .collect::<Result<Vec<_>>>()?;
        let projection = crate::k3_project::Machines {
            memory: crate::k3_project::gb_list(machines, "machine-gb")?,
            drives,
            // One PCIe 4.0 x4 NVMe drive's sequential read.
            drive_rate: number("drive-gbps", 7.0)? * 1e9,
            memory_rate: memory_gbps * 1e9,
            trunk_format,
            run: k3_model::plan::RunShape {
                resident_trunk: false,
                max_batch,
                // The longest: a run must hold its longest sequence.
                ctx: contexts.iter().copied().max().unwrap_or(32768),
            },
        };
        crate::k3_project::run(&config, &projection)?;
    }
    Ok(())
}

/// `--ctx`'s list of context lengths (`32768,131072`), each a positive count of tokens.
fn context_list(list: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|n| {
            n.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("--ctx {n:?} is not a positive count of tokens"))
        })
        .collect()
}

/// The weights each `--trunk-format` holds and reads per token: the requantised matrices at
/// their format's bytes, everything else as stored; the time per token a memory read at
/// `memory_gbps` bounds it to.
fn print_formats(config: &K3Config, plan: &BytePlan, memory_gbps: f64) {
    println!(
        "\n| --trunk-format | requantised weights | all weights (RAM to hold them) | weight bytes \
         per token | s/token at {memory_gbps:.0} GB/s |"
    );
    println!("|---|---:|---:|---:|---:|");
    let sizes = WeightSizes::of_config(config);
    for name in TrunkFormat::NAMES {
        let format: TrunkFormat = name.parse().expect("its own names parse");
        let (stored, held) = sizes.clone().with_trunk_format(format).requantised_bytes();
        let weights = match format.quant() {
            Some(q) => format!(
                "{} ({} bits each)",
                group((stored / 2) as usize),
                q.bits_per_weight()
            ),
            None => "none".into(),
        };
        let all = (plan.text_bytes as u64 - stored + held) as f64 / 1e9;
        let per_token = (plan.bytes_per_token as u64 - stored + held) as f64 / 1e9;
        println!(
            "| {name} | {weights} | {all:.1} GB | {per_token:.1} GB | {:.3} |",
            per_token / memory_gbps
        );
    }
}
