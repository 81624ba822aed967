//! `cargo xtask bench-serve --model DIR --clients 1,2,4,8 [--peer]`: drives the real HTTP
//! server with concurrent streaming chat clients, and with `--peer` llama.cpp's
//! `llama-server` (built from the pinned sdist, continuous batching, the GGUF of the same
//! checkpoint), alternating ours, peer for each setting; one fresh server per run.
//!
//! The load (default): at each N of `--clients`, N clients send `--requests` requests back to
//! back (prompts of 32, 128 and 512 tokens in turn, `--max-tokens` each) and one long prompt
//! (`--long-prompt` tokens) arrives once half of them have finished. Each server decodes N + 1
//! sequences together (ours `--max-batch`, the peer's `--parallel`), so the long prompt is
//! admitted at once rather than queued. Printed: output tokens/s over the run's wall time,
//! TTFT and ITL p50/p99 of the N clients, their longest gap, the long prompt's TTFT.
//!
//! `--interference` and `--pair-prefill` run the two focused measurements instead, each on a
//! server without a prompt cache (see `load`): the streams' ITL before and during a long
//! prompt's prefill with its TTFT loaded and idle; two long prompts prefilled together versus
//! each alone.
//!
//! `--token-ids` sends every prompt to `/v1/completions` as the token ids our tokenizer makes
//! of its text (no chat template): llama.cpp's vocabulary converted from a synthetic tokenizer
//! splits the same text into other (and more) tokens, so only ids give both servers the same
//! prompts.
//!
//! Timings are the client's: the instant each SSE chunk with generated text was read (both
//! servers stream a token a chunk). Output tokens come from each answer's `usage`. Prompt
//! lengths are counted with the checkpoint's tokenizer (the chat template adds a few tokens;
//! the tables show the long prompt's count as the server reported it).

mod client;
mod load;
mod server;
mod stats;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k3_model::tokenizer::Tokenizer;

use crate::gguf_k3_meta::Outtype;
use crate::oracle::run_checked;
use crate::oracle_llamacpp::{WORK_DIR, build_llama_server, fetch_sdist};
use crate::{Options, from_root};
use load::{LONG_MAX_TOKENS, LoadSpec, PROMPT_TOKENS, Prompts, interference, pair_prefill};
use server::{Engine, Launcher};
use stats::{cell, max_ms, ms, percentile_ms, ratio};

