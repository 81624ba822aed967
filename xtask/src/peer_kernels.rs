//! `cargo xtask bench-peers --kernels [--threads 1,2] [--trials N] [--filter TEXT]`: our MXFP4
//! and BF16 GEMV kernels side by side with ggml's (llama.cpp's CPU backend) on K3 shapes, with
//! every weight byte coming from DRAM.
//!
//! ggml runs in a small C harness (`xtask/peer/ggml_gemv.c`): one graph with one `mul_mat`
//! per matrix of a ~700 MB ring, on a persistent pinned threadpool, as a decode graph runs.
//! Its MXFP4 weights sit in the CPU backend's repack buffer, interleaved 8 rows at a time, as
//! llama.cpp places CPU weights by default; the plain layout (one `vec_dot` per row, what
//! `--no-repack` runs) is measured too, in the last two columns.
//! Ours are the out-of-cache cases of `benches::cases` (a 702 MB expert ring for MXFP4, a
//! matrix 5-7x the L3 for BF16), at the exact default tier and at the tier that rounds the
//! activations as ggml does (int8 per 32 values like its Q8_0 for MXFP4, BF16 for BF16).
//! Each trial runs ggml, our tiers and the read probe in turn, so a noisy neighbour moves all
//! of them; ratios are medians of the per-trial ratios.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use benches::Pool;
use benches::cases::{Cache, Case, Workloads, cases, read_case};
use benches::{
    EXPERT_INTER, EXPERT_LATENT, HIDDEN, HIDDEN_040B, KDA_ROWS, LM_HEAD_040B_ROWS,
    LM_HEAD_SLICE_ROWS,
};
use mxfp4_kernels::{Kernels, Tier};

use crate::oracle::run_checked;
use crate::oracle_llamacpp::build_llama_bench;
use crate::oracle_llamacpp::{WORK_DIR, fetch_sdist};
use crate::{Options, from_root};

const HARNESS_SOURCE: &str = "xtask/peer/ggml_gemv.c";
/// ggml's ring: about the size of our 40-expert ring (702 MB, 22x the 32 MiB L3).
const PEER_RING_BYTES: usize = 700_000_000;
/// Both sides time at least this long per trial.
const MIN_TIMED: Duration = Duration::from_millis(250);
/// ggml's first output row against the harness's own decode (relative to Σ|w·x|): its
/// activation rounding stays near 1e-4; a misread layout would be order 1.
const MAX_ROW0_ERROR: f64 = 1e-2;

/// One GEMV run by both sides: ggml on `rows x cols` of `ggml_type`, ours as the
/// out-of-cache case `op` / `shape`.
#[derive(Debug)]
struct Peer {
    op: &'static str,
    shape: &'static str,
    ggml_type: &'static str,
    rows: usize,
    cols: usize,
    /// Our tier that rounds the activations as ggml does.
    approx: Tier,
    /// Whether llama.cpp repacks this weight type on this CPU (CPU_REPACK has no BF16 layout
    /// on x86).
    repacks: bool,
}

/// How the harness lays out ggml's weights.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Plain ggml tensors: `mul_mat` runs the type's `vec_dot` row by row.
    Plain,
    /// The CPU_REPACK buffer: 8 rows interleaved, run by the type's `gemv` (llama.cpp's default).
    Repack,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Plain => "plain",
            Layout::Repack => "repack",
        }
    }
}

const PEERS: [Peer; 5] = [
    Peer {
        op: "mxfp4_gemv",
        shape: "gate_3072x3584",
        ggml_type: "mxfp4",
        rows: EXPERT_INTER,
        cols: EXPERT_LATENT,
        approx: Tier::Avx512Vnni,
        repacks: true,
    },
    Peer {
        op: "mxfp4_gemv",
        shape: "down_3584x3072",
        ggml_type: "mxfp4",
        rows: EXPERT_LATENT,
        cols: EXPERT_INTER,
        approx: Tier::Avx512Vnni,
        repacks: true,
    },
    Peer {
        op: "bf16_gemv",
        shape: "kda_12288x7168",
        ggml_type: "bf16",
        rows: KDA_ROWS,
        cols: HIDDEN,
        approx: Tier::Avx512Bf16,
        repacks: false,
    },
    Peer {
        op: "bf16_gemv",
        shape: "lm_head_16384x7168",
        ggml_type: "bf16",
        rows: LM_HEAD_SLICE_ROWS,
        cols: HIDDEN,
        approx: Tier::Avx512Bf16,
        repacks: false,
    },
    Peer {
        op: "bf16_gemv",
        shape: "lm_head_163840x1024",
        ggml_type: "bf16",
        rows: LM_HEAD_040B_ROWS,
        cols: HIDDEN_040B,
        approx: Tier::Avx512Bf16,
        repacks: false,
    },
];

