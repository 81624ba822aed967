//! The benchmark cases on K3 shapes, defined once for both harnesses: each case is a closure
//! that reads a known number of weight bytes, split across a pinned pool as a caller would.

use std::sync::Mutex;

use mxfp4_kernels::{Activations, ExpertScratch, Kernels, PackedBf16, Tier, WeightMatrix};

use crate::{
    EXPERT_INTER, EXPERT_LATENT, Expert, ExpertViews, HIDDEN, HIDDEN_040B, HugeBuf, KDA_ROWS,
    LM_HEAD_040B_ROWS, LM_HEAD_SLICE_ROWS, Pool, activations, bandwidth_buffer, bf16_bytes,
    bf16_view, check_against_scalar, experts, q8_0_bytes, q8_0_view, read_all, split_rows,
};

/// Experts in the out-of-cache ring: 40 x 17.5 MB = 702 MB, 22x the 32 MiB L3.
pub const RING: usize = 40;
/// Matrices per timed call: waking the pool's workers costs tens of microseconds in this VM,
/// so each call carries milliseconds of work (a decode step's 16 experts do, too).
pub const BATCH: usize = 16;
/// Calls on the L2-resident slice per timed call.
pub const L2_REPEATS: usize = 64;
/// Rows of the L2-resident slice (~1 MB of MXFP4).
pub const L2_ROWS: usize = 512;

/// All weights and inputs the cases read, generated once (~1.2 GB with the read probe).
#[derive(Debug)]
pub struct Workloads {
    /// The out-of-cache ring of experts ([`RING`]), leaked for the program's life.
    pub ring: &'static [Expert],
    /// The ring's validated views, in ring order.
    pub views: Vec<ExpertViews<'static>>,
    /// A KDA projection `[12288, 7168]` in BF16.
    pub kda: HugeBuf,
    /// The lm_head slice `[16384, 7168]` in BF16.
    pub head: HugeBuf,
    /// The k3-0.40b lm_head (163840 x 1024): short 2 KB rows, the case where a GEMV's row
    /// streams are too short for the prefetchers.
    pub head_040b: HugeBuf,
    /// `kda` and `head` packed (`mxfp4_kernels::packed`): the same values in 12.25 bits each.
    pub kda_packed: PackedBf16,
    /// `head` packed.
    pub head_packed: PackedBf16,
    /// The first 1024 rows of `kda` packed (5.3 MB, inside the L3): the packed GEMV's compute
    /// ceiling, as `kda_slice_1024x7168` is the BF16 GEMV's.
    pub kda_packed_slice: PackedBf16,
    /// `kda`, `head` and `head_040b` quantised to Q8_0 (`quantize_q8_0`): 8.5 bits per weight.
    pub kda_q8_0: HugeBuf,
    /// `head` in Q8_0.
    pub head_q8_0: HugeBuf,
    /// `head_040b` in Q8_0.
    pub head_040b_q8_0: HugeBuf,
    /// 1 GiB for the STREAM-like read probe.
    pub probe: HugeBuf,
    /// An expert input (latent width).
    pub z: Vec<f32>,
    /// An expert's intermediate activations.
    pub h: Vec<f32>,
    /// A hidden-size input.
    pub x: Vec<f32>,
    /// A k3-0.40b hidden-size input.
    pub x_040b: Vec<f32>,
    /// Sixteen latent-width inputs (a batch of tokens).
    pub tokens16: Vec<f32>,
    /// Eight hidden-width inputs (a verify pass, or a few sequences' step, over the trunk).
    pub tokens8_hidden: Vec<f32>,
}

impl Workloads {
    /// Generates every workload from fixed seeds.
    pub fn generate() -> Self {
        let ring: &'static [Expert] = Vec::leak(experts(RING, 42));
        let kda = bf16_bytes(KDA_ROWS, HIDDEN, 7);
        let head = bf16_bytes(LM_HEAD_SLICE_ROWS, HIDDEN, 8);
        let head_040b = bf16_bytes(LM_HEAD_040B_ROWS, HIDDEN_040B, 9);
        let pack = |b: &[u8], rows| PackedBf16::pack(b, rows, HIDDEN).expect("whole blocks");
        Self {
            kda_q8_0: q8_0_bytes(&kda),
            head_q8_0: q8_0_bytes(&head),
            head_040b_q8_0: q8_0_bytes(&head_040b),
            kda_packed: pack(&kda, KDA_ROWS),
            head_packed: pack(&head, LM_HEAD_SLICE_ROWS),
            kda_packed_slice: pack(&kda[..1024 * HIDDEN * 2], 1024),
            ring,
            views: ring.iter().map(Expert::views).collect(),
            kda,
            head,
            head_040b,
            probe: bandwidth_buffer(1 << 30),
            z: activations(EXPERT_LATENT, 3),
            h: activations(EXPERT_INTER, 4),
            x: activations(HIDDEN, 5),
            x_040b: activations(HIDDEN_040B, 10),
            tokens16: activations(16 * EXPERT_LATENT, 6),
            tokens8_hidden: activations(8 * HIDDEN, 11),
        }
    }
}