/// llama.cpp's Kimi-K3 chat template in its source (the one `oracle-chat` checks ours against).
const K3_TEMPLATE: &str = "models/templates/Kimi-K3.jinja";
/// `--ctx` when not given: this, or the checkpoint's `max_position_embeddings` if smaller.
const DEFAULT_CTX: usize = 8192;
/// `--long-prompt` when not given: for the load,
const LONG_TOKENS_LOAD: usize = 2000;
/// and for the focused measurements: with the template, as long as a sequence of the
/// synthetic checkpoints' 4096 positions allows.
const LONG_TOKENS_FOCUSED: usize = 3500;
/// Room for the chat template's tokens around a prompt: about 250 in the synthetic
/// vocabularies, which spell the template's tags in few merges (far fewer in K3's).
const TEMPLATE_TOKENS: usize = 320;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(
        args,
        &[
            "model",
            "clients",
            "peer!",
            "pairs",
            "requests",
            "max-tokens",
            "long-prompt",
            "threads",
            "ctx",
            "step-tokens",
            "interference!",
            "pair-prefill!",
            "streams",
            "ours-bin",
            "token-ids!",
        ],
    )?;
    let model = from_root(o.get("model").context("--model DIR is required")?);
    let number = |name: &str, default: usize| -> Result<usize> {
        let value = o
            .get(name)
            .map(|v| {
                v.parse()
                    .with_context(|| format!("--{name} {v:?} is not a count"))
            })
            .transpose()?
            .unwrap_or(default);
        ensure!(value > 0, "--{name} must be at least 1");
        Ok(value)
    };
    let focused = o.flag("interference") || o.flag("pair-prefill");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = number("threads", cores)?;
    let ctx = number("ctx", default_ctx(&model)?)?;
    let default_long = match focused {
        true => LONG_TOKENS_FOCUSED,
        false => LONG_TOKENS_LOAD,
    };
    let bench = Bench {
        pairs: number("pairs", 1)?,
        long_tokens: number("long-prompt", default_long)?,
        prompts: Prompts::new(
            &Tokenizer::from_dir(&model)
                .with_context(|| format!("loading the tokenizer of {}", model.display()))?,
        ),
        ctx,
    };
    bench.fits(bench.long_tokens, LONG_MAX_TOKENS, "--long-prompt")?;
    if o.flag("token-ids") {
        // Prompts as token ids on /v1/completions (see `client::TOKEN_IDS`).
        let tokenizer = Tokenizer::from_dir(&model)
            .with_context(|| format!("loading the tokenizer of {}", model.display()))?;
        let _ = client::TOKEN_IDS.set(tokenizer);
    }
    let extra = match o.get("step-tokens") {
        Some(n) => vec!["--step-tokens".to_string(), n.to_string()],
        None => Vec::new(),
    };
    let log_dir = from_root("target/bench-serve");
    // `--ours-bin PATH`: another build of k3-serve (an older commit's, for a before/after);
    // it must take the flags this one passes (no `--step-tokens` before the scheduler).
    let ours = match o.get("ours-bin") {
        Some(path) => from_root(path),
        None => {
            run_checked(Command::new("cargo").args(["build", "--release", "-p", "k3-serve"]))?;
            from_root("target/release/k3-serve")
        }
    };
    let mut launchers = vec![Launcher {
        engine: Engine::Ours,
        binary: ours,
        model: model.clone(),
        threads,
        ctx,
        extra,
        log_dir: log_dir.clone(),
    }];
    if o.flag("peer") {
        let work = from_root(WORK_DIR);
        std::fs::create_dir_all(&work)?;
        let source = fetch_sdist(&work)?;
        launchers.push(Launcher {
            engine: Engine::Peer,
            binary: build_llama_server(&work, &source)?,
            model: crate::bench_peers::convert(&work, &model, Outtype::Bf16)?,
            threads,
            ctx,
            // The GGUF carries no chat template, and llama-server's default (ChatML) is far
            // shorter than K3's: the sdist's K3 template makes both prefill the same prompts.
            extra: vec![
                "--jinja".into(),
                "--chat-template-file".into(),
                source.join(K3_TEMPLATE).display().to_string(),
            ],
            log_dir,
        });
    }
    println!(
        "\nmachine: {} ({cores} logical CPUs); servers: {threads} threads, ctx {ctx} per \
         sequence; model {}",
        cpu_model(),
        model.display()
    );
    if focused {
        if o.flag("interference") {
            bench.interference(&launchers, number("streams", 3)?)?;
        }
        if o.flag("pair-prefill") {
            bench.pair_prefill(&launchers)?;
        }
        return Ok(());
    }
    let clients: Vec<usize> = o
        .get("clients")
        .unwrap_or("1,2,4,8")
        .split(',')
        .map(|c| c.trim().parse().context("--clients is a list of counts"))
        .collect::<Result<_>>()?;
    let (requests, max_tokens) = (number("requests", 4)?, number("max-tokens", 32)?);
    bench.fits(PROMPT_TOKENS[2], max_tokens, "--max-tokens")?;
    bench.load(&launchers, &clients, requests, max_tokens)
}

/// What every measurement shares.
struct Bench {
    /// Runs of each engine per setting, alternating.
    pairs: usize,
    long_tokens: usize,
    prompts: Prompts,
    /// Context per sequence.
    ctx: usize,
}

impl Bench {
    /// Fails unless `prompt` tokens, the template and `generated` fit in a sequence.
    fn fits(&self, prompt: usize, generated: usize, flag: &str) -> Result<()> {
        ensure!(
            prompt + TEMPLATE_TOKENS + generated <= self.ctx,
            "{flag}: a {prompt}-token prompt, {TEMPLATE_TOKENS} tokens for the template and \
             {generated} generated do not fit --ctx {}",
            self.ctx
        );
        Ok(())
    }