impl Peer {
    /// Weight bytes of one matrix: MXFP4 counts its E8M0 scale, 17 bytes per 32 weights, in
    /// both layouts (ggml interleaves it, we keep it in a separate array).
    fn matrix_bytes(&self) -> usize {
        match self.ggml_type {
            "mxfp4" => self.rows * self.cols / 32 * 17,
            _ => self.rows * self.cols * 2,
        }
    }
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    // `--kernels` is accepted so that bench-peers may pass its arguments through unchanged.
    let options = Options::parse(args, &["kernels!", "threads", "trials", "filter"])?;
    let trials: usize = options
        .get("trials")
        .unwrap_or("5")
        .parse()
        .context("--trials is a count")?;
    let threads: Vec<usize> = options
        .get("threads")
        .unwrap_or("1,2")
        .split(',')
        .map(|t| t.trim().parse().context("--threads is a list of counts"))
        .collect::<Result<_>>()?;
    ensure!(
        trials >= 1 && !threads.contains(&0),
        "--trials and --threads must be at least 1"
    );
    let filter = options.get("filter").unwrap_or("");
    let peers: Vec<&Peer> = PEERS
        .iter()
        .filter(|p| format!("{}/{}", p.op, p.shape).contains(filter))
        .collect();
    if peers.is_empty() {
        bail!("--filter {filter:?} matches none of the peer cases (op/shape)");
    }

    let work = from_root(WORK_DIR);
    std::fs::create_dir_all(&work)?;
    let source = fetch_sdist(&work)?;
    let llama_bench = build_llama_bench(&work, &source)?;
    let harness = build_harness(&work, &source, &llama_bench)?;

    eprintln!(
        "generating our weights: 40 experts (702 MB), KDA projection, lm_head slice, 1 GiB probe ..."
    );
    let w = Workloads::generate();

