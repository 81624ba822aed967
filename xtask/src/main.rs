//! `cargo xtask`: the project's development tasks, written in Rust so they need only cargo.
//!
//! `main` is a dispatcher: each task is one entry of [`TASKS`] with its own module. To add a
//! task, write `fn run(args: &[String]) -> Result<()>` in a new module and list it there.

mod bench_kernels;
mod bench_memory;
mod bench_peers;
mod bench_serve;
mod bench_spec;
mod cgroup;
mod gguf;
mod gguf_compare;
mod gguf_k3;
mod gguf_k3_meta;
mod k3_check;
mod k3_plan;
mod k3_project;
mod k3_synth;
mod llamacpp_twin;
mod numa_model;
mod oracle;
mod oracle_chat;
mod oracle_ct;
mod oracle_fla;
mod oracle_hf;
mod oracle_llamacpp;
mod oracle_tiktoken;
mod peer_kernels;
mod runs;
mod trunk_accuracy;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

/// One subcommand: `cargo xtask <name> <usage>`.
struct Task {
    name: &'static str,
    usage: &'static str,
    about: &'static str,
    run: fn(&[String]) -> Result<()>,
}

const TASKS: &[Task] = &[
    Task {
        name: "bench-kernels",
        usage: "[--tiers scalar,avx512,...] [--threads 1,2] [--trials N] [--filter TEXT]",
        about: "quick roofline of the kernels on K3 shapes: weight GB/s and % of the read \
                bandwidth measured in the same trials (criterion: cargo bench --bench kernels)",
        run: bench_kernels::run,
    },
    Task {
        name: "bench-peers",
        usage: "--model DIR [--threads 1,2] [--pairs N] [--tokens N] [--prompt N] [--trunk-format bf16|q8_0|mxfp4] [--no-peer] [--memory-gb G,.. | --memory-fraction F,..]",
        about: "decode and prefill side by side with llama.cpp's Kimi-K3 on the same checkpoint \
                (GGUF with a BF16 or, --trunk-format q8_0, Q8_0 trunk and MXFP4 experts), \
                alternating A B A B; ratios per pair; mxfp4 and --no-peer: ours alone",
        run: bench_peers::run,
    },
    Task {
        name: "bench-serve",
        usage: "--model DIR [--clients 1,2,4,8] [--peer] [--pairs K] [--requests R] [--max-tokens M] [--long-prompt TOKENS] [--threads T] [--ctx C] [--step-tokens N] [--interference [--streams S]] [--pair-prefill] [--ours-bin PATH] [--token-ids]",
        about: "load on the real HTTP server: N concurrent streaming chat clients and a long \
                prompt mid-run; output tokens/s, TTFT and ITL p50/p99; with --peer the same \
                against llama-server (continuous batching, same checkpoint), alternating; \
                --interference / --pair-prefill: a long prefill's effect on running streams, \
                two prefills together vs alone",
        run: bench_serve::run,
    },
    Task {
        name: "bench-spec",
        usage: "--model DIR [--threads 2] [--tokens 64] [--reps 5] [--pairs 2] [--max-pass 16] [--max-draft 8] [--rates 0,0.3,0.5,0.7,0.9] [--seed 0] [--bandwidth-gbps 400] [--kernel-tier T] [--resident-trunk]",
        about: "exact speculative decoding: the verify pass's cost curve (1..16 tokens, with the \
                trunk and routed-expert bytes read), the oracle drafter at each acceptance rate \
                and the n-gram drafter off against on (tokens checked equal), the release's \
                projected speedup",
        run: bench_spec::run,
    },
    Task {
        name: "trunk-accuracy",
        usage: "--model DIR [--tokens 64] [--threads 2] [--formats q8_0,mxfp4] [--peer [--bf16-gguf FILE] [--q8_0-gguf FILE]] [--out DIR]",
        about: "logits of the lossy trunk formats against the exact f32 forward of the BF16 \
                checkpoint (our bf16 path) over teacher-forced tokens: max |Δ|/max |logit|, \
                mean KL, top-1 agreement; --peer: llama.cpp's BF16 and Q8_0 GGUFs beside them",
        run: trunk_accuracy::run,
    },
    Task {
        name: "gguf",
        usage: "--model DIR --out FILE [--outtype bf16|f32|q8_0]",
        about: "convert a K3 checkpoint to llama.cpp's kimi-k3 GGUF without Python (the file \
                the vendored convert_hf_to_gguf.py writes; MXFP4 experts repacked losslessly; \
                q8_0: our Q8_0 trunk's matrices in ggml block_q8_0, the rest as bf16)",
        run: gguf_k3::run,
    },
    Task {
        name: "gguf-compare",
        usage: "--ours FILE --peer FILE",
        about: "check that every Q8_0 tensor of our GGUF has the same bytes in another GGUF \
                (llama-quantize's of the same checkpoint); names the first differing block",
        run: gguf_compare::run,
    },
    Task {
        name: "gen-k3-synth",
        usage: "--preset tiny|k3-0.40b|k3-wide --out DIR [--seed N] [--layers N] [--experts N] [--router-skew S] [--softplus-gate] [--trunk-dtype bf16|f16|f32] [--trunk-f16-values] [--vector-dtype bf16|f16|f32] [--mxfp4-linears NAME,..|all] [--mxfp4-as-bf16]",
        about: "write a synthetic K3 checkpoint in the release's layout (config, shards, index)",
        run: k3_synth::generate_checkpoint,
    },
    Task {
        name: "set-router-skew",
        usage: "--model DIR --skew S",
        about: "rewrite every MoE layer's router selection bias in place to gen-k3-synth's \
                --router-skew S (0: flat), for cache measurements on one checkpoint",
        run: k3_synth::set_router_skew,
    },
    Task {
        name: "oracle-tiktoken",
        usage: "[--venv DIR] [--out DIR]",
        about: "freeze the tokenizer reference vector: PyPI tiktoken 0.14.0 with the Kimi split \
                pattern on the synthetic vocabulary (written beside it)",
        run: oracle_tiktoken::run,
    },
    Task {
        name: "numa-model",
        usage: "[--config FILE] [--socket-gbps G] [--link-gbps G] [--efficiency E] [--tokens N]",
        about: "the multi-socket decode model: bytes per domain and across the link for \
                interleaved, home-domain and split-expert placements, the busiest domain's \
                expert share under a flat router (simulated), predicted s/token",
        run: numa_model::run,
    },
    Task {
        name: "k3-check",
        usage: "--model DIR [--no-scan]",
        about: "open a checkpoint directory as the server does, validate it against its \
                config.json, print the format census, and read every weight once for NaN/Inf \
                and 0xFF scales (--no-scan skips the read)",
        run: k3_check::run,
    },
    Task {
        name: "k3-plan",
        usage: "--config FILE [--ctx N,..] [--max-batch N] [--memory-gbps R] [--gflops G] [--machine-gb G,.. [--drives N,..] [--drive-gbps R]]",
        about: "byte plan of a K3 checkpoint for a config: bytes per tensor class and layer \
                kind, total, weight bytes per decoded token; with --ctx, the state per \
                sequence and the attention cost per decoded token at each context; with \
                --machine-gb, the memory plan on machines of that size (at the largest --ctx) \
                and the time per token from NVMe drives",
        run: k3_plan::run,
    },
    Task {
        name: "oracle-mxfp4",
        usage: "[--venv DIR] [--out FILE]",
        about: "regenerate the frozen MXFP4 decode oracle from pinned PyPI references \
            (ml-dtypes, compressed-tensors) in a Python venv",
        run: oracle::run,
    },
    Task {
        name: "oracle-ct-checkpoint",
        usage: "[--venv DIR] [--out DIR]",
        about: "regenerate the frozen tiny K3 checkpoint whose experts were packed by \
            compressed-tensors, with their ml_dtypes decode (k3-model tests)",
        run: oracle_ct::run,
    },
    Task {
        name: "oracle-llamacpp",
        usage: "[--model DIR] [--out DIR] [--tokens 1,2,3,...] [--mxfp4-experts] [--converter rust|python] [--venv DIR] [--softplus-gate]",
        about: "regenerate the frozen llama.cpp Kimi-K3 logits of the dense twin of a synthetic \
            checkpoint (default: tiny, seed 1), built from the llama-cpp-python sdist",
        run: oracle_llamacpp::run,
    },
    Task {
        name: "oracle-chat",
        usage: "[--venv DIR] [--out DIR]",
        about: "regenerate the frozen Kimi-K3 chat-template renderings (llama.cpp's template from \
            the llama-cpp-python sdist, rendered by jinja2) of the conversations in \
            crates/k3-model/tests/data/chat (k3-model tests)",
        run: oracle_chat::run,
    },
    Task {
        name: "oracle-hf-download",
        usage: "[--venv DIR] [--out DIR]",
        about: "freeze what huggingface_hub's own `hf download` makes of the docs' download \
            command for the release (its CLI parser and pattern filter; nothing is fetched); \
            xtask's docs tests check it",
        run: oracle_hf::run,
    },
    Task {
        name: "oracle-fla-kda",
        usage: "[--venv DIR] [--out DIR]",
        about: "regenerate the frozen KDA gate and recurrence vector from flash-linear-attention's \
            pure-PyTorch references (fla-core naive_recurrent_kda, k3-model tests)",
        run: oracle_fla::run,
    },
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // `{:#}` prints the context chain on one line; a backtrace would only show xtask.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(args: &[String]) -> Result<()> {
    let Some((name, rest)) = args.split_first() else {
        print_help();
        return Ok(());
    };
    if matches!(name.as_str(), "help" | "-h" | "--help") {
        print_help();
        return Ok(());
    }
    let Some(task) = TASKS.iter().find(|t| t.name == name) else {
        bail!("unknown task {name:?} (`cargo xtask help` lists them)");
    };
    if rest.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "cargo xtask {} {}\n    {}",
            task.name, task.usage, task.about
        );
        return Ok(());
    }
    (task.run)(rest).with_context(|| format!("cargo xtask {} failed", task.name))
}