    /// The load at each client count; for each pair, ours then the peer.
    fn load(
        &self,
        launchers: &[Launcher],
        clients: &[usize],
        requests: usize,
        max_tokens: usize,
    ) -> Result<()> {
        println!(
            "\nload: {requests} requests a client (prompts of {PROMPT_TOKENS:?} tokens in turn), \
             {max_tokens} tokens each; one {}-token prompt after half of them; times in ms\n",
            self.long_tokens
        );
        let mut table = Table::new(&[
            ("out tok/s", 2),
            ("TTFT p50", 1),
            ("TTFT p99", 1),
            ("ITL p50", 1),
            ("ITL p99", 1),
            ("longest gap", 1),
            ("long prompt tokens", 0),
            ("long TTFT", 1),
        ]);
        for &n in clients {
            for run in 0..self.pairs {
                for launcher in launchers {
                    let server = launcher.start(n + 1, false)?;
                    let spec = LoadSpec {
                        clients: n,
                        requests,
                        max_tokens,
                        long_tokens: self.long_tokens,
                    };
                    let r = load::load(server.addr, spec, &self.prompts)?;
                    server.stop()?;
                    let generated =
                        r.normal.iter().map(|t| t.generated()).sum::<u64>() + r.long.generated();
                    let ttfts: Vec<Duration> = r.normal.iter().filter_map(|t| t.ttft()).collect();
                    let gaps: Vec<Duration> = r
                        .normal
                        .iter()
                        .flat_map(|t| t.gaps().map(|(gap, _)| gap))
                        .collect();
                    let values = vec![
                        Some(generated as f64 / r.wall.as_secs_f64()),
                        percentile_ms(&ttfts, 50.0),
                        percentile_ms(&ttfts, 99.0),
                        percentile_ms(&gaps, 50.0),
                        percentile_ms(&gaps, 99.0),
                        max_ms(&gaps),
                        r.long.usage.map(|u| u.0 as f64),
                        r.long.ttft().map(ms),
                    ];
                    table.push(launcher.engine, n, run, values);
                }
            }
        }
        table.print_ratios("clients");
        Ok(())
    }

    /// `--interference`: for each pair, ours then the peer.
    fn interference(&self, launchers: &[Launcher], streams: usize) -> Result<()> {
        println!(
            "\ninterference: {streams} streams decoding, then a {}-token prompt; the streams' ITL \
             before it and during its prefill (its send to its first token); its TTFT with the \
             streams and alone; times in ms\n",
            self.long_tokens
        );
        let mut table = Table::new(&[
            ("streams alive", 0),
            ("ITL p50 before", 1),
            ("ITL p99 before", 1),
            ("ITL p50 during", 1),
            ("ITL p99 during", 1),
            ("longest gap during", 1),
            ("long prompt tokens", 0),
            ("TTFT loaded", 1),
            ("TTFT idle", 1),
            ("loaded / idle", 2),
        ]);
        // The streams decode until dropped: as long as a sequence allows.
        let stream_tokens = self.ctx - PROMPT_TOKENS[0] - TEMPLATE_TOKENS;
        for run in 0..self.pairs {
            for launcher in launchers {
                let server = launcher.start(streams + 1, true)?;
                let r = interference(
                    server.addr,
                    streams,
                    stream_tokens,
                    self.long_tokens,
                    &self.prompts,
                )?;
                server.stop()?;
                let (loaded, idle) = (r.loaded.ttft().map(ms), r.idle.ttft().map(ms));
                let values = vec![
                    Some(r.streams_alive as f64),
                    percentile_ms(&r.before, 50.0),
                    percentile_ms(&r.before, 99.0),
                    percentile_ms(&r.during, 50.0),
                    percentile_ms(&r.during, 99.0),
                    max_ms(&r.during),
                    r.loaded.usage.map(|u| u.0 as f64),
                    loaded,
                    idle,
                    ratio(loaded, idle),
                ];
                table.push(launcher.engine, streams, run, values);
            }
        }
        table.print_ratios("streams");
        Ok(())
    }