    println!(
        "| op | shape | threads | our tier | ours GB/s | ggml GB/s | read GB/s | ours / ggml | ours % of read | ggml % of read | ggml no-repack GB/s | ours / no-repack |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut features = None;
    for &n_threads in &threads {
        let pool = Pool::new(n_threads)?;
        let mut probe = read_case(&w, &pool);
        (probe.run)();
        // Our cases for every tier any peer needs; each peer takes its own out of them.
        let mut tier_cases: Vec<(Tier, Vec<Case<'_>>)> = Vec::new();
        // The exact SIMD tier this CPU has (avx512, else avx2: the same bits) is compared on
        // every case; an approximate tier on the cases whose peer it matches.
        let exact = Kernels::detect().tier();
        for tier in [exact, Tier::Avx512Vnni, Tier::Avx512Bf16] {
            if tier == Tier::Scalar || peers.iter().all(|p| tier != exact && tier != p.approx) {
                continue;
            }
            match Kernels::new(tier) {
                Ok(k) => tier_cases.push((tier, cases(&w, &pool, k))),
                Err(error) => eprintln!("skipping tier {tier}: {error}"),
            }
        }
        for peer in &peers {
            let mut ours: Vec<(Tier, Case<'_>)> = Vec::new();
            for (tier, list) in &mut tier_cases {
                if *tier != exact && *tier != peer.approx {
                    continue;
                }
                let found = list.iter().position(|c| {
                    c.op == peer.op && c.shape == peer.shape && c.cache == Cache::OutOfCache
                });
                let case = list.swap_remove(found.with_context(|| {
                    format!(
                        "benches::cases has no out-of-cache {}/{}",
                        peer.op, peer.shape
                    )
                })?);
                ensure!(
                    case.bytes % peer.matrix_bytes() == 0,
                    "{case:?} reads {} bytes per call, not a multiple of the {}-byte matrix",
                    case.bytes,
                    peer.matrix_bytes()
                );
                ours.push((*tier, case));
            }
            for (_, case) in &mut ours {
                (case.run)(); // warm-up: page faults, clocks
            }
            let default_layout = if peer.repacks {
                Layout::Repack
            } else {
                Layout::Plain
            };
            let mut ggml = Vec::with_capacity(trials);
            let mut ggml_plain = Vec::with_capacity(trials);
            let mut read = Vec::with_capacity(trials);
            let mut kernel = vec![Vec::with_capacity(trials); ours.len()];
            for _ in 0..trials {
                let peer_run = run_harness(&harness, peer, n_threads, default_layout)?;
                features.get_or_insert(peer_run.features);
                ggml.push(peer_run.bytes_per_second);
                if peer.repacks {
                    let plain = run_harness(&harness, peer, n_threads, Layout::Plain)?;
                    ggml_plain.push(plain.bytes_per_second);
                }
                for ((_, case), rates) in ours.iter_mut().zip(&mut kernel) {
                    rates.push(rate(case));
                }
                read.push(rate(&mut probe));
            }
            for ((tier, _), rates) in ours.iter().zip(&kernel) {
                let per_trial = |num: &[f64], den: &[f64]| {
                    median(num.iter().zip(den).map(|(n, d)| n / d).collect())
                };
                let no_repack = if ggml_plain.is_empty() {
                    "— | —".to_owned()
                } else {
                    format!(
                        "{:.1} | {:.2}x",
                        median(ggml_plain.clone()) / 1e9,
                        per_trial(rates, &ggml_plain)
                    )
                };
                println!(
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.0}% | {:.0}% | {} |",
                    peer.op,
                    peer.shape,
                    n_threads,
                    tier,
                    median(rates.clone()) / 1e9,
                    median(ggml.clone()) / 1e9,
                    median(read.clone()) / 1e9,
                    per_trial(rates, &ggml),
                    100.0 * per_trial(rates, &read),
                    100.0 * per_trial(&ggml, &read),
                    no_repack,
                );
            }
        }
    }
    if let Some(features) = features {
        println!(
            "\nggml: llama-cpp-python 0.3.36's llama.cpp (GGML_NATIVE, libggml-cpu built for: \
             {features}). ggml GB/s: llama.cpp's default layout (MXFP4 repacked 8 rows at a time, \
             ggml_gemv_mxfp4_8x8_q8_0; BF16 plain, ggml_vec_dot_bf16); no-repack: MXFP4 plain, \
             ggml_vec_dot_mxfp4_q8_0 per row."
        );
    }
    Ok(())
}

/// Compiles the harness against the peer build's libggml (every run: it is one small file,
/// under a second); the rpath finds the libraries without `LD_LIBRARY_PATH`.
fn build_harness(work: &Path, source: &Path, llama_bench: &Path) -> Result<PathBuf> {
    let lib = llama_bench
        .parent()
        .context("llama-bench has no parent directory")?;
    let lib_dir = lib
        .strip_prefix(work)
        .context("the peer build lies outside the llama.cpp work directory")?;
    let harness = work.join("ggml_gemv");
    run_checked(
        Command::new("cc")
            .args(["-std=c11", "-O2", "-march=native", "-Wall", "-Wextra"])
            .arg(format!(
                "-I{}",
                source.join("ggml").join("include").display()
            ))
            .arg(from_root(HARNESS_SOURCE))
            .arg("-o")
            .arg(&harness)
            .arg(format!("-L{}", lib.display()))
            .args(["-lggml-cpu", "-lggml-base", "-lm"])
            .arg(format!("-Wl,-rpath,$ORIGIN/{}", lib_dir.display())),
    )?;
    Ok(harness)
}

/// What one harness run printed.
#[derive(Debug)]
struct HarnessRun {
    bytes_per_second: f64,
    features: String,
}

/// ggml's weight bytes per second on `peer` with `threads` threads and weights laid out as
/// `layout`, over a ring of at least [`PEER_RING_BYTES`]; fails if its first output row
/// disagrees with the harness's own decode.
fn run_harness(harness: &Path, peer: &Peer, threads: usize, layout: Layout) -> Result<HarnessRun> {
    let ring = PEER_RING_BYTES.div_ceil(peer.matrix_bytes());
    let out = Command::new(harness)
        .arg(peer.ggml_type)
        .args([peer.rows, peer.cols, threads, ring].map(|n| n.to_string()))
        .arg(MIN_TIMED.as_millis().to_string())
        .arg(layout.name())
        .output()
        .with_context(|| format!("cannot start {}", harness.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{} exited with {}: {}{}",
        harness.display(),
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let value = |key: &str| -> Result<&str> {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .with_context(|| format!("the harness printed no {key:?} line: {stdout}"))
    };
    let number = |key: &str| -> Result<f64> {
        value(key)?
            .trim()
            .parse()
            .with_context(|| format!("the harness's {key:?} is not a number: {stdout}"))
    };
    let gbps = number("gbps")?;
    let checksum = number("checksum")?;
    let row0_error = number("row0_error")?;
    ensure!(
        checksum.is_finite() && checksum != 0.0,
        "ggml's {} ({}) output sums to {checksum}",
        peer.shape,
        layout.name()
    );
    ensure!(
        row0_error <= MAX_ROW0_ERROR,
        "ggml's {} ({}) first row is off by {row0_error:.1e} of Σ|w·x| (limit {MAX_ROW0_ERROR:.0e})",
        peer.shape,
        layout.name()
    );
    Ok(HarnessRun {
        bytes_per_second: gbps * 1e9,
        features: value("features")?.to_owned(),
    })
}

/// Bytes per second over at least [`MIN_TIMED`] of calls.
fn rate(case: &mut Case<'_>) -> f64 {
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < MIN_TIMED {
        (case.run)();
        calls += 1;
    }
    (case.bytes as f64 * calls as f64) / start.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