fn print_help() {
    println!("usage: cargo xtask <task> [options]\n\ntasks:");
    println!("    {:<16} print this list", "help");
    for task in TASKS {
        println!("    {:<16} {}", task.name, task.about);
        println!(
            "    {:<16} usage: cargo xtask {} {}",
            "", task.name, task.usage
        );
    }
    println!("\nrelative paths are taken from the workspace root");
}

/// The workspace root. Tasks run from there, whatever directory cargo was started in, so that
/// default paths and the commands recorded in generated files do not depend on it.
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits one level below the root")
}

/// `path` if absolute, else `path` under the workspace root.
fn from_root(path: &str) -> PathBuf {
    workspace_root().join(path)
}

/// The `--name VALUE` (or `--name=VALUE`) options of one task: each at most once, and only
/// the names the task declares, so a typo is an error rather than a silently ignored flag.
/// A declared name ending in `!` is a switch: `--name` alone, no value.
#[derive(Debug)]
struct Options {
    values: Vec<(&'static str, String)>,
}

impl Options {
    fn parse(args: &[String], allowed: &[&'static str]) -> Result<Self> {
        let mut values: Vec<(&'static str, String)> = Vec::new();
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                bail!("unexpected argument {arg:?} (options are --name VALUE)");
            };
            let (flag, inline) = match flag.split_once('=') {
                Some((flag, value)) => (flag, Some(value.to_owned())),
                None => (flag, None),
            };
            let Some(&declared) = allowed.iter().find(|&&a| a.trim_end_matches('!') == flag) else {
                bail!("unknown option --{flag} (known: {})", allowed.join(", "));
            };
            let name = declared.trim_end_matches('!');
            if values.iter().any(|(n, _)| *n == name) {
                bail!("option --{name} given twice");
            }
            let switch = declared.ends_with('!');
            let value = match inline {
                Some(_) if switch => bail!("--{name} is a switch and takes no value"),
                Some(value) => value,
                None if switch => "true".to_owned(),
                None => iter
                    .next()
                    .with_context(|| format!("option --{name} needs a value"))?
                    .clone(),
            };
            values.push((name, value));
        }
        Ok(Self { values })
    }

    /// Whether the switch `--name` was given.
    fn flag(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `cargo xtask <task> <args>` as a shell line, for provenance records in generated files.
fn command_line(task: &str, args: &[String]) -> String {
    let mut line = format!("cargo xtask {task}");
    for arg in args {
        line.push(' ');
        let plain = !arg.is_empty()
            && arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:+,@".contains(c));
        if plain {
            line.push_str(arg);
        } else {
            line.push('\'');
            line.push_str(&arg.replace('\'', r"'\''"));
            line.push('\'');
        }
    }
    line
}