    /// `--pair-prefill`: for each pair, ours then the peer.
    fn pair_prefill(&self, launchers: &[Launcher]) -> Result<()> {
        println!(
            "\npair prefill: two {}-token prompts sent together, until both have their first \
             token, versus two others each sent alone on the idle server; times in ms\n",
            self.long_tokens
        );
        let mut table = Table::new(&[
            ("prompt tokens", 0),
            ("together", 1),
            ("alone A", 1),
            ("alone B", 1),
            ("alone A + B", 1),
            ("together / (A + B)", 2),
        ]);
        for run in 0..self.pairs {
            for launcher in launchers {
                let server = launcher.start(2, true)?;
                let r = pair_prefill(server.addr, self.long_tokens, &self.prompts)?;
                server.stop()?;
                let (together, sum) = (ms(r.together), ms(r.alone[0] + r.alone[1]));
                let values = vec![
                    r.prompt_tokens.map(|t| t as f64),
                    Some(together),
                    Some(ms(r.alone[0])),
                    Some(ms(r.alone[1])),
                    Some(sum),
                    ratio(Some(together), Some(sum)),
                ];
                table.push(launcher.engine, 2, run, values);
            }
        }
        table.print_ratios("sequences");
        Ok(())
    }
}

/// A markdown table printed a row at a time as runs finish, then ours / peer per run.
struct Table {
    /// Each numeric column's name and decimals.
    columns: &'static [(&'static str, usize)],
    rows: Vec<(Engine, usize, usize, Vec<Option<f64>>)>,
}

impl Table {
    fn new(columns: &'static [(&'static str, usize)]) -> Self {
        let names: Vec<&str> = columns.iter().map(|c| c.0).collect();
        println!("| engine | N | run | {} |", names.join(" | "));
        println!("|---|---:|---:|{}", "---:|".repeat(columns.len()));
        Self {
            columns,
            rows: Vec::new(),
        }
    }

    fn push(&mut self, engine: Engine, n: usize, run: usize, values: Vec<Option<f64>>) {
        let cells: Vec<String> = values
            .iter()
            .zip(self.columns)
            .map(|(v, (_, decimals))| cell(*v, *decimals))
            .collect();
        println!(
            "| {} | {n} | {run} | {} |",
            engine.name(),
            cells.join(" | ")
        );
        self.rows.push((engine, n, run, values));
    }

    /// Each column, ours / peer, for every run both engines made (nothing without `--peer`).
    fn print_ratios(&self, n_name: &str) {
        let mut lines = Vec::new();
        for (engine, n, run, ours) in &self.rows {
            let peer = self
                .rows
                .iter()
                .find(|r| r.0 == Engine::Peer && (r.1, r.2) == (*n, *run));
            if let (Engine::Ours, Some((.., peer))) = (engine, peer) {
                let cells: Vec<String> = ours
                    .iter()
                    .zip(peer)
                    .map(|(a, b)| cell(ratio(*a, *b), 2))
                    .collect();
                lines.push(format!("| {n} | {run} | {} |", cells.join(" | ")));
            }
        }
        if lines.is_empty() {
            return;
        }
        let names: Vec<&str> = self.columns.iter().map(|c| c.0).collect();
        println!(
            "\nk3-serve / llama-server (tokens/s: above 1 is ours faster; times: below 1 is ours faster)\n"
        );
        println!("| {n_name} | run | {} |", names.join(" | "));
        println!("|---:|---:|{}", "---:|".repeat(self.columns.len()));
        for line in lines {
            println!("{line}");
        }
    }
}

/// [`DEFAULT_CTX`], or the checkpoint's `max_position_embeddings` if smaller.
fn default_ctx(model: &Path) -> Result<usize> {
    let path = model.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let config = k3_model::K3Config::from_json(&text)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(DEFAULT_CTX.min(config.max_position_embeddings))
}

/// The CPU's model name from /proc/cpuinfo.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                Some(
                    l.strip_prefix("model name")?
                        .split_once(':')?
                        .1
                        .trim()
                        .to_owned(),
                )
            })
        })
        .unwrap_or_else(|| "unknown CPU".into())
}
