//! Exact speculative decoding, measured: one engine (built by `k3_model::builder`, as the
//! server's and the decode bench's are) and, in one run,
//!
//! 1. the cost curve: the median time of a verify pass of n = 1..16 tokens (one group, logits
//!    after every token, from the same position each time, the sizes alternated in rounds)
//!    relative to the one-token step, beside the trunk and routed-expert bytes each pass
//!    reads, and where the time goes by profile bucket;
//! 2. the oracle drafter: plain greedy against speculative greedy decoding whose drafts are
//!    the true continuation with probability p each, k chosen by the policy
//!    (`k3_model::speculate::choose` with the sequence's acceptance and a cost model seeded
//!    from the curve), each off/on pair run pass by pass; every run's tokens checked against
//!    the plain ones;
//! 3. the n-gram drafter on a code-editing prompt, off against on;
//! 4. the release projection: K3's byte plan, the bytes of a verify pass of n tokens (the
//!    routed experts' union under uniform routing), its time at a stated bandwidth and the
//!    speedup at p = 0.5 and 0.7.
//!
//! `cargo run --release -p k3-bench --bin spec_bench -- --model DIR [--threads 2]
//!  [--tokens 64] [--reps 5] [--pairs 2]`; `--help` lists every flag. `cargo xtask bench-spec`
//! builds and runs it.

mod args;
mod cpu;
mod curve;
mod draw;
mod generate;
mod ngram;
mod oracle;
mod projection;
mod prompts;
// The decode bench's build sink: the build's lines on stderr, the preload as a bar.
#[path = "../sink.rs"]
mod sink;
mod stats;

use std::sync::Arc;

use anyhow::{Context, Result};
use k3_model::builder::{Engine, EngineOptions};
use k3_model::config::K3Config;
use k3_model::inventory::BytePlan;
use k3_model::profile::Profile;
use k3_model::tokenizer::Tokenizer;

use crate::args::{Args, BINARY, parse, spec_flags};
use crate::curve::PassBytes;
use crate::generate::{Mode, decode};
use crate::projection::Release;
use crate::sink::Stderr;