/// Where a case's weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// A ~1 MB slice re-read: the compute ceiling.
    L2,
    /// One matrix or expert re-read (fits the L3).
    L3,
    /// Distinct matrices cycled from a ring 22x the L3: every byte comes from DRAM.
    OutOfCache,
}

impl Cache {
    /// The name benchmark ids use.
    pub fn label(self) -> &'static str {
        match self {
            Cache::L2 => "in-L2",
            Cache::L3 => "in-cache",
            Cache::OutOfCache => "out-of-cache",
        }
    }
}

/// One benchmark: `run` reads `bytes` bytes of weights per call.
pub struct Case<'a> {
    /// The operation (`gemv`, `expert_ffn`, ...).
    pub op: &'static str,
    /// The weight shape, as a label.
    pub shape: &'static str,
    /// Where the weights come from.
    pub cache: Cache,
    /// Pool workers the case splits over.
    pub threads: usize,
    /// The kernel tier's name (`sum` for the read probe).
    pub variant: &'static str,
    /// Weight bytes read per call of `run`.
    pub bytes: usize,
    /// Weights multiplied per call of `run` (0 for the read probe): formats of different bits
    /// per weight compare by weights per second.
    pub weights: usize,
    /// One timed call.
    pub run: Box<dyn FnMut() + 'a>,
}

impl std::fmt::Debug for Case<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id())
    }
}

impl Case<'_> {
    /// `{op}/{shape}.{cache}.t{threads}/{tier}`, the criterion id.
    pub fn id(&self) -> String {
        format!("{}/{}/{}", self.op, self.function(), self.variant)
    }
    /// The middle part of the id.
    pub fn function(&self) -> String {
        format!("{}.{}.t{}", self.shape, self.cache.label(), self.threads)
    }
}

/// The STREAM-like read of the 1 GiB probe buffer with the pool's threads.
pub fn read_case<'a>(w: &'a Workloads, pool: &'a Pool) -> Case<'a> {
    let mut sink = 0u64;
    Case {
        op: "read_bw",
        shape: "1GiB",
        cache: Cache::OutOfCache,
        threads: pool.threads(),
        variant: "sum",
        bytes: w.probe.len(),
        weights: 0,
        run: Box::new(move || {
            sink = std::hint::black_box(sink.wrapping_add(read_all(pool, &w.probe)))
        }),
    }
}

