//! `cargo xtask bench-kernels`: a quick roofline table of the kernels on K3 shapes — weight GB/s
//! and the fraction of the read bandwidth measured in the same run, trial by trial.
//!
//! Every figure is a median over trials in which the kernel and the STREAM-like read probe
//! (same thread count) alternate, so a noisy neighbour moves both. The criterion benches
//! (`cargo bench --bench kernels`) measure the same workloads with statistics; this is the
//! one-minute view (and the README's first command).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use benches::{
    EXPERT_INTER, EXPERT_LATENT, Expert, ExpertViews, HIDDEN, KDA_ROWS, LM_HEAD_SLICE_ROWS, Pool,
    activations, bandwidth_buffer, bf16_bytes, bf16_view, check_against_scalar, experts, read_all,
    split_rows,
};
use mxfp4_kernels::{ExpertScratch, Kernels, Tier};

use crate::Options;

/// Experts in the out-of-cache ring: 40 x 17.5 MB = 702 MB, 22x the 32 MiB L3.
const RING: usize = 40;
/// Matrices per timed call: waking the pool's workers costs tens of microseconds in this VM,
/// so each call carries milliseconds of work (a decode step's layer does, too).
const BATCH: usize = 16;
/// Calls on the L2-resident slice per timed call.
const L2_REPEATS: usize = 64;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let options = Options::parse(args, &["tiers", "threads", "trials", "filter"])?;
    let trials: usize = options.get("trials").unwrap_or("5").parse()?;
    let threads: Vec<usize> = parse_list(options.get("threads").unwrap_or("1,2"))?;
    let filter = options.get("filter").unwrap_or("");
    let tiers: Vec<Kernels> = match options.get("tiers") {
        None => Kernels::available(),
        Some(list) => list
            .split(',')
            .map(|t| Ok(Kernels::new(t.parse::<Tier>()?)?))
            .collect::<Result<_>>()?,
    };
    if trials == 0 {
        bail!("--trials must be at least 1");
    }
    eprintln!(
        "generating weights: {RING} experts (702 MB), KDA projection (176 MB), lm_head slice (235 MB) ..."
    );
    let ring: &'static [Expert] = Vec::leak(experts(RING, 42));
    let views: Vec<ExpertViews<'static>> = ring.iter().map(Expert::views).collect();
    let kda = bf16_bytes(KDA_ROWS, HIDDEN, 7);
    let head = bf16_bytes(LM_HEAD_SLICE_ROWS, HIDDEN, 8);
    let probe = bandwidth_buffer(1 << 30);
    let z = activations(EXPERT_LATENT, 3);
    let h = activations(EXPERT_INTER, 4);
    let x = activations(HIDDEN, 5);
    let tokens16 = activations(16 * EXPERT_LATENT, 6);

    println!(
        "| op | shape | cache | threads | tier | weight GB/s | read GB/s (same trials) | % of read |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &n_threads in &threads {
        let pool = Pool::new(n_threads);
        let report = |op: &str,
                      shape: &str,
                      cache: &str,
                      tier: Tier,
                      bytes: usize,
                      work: &mut dyn FnMut()| {
            let name = format!("{op}/{shape}/{cache}/t{n_threads}/{tier}");
            if !name.contains(filter) {
                return;
            }
            let (kernel, read) = alternate(trials, bytes, work, &pool, &probe);
            println!(
                "| {op} | {shape} | {cache} | {n_threads} | {tier} | {:.1} | {:.1} | {:.0}% |",
                kernel / 1e9,
                read / 1e9,
                100.0 * kernel / read
            );
        };
        for k in &tiers {
            let tier = k.tier();
            // Scalar is the oracle, measured once for reference (it is ~20x slower).
            let oracle_only = tier == Tier::Scalar && n_threads > 1;
            if oracle_only {
                continue;
            }
            let za = k.prepare(&z, EXPERT_LATENT)?;
            let ha = k.prepare(&h, EXPERT_INTER)?;
            let xa = k.prepare(&x, HIDDEN)?;
            sanity(k, &ring[0], &za, &xa, &kda)?;

            // MXFP4 GEMV, gate/up shape and down shape.
            for (shape, pick, act, rows) in [
                ("gate_3072x3584", 0usize, &za, EXPERT_INTER),
                ("down_3584x3072", 2, &ha, EXPERT_LATENT),
            ] {
                let matrix = |e: &ExpertViews<'static>| match pick {
                    0 => e.gate,
                    _ => e.down,
                };
                let outs: Vec<Mutex<Vec<f32>>> = (0..n_threads)
                    .map(|_| Mutex::new(vec![0.0; rows]))
                    .collect();
                let bytes = matrix(&views[0]).weight_bytes();
                let mut next = 0usize;
                // `count` matrices from the ring starting at `first`, `step` apart (0: the same
                // matrix again), over the first `rows_used` rows.
                let run =
                    |pool: &Pool, first: usize, count: usize, step: usize, rows_used: usize| {
                        pool.broadcast(|w| {
                            let range = split_rows(rows_used, n_threads, w);
                            let mut out = outs[w].lock().expect("no poisoning in benches");
                            for i in 0..count {
                                let m = matrix(&views[(first + i * step) % RING]);
                                k.matmul_mxfp4(&m, act, range.clone(), &mut out[..range.len()])
                                    .expect("checked shapes");
                            }
                        })
                    };
                if tier != Tier::Scalar {
                    // The compute ceiling: a 512-row slice (~1 MB) stays in each core's L2.
                    let slice = 512 * bytes / rows;
                    report(
                        "mxfp4_gemv",
                        shape,
                        "in-L2 (512 rows)",
                        tier,
                        L2_REPEATS * slice,
                        &mut || run(&pool, 0, L2_REPEATS, 0, 512),
                    );
                    report(
                        "mxfp4_gemv",
                        shape,
                        "in-cache (one matrix, L3)",
                        tier,
                        BATCH * bytes,
                        &mut || run(&pool, 0, BATCH, 0, rows),
                    );
                }
                report(
                    "mxfp4_gemv",
                    shape,
                    "out-of-cache",
                    tier,
                    BATCH * bytes,
                    &mut || {
                        run(&pool, next, BATCH, 1, rows);
                        next += BATCH;
                    },
                );
            }

            // Fused expert FFN: experts split across workers, as a decode step's 16 experts are.
            let scratch: Vec<Mutex<(ExpertScratch, Vec<f32>)>> = (0..n_threads)
                .map(|_| Mutex::new((ExpertScratch::default(), vec![0.0; EXPERT_LATENT])))
                .collect();
            let expert_bytes = ring[0].bytes();
            let per_call = BATCH.max(n_threads) / n_threads * n_threads;
            let mut next = 0usize;
            let ffn = |first: usize, stride_ring: bool| {
                pool.broadcast(|w| {
                    let mut guard = scratch[w].lock().expect("no poisoning in benches");
                    let (s, out) = &mut *guard;
                    for i in (w..per_call).step_by(n_threads) {
                        let e = if stride_ring { (first + i) % RING } else { 0 };
                        views[e].run(k, &za, s, out);
                    }
                })
            };
            if tier != Tier::Scalar {
                report(
                    "mxfp4_expert_ffn",
                    "3x_3072x3584",
                    "in-cache (one expert, L3)",
                    tier,
                    per_call * expert_bytes,
                    &mut || ffn(0, false),
                );
            }
            report(
                "mxfp4_expert_ffn",
                "3x_3072x3584",
                "out-of-cache",
                tier,
                per_call * expert_bytes,
                &mut || {
                    ffn(next, true);
                    next += per_call;
                },
            );

            // BF16 GEMV: KDA projection and lm_head slice (each alone is 5-7x the L3).
            for (shape, bytes, rows) in [
                ("kda_12288x7168", &kda, KDA_ROWS),
                ("lm_head_16384x7168", &head, LM_HEAD_SLICE_ROWS),
            ] {
                let m = bf16_view(bytes, rows, HIDDEN);
                let outs: Vec<Mutex<Vec<f32>>> = (0..n_threads)
                    .map(|_| Mutex::new(vec![0.0; rows]))
                    .collect();
                report(
                    "bf16_gemv",
                    shape,
                    "out-of-cache",
                    tier,
                    m.weight_bytes(),
                    &mut || {
                        pool.broadcast(|w| {
                            let range = split_rows(rows, n_threads, w);
                            let mut out = outs[w].lock().expect("no poisoning in benches");
                            k.matmul_bf16(&m, &xa, range.clone(), &mut out[..range.len()])
                                .expect("checked shapes");
                        })
                    },
                );
            }
            if tier != Tier::Scalar && n_threads == 1 {
                let small = bf16_view(&kda[..1024 * HIDDEN * 2], 1024, HIDDEN);
                let out = Mutex::new(vec![0.0; 1024]);
                report(
                    "bf16_gemv",
                    "kda_slice_1024x7168",
                    "in-cache (14.7 MB, L3)",
                    tier,
                    BATCH * small.weight_bytes(),
                    &mut || {
                        pool.broadcast(|_| {
                            let mut out = out.lock().expect("no poisoning in benches");
                            for _ in 0..BATCH {
                                k.matmul_bf16(&small, &xa, 0..1024, &mut out)
                                    .expect("checked shapes");
                            }
                        })
                    },
                );
                // Small-batch GEMM: 16 tokens share each decoded weight group.
                let t16 = k.prepare(&tokens16, EXPERT_LATENT)?;
                let out = Mutex::new(vec![0.0; 16 * EXPERT_INTER]);
                let mut next = 0usize;
                report(
                    "mxfp4_gemm16",
                    "gate_3072x3584",
                    "out-of-cache",
                    tier,
                    ring[0].gate.bytes(),
                    &mut || {
                        let m = views[next % RING].gate;
                        pool.broadcast(|_| {
                            let mut out = out.lock().expect("no poisoning in benches");
                            k.matmul_mxfp4(&m, &t16, 0..EXPERT_INTER, &mut out)
                                .expect("checked shapes");
                        });
                        next += 1;
                    },
                );
            }
        }
    }
    Ok(())
}