fn main() -> Result<()> {
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .format_timestamp(None)
        .init();
    let table = spec_flags();
    let args: Args = match parse(&table, std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => return Ok(()),
        Err(e) => {
            // A usage error: one line, exit 2 (as the decode bench).
            eprintln!("{BINARY}: {e}");
            std::process::exit(2);
        }
    };
    println!("cpu: {}", cpu::describe());
    println!("load at start: {}", load_average());
    let tokenizer = Tokenizer::from_dir(&args.model).context("loading the tokenizer")?;
    let question = prompts::question(&tokenizer)?;
    let code = prompts::code_edit(&tokenizer)?;
    let config_text = k3_model::config::read_config_text(&args.model)?;
    let config = K3Config::from_json(&config_text)?;
    // The longest sequence: the code prompt, its output, a pass's drafts past it.
    let options = EngineOptions {
        ctx: question.len().max(code.len()) + args.tokens.max(args.max_pass) + args.max_draft + 1,
        ..args.engine.clone()
    };
    let mut stderr = k3_cli::FlagHints(Stderr::default());
    let engine = Engine::build(&args.model, config, &options, &mut stderr)
        .map_err(|e| anyhow::anyhow!(k3_cli::with_flags(&e)))?;
    let profile = Arc::new(Profile::new());
    let model = engine.model()?.with_profile(Arc::clone(&profile));
    let config = engine.config();
    let mut plan = BytePlan::new(config);
    // A lossy `--trunk-format` reads its requantised matrices at their format's bytes.
    let (stored, held) = engine.requantised_bytes();
    plan.bytes_per_token = plan.bytes_per_token - stored as usize + held as usize;
    let bytes = PassBytes {
        trunk: (plan.bytes_per_token - plan.routed_bytes_per_token) as u64,
        expert: plan.expert_bytes as u64,
    };
    println!(
        "model {} ({} layers, {} MoE, top-{} of {} experts), {} threads, kernel tier {:?}; a one-token step reads {:.3} GB (as stored; a packed trunk holds fewer): trunk {:.3} GB, routed experts {:.3} GB",
        args.model.display(),
        config.num_layers(),
        plan.moe_layers,
        config.moe.router.top_k,
        config.moe.num_experts,
        engine.pool().threads(),
        engine.kernels().tier(),
        plan.bytes_per_token as f64 / 1e9,
        bytes.trunk as f64 / 1e9,
        plan.routed_bytes_per_token as f64 / 1e9,
    );

    // The plain greedy decode: the oracle's truth, the curve's tokens, and a warm-up.
    let reference = decode(&model, &question, args.tokens.max(args.max_pass), Mode::Off)?;
    let truth = &reference.tokens[..args.tokens];
    println!(
        "prompt {} tokens; plain greedy decode of {} tokens: {:.3} tokens/s (warm-up)",
        question.len(),
        reference.tokens.len(),
        reference.tokens_per_second()
    );

    println!(
        "\n## 1. cost curve: verify passes of 1..{} tokens after the {}-token prompt, {} rounds (sizes ascending, then descending), median",
        args.max_pass,
        question.len(),
        args.reps
    );
    let mut session = model.session();
    let prompt_ids: Vec<usize> = question.iter().map(|&t| t as usize).collect();
    model.prefill(&mut session, &prompt_ids, prompt_ids.len())?;
    let feed: Vec<usize> = reference.tokens[..args.max_pass]
        .iter()
        .map(|&t| t as usize)
        .collect();
    let costs = curve::measure(&model, &mut session, &feed, args.reps, &profile)?;
    drop(session);
    curve::print(&costs, bytes, args.reps);
    let seconds: Vec<f64> = costs.iter().map(|c| c.median()).collect();
    if let Some(five) = costs.get(4) {
        let relative = five.median() / costs[0].median();
        let verdict = if relative <= 1.5 {
            "met".to_owned()
        } else {
            format!(
                "MISSED by {:.3}× ({:.0}% over)",
                relative - 1.5,
                100.0 * (relative - 1.5) / 1.5
            )
        };
        println!(
            "target: a verify pass of 5 tokens ≤ 1.5× a 1-token step: {relative:.3}×, {verdict}"
        );
    }

    println!(
        "\n## 2. oracle drafter: {} tokens after the prompt, drafts right with probability p each, k by the policy (max {} drafts; cost model seeded from the curve), each off/on pair run pass by pass, {} pair(s) per p",
        args.tokens, args.max_draft, args.pairs
    );
    let setup = oracle::Setup {
        prompt: &question,
        truth,
        curve: &seconds,
        max_draft: args.max_draft,
        pairs: args.pairs,
        seed: args.seed,
        vocab: u32::try_from(config.vocab_size).context("vocabulary past u32")?,
    };
    let results = oracle::run(&model, &setup, &args.rates)?;
    oracle::print(&results, &seconds, args.max_draft);

    println!(
        "\n## 3. n-gram drafter on a code-editing prompt ({} tokens), {} tokens generated",
        code.len(),
        args.tokens
    );
    ngram::run(
        &model,
        &code,
        args.tokens,
        &seconds,
        args.max_draft,
        args.pairs,
    )?;

    println!(
        "\n## 4. release projection (crates/k3-model/configs/Kimi-K3.config.json's byte plan)"
    );
    let release_config = K3Config::from_json(k3_model::synth::RELEASE_CONFIG)?;
    let release = Release::new(&release_config);
    println!(
        "a bandwidth model: a pass costs the bytes it reads at {:.0} GB/s (the default 400 is one \
         socket of 12 DDR5-5200 channels, 499 GB/s peak, at ~80%; --bandwidth-gbps), compute and \
         attention left out; the routed experts' union assumes uniform routing, each token's top-{} drawn \
         independently",
        args.bandwidth / 1e9,
        release.top_k
    );
    projection::print(&release, args.bandwidth, args.max_pass, &[0.5, 0.7]);
    println!("\nload at end: {}", load_average());
    Ok(())
}

/// `/proc/loadavg`'s three load averages (`unknown` where it cannot be read).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".into())
}