/// Every case for one tier on `pool`'s threads. Each kernel is checked against the scalar
/// oracle once first (panics on disagreement). The scalar tier gets only its out-of-cache
/// single-thread cases: it is the oracle, ~20x slower, measured for reference.
pub fn cases<'a>(w: &'a Workloads, pool: &'a Pool, k: Kernels) -> Vec<Case<'a>> {
    let tier = k.tier();
    let variant = tier.name();
    let threads = pool.threads();
    if tier == Tier::Scalar && threads > 1 {
        return Vec::new();
    }
    let fast = tier != Tier::Scalar;
    let prepare = |v: &[f32], cols| k.prepare(v, cols).expect("valid activations");
    let za: &'a Activations = Box::leak(Box::new(prepare(&w.z, EXPERT_LATENT)));
    let ha: &'a Activations = Box::leak(Box::new(prepare(&w.h, EXPERT_INTER)));
    let xa: &'a Activations = Box::leak(Box::new(prepare(&w.x, HIDDEN)));
    let xa_040b: &'a Activations = Box::leak(Box::new(prepare(&w.x_040b, HIDDEN_040B)));
    sanity(k, w, za, xa);
    let mut out = Vec::new();

    // The gate shape's GEMM of 3 tokens (a verify pass's routed expert: 2-3 of its tokens pick
    // the same expert): what the weights' bytes cost when each block's decode serves several
    // tokens. Out of cache only.
    let t3: &'a Activations = Box::leak(Box::new(prepare(
        &w.tokens16[..3 * EXPERT_LATENT],
        EXPERT_LATENT,
    )));
    // MXFP4 GEMV on the gate/up shape and the down shape, and that GEMM; rows split across
    // the pool.
    for (op, shape, is_gate, act, rows) in [
        ("mxfp4_gemv", "gate_3072x3584", true, za, EXPERT_INTER),
        ("mxfp4_gemv", "down_3584x3072", false, ha, EXPERT_LATENT),
        ("mxfp4_gemm3", "gate_3072x3584", true, t3, EXPERT_INTER),
    ] {
        let pick = move |e: &ExpertViews<'static>| if is_gate { e.gate } else { e.down };
        let bytes = pick(&w.views[0]).weight_bytes();
        let tokens = act.tokens();
        let gemv = move |first: usize, count: usize, step: usize, rows_used: usize| {
            let outs: Vec<Mutex<Vec<f32>>> = (0..threads)
                .map(|_| Mutex::new(vec![0.0; tokens * rows]))
                .collect();
            let mut next = first;
            Box::new(move || {
                pool.broadcast(|worker| {
                    let range = split_rows(rows_used, threads, worker);
                    let mut y = outs[worker].lock().expect("no poisoning in benches");
                    for i in 0..count {
                        let m = pick(&w.views[(next + i * step) % RING]);
                        let y = &mut y[..tokens * range.len()];
                        k.matmul_mxfp4(&m, act, range.clone(), y)
                            .expect("checked shapes");
                    }
                });
                next += count * step;
            }) as Box<dyn FnMut() + 'a>
        };
        let case = |cache, bytes, run| Case {
            op,
            shape,
            cache,
            threads,
            variant,
            bytes,
            weights: bytes * 32 / 17,
            run,
        };
        if fast && tokens == 1 {
            out.push(case(
                Cache::L2,
                L2_REPEATS * L2_ROWS * bytes / rows,
                gemv(0, L2_REPEATS, 0, L2_ROWS),
            ));
            out.push(case(Cache::L3, BATCH * bytes, gemv(0, BATCH, 0, rows)));
        }
        out.push(case(
            Cache::OutOfCache,
            BATCH * bytes,
            gemv(0, BATCH, 1, rows),
        ));
    }

    // Fused expert FFN: experts split across workers, as a decode step's 16 experts are.
    let per_call = BATCH / threads * threads;
    let expert_bytes = w.ring[0].bytes();
    let ffn = move |step: usize| {
        let scratch: Vec<Mutex<(ExpertScratch, Vec<f32>)>> = (0..threads)
            .map(|_| Mutex::new((ExpertScratch::default(), vec![0.0; EXPERT_LATENT])))
            .collect();
        let mut next = 0usize;
        Box::new(move || {
            pool.broadcast(|worker| {
                let mut guard = scratch[worker].lock().expect("no poisoning in benches");
                let (s, y) = &mut *guard;
                for i in (worker..per_call).step_by(threads) {
                    w.views[(next + i * step) % RING].run(&k, za, s, y);
                }
            });
            next += per_call * step;
        }) as Box<dyn FnMut() + 'a>
    };
    let case = |cache, run| Case {
        op: "mxfp4_expert_ffn",
        shape: "3x_3072x3584",
        cache,
        threads,
        variant,
        bytes: per_call * expert_bytes,
        weights: per_call * expert_bytes * 32 / 17,
        run,
    };
    if fast {
        out.push(case(Cache::L3, ffn(0)));
    }
    out.push(case(Cache::OutOfCache, ffn(1)));

    // BF16 GEMV: KDA projection and lm_head slice (each alone is 5-7x the L3); then the first
    // two packed (bytes are the packed body's: what a pass reads); then all three in Q8_0
    // (bytes are the blocks', 34 per 32 weights).
    let bf16 = |bytes, rows, cols| WeightMatrix::from(bf16_view(bytes, rows, cols));
    let q8 = |bytes, rows, cols| WeightMatrix::from(q8_0_view(bytes, rows, cols));
    for (op, shape, m, xa) in [
        (
            "bf16_gemv",
            "kda_12288x7168",
            bf16(&w.kda, KDA_ROWS, HIDDEN),
            xa,
        ),
        (
            "bf16_gemv",
            "lm_head_16384x7168",
            bf16(&w.head, LM_HEAD_SLICE_ROWS, HIDDEN),
            xa,
        ),
        (
            "bf16_gemv",
            "lm_head_163840x1024",
            bf16(&w.head_040b, LM_HEAD_040B_ROWS, HIDDEN_040B),
            xa_040b,
        ),
        (
            "bf16_packed_gemv",
            "kda_12288x7168",
            w.kda_packed.view().into(),
            xa,
        ),
        (
            "bf16_packed_gemv",
            "lm_head_16384x7168",
            w.head_packed.view().into(),
            xa,
        ),
        (
            "q8_0_gemv",
            "kda_12288x7168",
            q8(&w.kda_q8_0, KDA_ROWS, HIDDEN),
            xa,
        ),
        (
            "q8_0_gemv",
            "lm_head_16384x7168",
            q8(&w.head_q8_0, LM_HEAD_SLICE_ROWS, HIDDEN),
            xa,
        ),
        (
            "q8_0_gemv",
            "lm_head_163840x1024",
            q8(&w.head_040b_q8_0, LM_HEAD_040B_ROWS, HIDDEN_040B),
            xa_040b,
        ),
    ] {
        let rows = m.rows();
        let outs: Vec<Mutex<Vec<f32>>> =
            (0..threads).map(|_| Mutex::new(vec![0.0; rows])).collect();
        out.push(Case {
            op,
            shape,
            cache: Cache::OutOfCache,
            threads,
            variant,
            bytes: m.weight_bytes(),
            weights: m.rows() * m.cols(),
            run: Box::new(move || {
                pool.broadcast(|worker| {
                    let range = split_rows(rows, threads, worker);
                    let mut y = outs[worker].lock().expect("no poisoning in benches");
                    k.matmul(&m, xa, range.clone(), &mut y[..range.len()])
                        .expect("checked shapes");
                })
            }),
        });
    }
    if fast && threads == 1 {
        // The first 1024 KDA rows (15 MB as BF16, 11 MB packed, 7.8 MB Q8_0) fit in the L3:
        // each GEMV's compute ceiling; then the packed trunk's GEMMs of 5 and 8 tokens on them
        // (a verify pass of 4 drafts; 8 sequences' step), the decode each block's words serve
        // several tokens with (weights per second; times the tokens for multiply-adds).
        let q8_slice = 1024 * HIDDEN / 32 * 34;
        let tokens = |n: usize| -> &'a Activations {
            Box::leak(Box::new(prepare(&w.tokens8_hidden[..n * HIDDEN], HIDDEN)))
        };
        let packed: WeightMatrix<'a> = w.kda_packed_slice.view().into();
        let small: [(&'static str, WeightMatrix<'a>, &'a Activations); 5] = [
            (
                "bf16_gemv",
                bf16_view(&w.kda[..1024 * HIDDEN * 2], 1024, HIDDEN).into(),
                xa,
            ),
            ("bf16_packed_gemv", packed, xa),
            ("q8_0_gemv", q8(&w.kda_q8_0[..q8_slice], 1024, HIDDEN), xa),
            ("bf16_packed_gemm5", packed, tokens(5)),
            ("bf16_packed_gemm8", packed, tokens(8)),
        ];
        for (op, m, act) in small {
            let y = Mutex::new(vec![0.0; act.tokens() * 1024]);
            out.push(Case {
                op,
                shape: "kda_slice_1024x7168",
                cache: Cache::L3,
                threads,
                variant,
                bytes: BATCH * m.weight_bytes(),
                weights: BATCH * m.rows() * m.cols(),
                run: Box::new(move || {
                    pool.broadcast(|_| {
                        let mut y = y.lock().expect("no poisoning in benches");
                        for _ in 0..BATCH {
                            k.matmul(&m, act, 0..1024, &mut y).expect("checked shapes");
                        }
                    })
                }),
            });
        }
        // Small-batch GEMM: 16 tokens share each decoded weight group.
        let t16: &'a Activations = Box::leak(Box::new(prepare(&w.tokens16, EXPERT_LATENT)));
        let y = Mutex::new(vec![0.0; 16 * EXPERT_INTER]);
        let mut next = 0usize;
        out.push(Case {
            op: "mxfp4_gemm16",
            shape: "gate_3072x3584",
            cache: Cache::OutOfCache,
            threads,
            variant,
            bytes: w.views[0].gate.weight_bytes(),
            weights: EXPERT_INTER * EXPERT_LATENT,
            run: Box::new(move || {
                let m = w.views[next % RING].gate;
                pool.broadcast(|_| {
                    let mut y = y.lock().expect("no poisoning in benches");
                    k.matmul_mxfp4(&m, t16, 0..EXPERT_INTER, &mut y)
                        .expect("checked shapes");
                });
                next += 1;
            }),
        });
    }
    out
}