/// Medians of `trials` alternating measurements: (kernel bytes/s, read-probe bytes/s).
fn alternate(
    trials: usize,
    bytes: usize,
    work: &mut dyn FnMut(),
    pool: &Pool,
    probe: &[u8],
) -> (f64, f64) {
    let min_time = Duration::from_millis(250);
    let mut kernel = Vec::new();
    let mut read = Vec::new();
    work(); // warm-up: page faults, frequency
    for _ in 0..trials {
        kernel.push(rate(bytes, min_time, work));
        let mut sink = 0u64;
        read.push(rate(probe.len(), min_time, &mut || {
            sink = sink.wrapping_add(read_all(pool, probe))
        }));
        std::hint::black_box(sink);
    }
    (median(&mut kernel), median(&mut read))
}

fn rate(bytes: usize, min_time: Duration, work: &mut dyn FnMut()) -> f64 {
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < min_time {
        work();
        calls += 1;
    }
    (bytes as f64 * calls as f64) / start.elapsed().as_secs_f64()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn parse_list(list: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|v| Ok(v.trim().parse::<usize>()?))
        .collect()
}

/// Before timing anything, each kernel is checked once against the scalar oracle.
fn sanity(
    k: &Kernels,
    expert: &Expert,
    z: &mxfp4_kernels::Activations,
    x: &mxfp4_kernels::Activations,
    kda: &[u8],
) -> Result<()> {
    let scalar = Kernels::scalar();
    let rows = 0..64;
    let mut got = vec![0.0; 64];
    let mut want = vec![0.0; 64];
    k.matmul_mxfp4(&expert.gate.view(), z, rows.clone(), &mut got)?;
    scalar.matmul_mxfp4(
        &expert.gate.view(),
        &scalar.prepare(z.token(0), z.cols())?,
        rows.clone(),
        &mut want,
    )?;
    check_against_scalar(k.tier().is_exact(), &got, &want);
    let m = bf16_view(kda, KDA_ROWS, HIDDEN);
    k.matmul_bf16(&m, x, rows.clone(), &mut got)?;
    scalar.matmul_bf16(&m, &scalar.prepare(x.token(0), x.cols())?, rows, &mut want)?;
    check_against_scalar(k.tier().is_exact(), &got, &want);
    Ok(())
}