/// Checks the tier's MXFP4, BF16 and Q8_0 GEMVs against the scalar oracle on 64 rows.
fn sanity(k: Kernels, w: &Workloads, z: &Activations, x: &Activations) {
    let scalar = Kernels::scalar();
    let mut got = vec![0.0; 64];
    let mut want = vec![0.0; 64];
    let gate = w.views[0].gate;
    k.matmul_mxfp4(&gate, z, 0..64, &mut got)
        .expect("checked shapes");
    scalar
        .matmul_mxfp4(
            &gate,
            &scalar.prepare(z.token(0), z.cols()).expect("valid"),
            0..64,
            &mut want,
        )
        .expect("checked");
    check_against_scalar(k.tier().is_exact(), &got, &want);
    let m = bf16_view(&w.kda, KDA_ROWS, HIDDEN);
    k.matmul_bf16(&m, x, 0..64, &mut got)
        .expect("checked shapes");
    scalar
        .matmul_bf16(
            &m,
            &scalar.prepare(x.token(0), x.cols()).expect("valid"),
            0..64,
            &mut want,
        )
        .expect("checked");
    check_against_scalar(k.tier().is_exact(), &got, &want);
    // Q8_0 runs on f32 activations in every tier: held to the exact tiers' tolerance.
    let q8 = q8_0_view(&w.kda_q8_0, KDA_ROWS, HIDDEN);
    k.matmul_q8_0(&q8, x, 0..64, &mut got)
        .expect("checked shapes");
    scalar
        .matmul_q8_0(
            &q8,
            &scalar.prepare(x.token(0), x.cols()).expect("valid"),
            0..64,
            &mut want,
        )
        .expect("checked");
    check_against_scalar(true, &got, &want);
}

/// Deviation of a tier from scalar on `rows` rows of the expert gate GEMV and the KDA BF16
/// GEMV: (max, mean) over rows of `|y - y_scalar| / Σ_c |w·x|`.
pub fn tier_error(w: &Workloads, k: Kernels, rows: usize) -> [(f64, f64); 2] {
    let scalar = Kernels::scalar();
    let gate = w.views[0].gate;
    let kda = bf16_view(&w.kda, KDA_ROWS, HIDDEN);
    let mut dense = vec![0.0f32; rows * HIDDEN.max(EXPERT_LATENT)];
    let mut result = [(0.0, 0.0); 2];
    for (slot, (cols, input)) in [(EXPERT_LATENT, &w.z), (HIDDEN, &w.x)]
        .into_iter()
        .enumerate()
    {
        let (mut got, mut want) = (vec![0.0; rows], vec![0.0; rows]);
        let act = k.prepare(input, cols).expect("valid");
        let sa = scalar.prepare(input, cols).expect("valid");
        let dense = &mut dense[..rows * cols];
        if slot == 0 {
            k.matmul_mxfp4(&gate, &act, 0..rows, &mut got)
                .expect("checked");
            scalar
                .matmul_mxfp4(&gate, &sa, 0..rows, &mut want)
                .expect("checked");
            scalar
                .dequant_mxfp4(&gate, 0..rows, dense)
                .expect("checked");
        } else {
            k.matmul_bf16(&kda, &act, 0..rows, &mut got)
                .expect("checked");
            scalar
                .matmul_bf16(&kda, &sa, 0..rows, &mut want)
                .expect("checked");
            scalar.dequant_bf16(&kda, 0..rows, dense).expect("checked");
        }
        let (mut max, mut sum) = (0.0f64, 0.0f64);
        for r in 0..rows {
            let abs: f64 = dense[r * cols..(r + 1) * cols]
                .iter()
                .zip(input.iter())
                .map(|(&a, &b)| f64::from(a * b).abs())
                .sum();
            let rel = (f64::from(got[r]) - f64::from(want[r])).abs() / abs;
            max = max.max(rel);
            sum += rel;
        }
        result[slot] = (max, sum / rows as f64);
    }
    result
}
