//! The K3 forward pass (K3_SPEC §6-§9), layer-major over a chunk of tokens (a decode step is a
//! chunk of one), its row blocks and expert tasks spread over a `numa_sched::Pool`:
//! embedding, per layer the AttnRes mixes, KDA or gated MLA, dense MLP or latent MoE, then the
//! output mix, final norm and lm_head. `Session` holds one sequence's state.
//!
//! Canonical choices (they define the engine's bits): MLA in the absorbed form with the cache
//! of the normed latent and the raw `k_pe`; routed experts summed in the router's order;
//! every reduction in index order (see [`crate::ops`]).
//!
//! Every linear weight is a [`WeightMatrix`] in the format the checkpoint stores it (BF16, F16,
//! F32 or MXFP4, [`Checkpoint::linear`]); the kernels dispatch on it once per call. An F32
//! weight holding BF16 values gives the BF16 weight's bits in the exact tiers.

use std::sync::Arc;

use expert_store::checkpoint::CheckpointError;
use expert_store::{Checkpoint, ExpertShape, ExpertStore, StoreError};
use mxfp4_kernels::{ExpertScratch, Kernels, MAX_TOKENS, MxFp4Matrix, Situ, WeightMatrix};
use numa_sched::Pool;

use crate::checkpoint::a_log;
use crate::config::{AttentionKind, FfnKind, K3Config};
use crate::ops::{
    attn_res_mix, conv_step, dot, kda_decays_in_place, kda_step, l2_norm, rms_norm, route, sigmoid,
    silu_in_place,
};
use crate::profile::{Bucket, Profile};

/// Errors of model construction and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Kernel(#[from] mxfp4_kernels::Error),
    #[error("worker pool: {0}")]
    Pool(String),
    #[error("token {token} is outside the vocabulary of {vocab}")]
    Token { token: usize, vocab: usize },
    /// An expert could not be read: this step fails (the session is then mid-step and must
    /// be reset); the model and other sessions carry on.
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the expert store's experts are {store:?}, the config's {config:?}")]
    StoreShape {
        store: ExpertShape,
        config: ExpertShape,
    },
}

type Result<T, E = ModelError> = std::result::Result<T, E>;

/// The prefill chunk callers should use: the most tokens one kernel call takes, so a prompt of
/// that many tokens reads each weight once and dispatches each layer's work once. Prefill of 64
/// tokens on k3-0.40b at 2 threads: 1430 tokens/s in chunks of 16, 1550 in 32, 1610-1640 in
/// 64 (PERFORMANCE.md, phase 7).
pub const PREFILL_CHUNK: usize = MAX_TOKENS;

/// Smallest matrix whose GEMV is split across the pool.
const PARALLEL_MIN_BYTES: usize = 128 << 10;

/// The MLA low-rank norms use 1e-6 (HF's default), not `rms_norm_eps` (K3_SPEC §7.1).
const MLA_NORM_EPS: f32 = 1e-6;

struct Kda<'a> {
    q: WeightMatrix<'a>,
    k: WeightMatrix<'a>,
    v: WeightMatrix<'a>,
    g: WeightMatrix<'a>,
    o: WeightMatrix<'a>,
    conv: [Vec<f32>; 3],
    f_a: WeightMatrix<'a>,
    f_b: WeightMatrix<'a>,
    b: WeightMatrix<'a>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
}

struct Mla<'a> {
    q_a: WeightMatrix<'a>,
    q_a_norm: Vec<f32>,
    q_b: WeightMatrix<'a>,
    kv_a: WeightMatrix<'a>,
    kv_a_norm: Vec<f32>,
    /// `kv_b_proj` widened to f32, `[heads * (nope + v), kv_lora_rank]` (read transposed).
    kv_b: Vec<f32>,
    g: Option<WeightMatrix<'a>>,
    o: WeightMatrix<'a>,
}

struct Mlp<'a> {
    gate: WeightMatrix<'a>,
    up: WeightMatrix<'a>,
    down: WeightMatrix<'a>,
}

struct Moe<'a> {
    router: WeightMatrix<'a>,
    bias: Vec<f32>,
    latent: Option<(WeightMatrix<'a>, Option<Vec<f32>>, WeightMatrix<'a>)>,
    shared: Option<Mlp<'a>>,
    /// The checkpoint's layer index (the expert store's key).
    layer: usize,
    /// Mapped from the checkpoint; empty when the experts come from an `ExpertStore`.
    experts: Vec<[MxFp4Matrix<'a>; 3]>,
}

// Built once per layer at load and matched per layer per step: boxing a variant buys nothing.
#[allow(clippy::large_enum_variant)]
enum Attention<'a> {
    Kda(Kda<'a>),
    Mla(Mla<'a>),
}

#[allow(clippy::large_enum_variant)] // as `Attention`
enum Ffn<'a> {
    Dense(Mlp<'a>),
    Moe(Moe<'a>),
}

struct Layer<'a> {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    /// `self_attention_res_norm ⊙ self_attention_res_proj`, folded once.
    attn_res_score: Vec<f32>,
    mlp_res_score: Vec<f32>,
    attention: Attention<'a>,
    ffn: Ffn<'a>,
}

/// A K3 model whose weights borrow from a mapped checkpoint.
pub struct Model<'a> {
    pub config: K3Config,
    kernels: Kernels,
    pool: Arc<Pool>,
    /// Work (bytes of weights) below which a dispatch runs on the calling thread.
    parallel_min_bytes: usize,
    situ: Situ,
    embed: WeightMatrix<'a>,
    lm_head: WeightMatrix<'a>,
    final_norm: Vec<f32>,
    output_res_score: Vec<f32>,
    layers: Vec<Layer<'a>>,
    /// Where routed experts come from when they are not mapped.
    store: Option<Arc<ExpertStore>>,
    expert_placement: ExpertPlacement,
    /// Wall time by bucket, when asked for ([`Model::with_profile`]).
    profile: Option<Arc<Profile>>,
}

/// Which tokens of a forward pass need logits (the lm_head is a large share of a step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Logits {
    All,
    /// Each sequence's last token (prefill).
    Last,
    /// None (prefill chunks before the last).
    None,
}

/// Where a routed expert's work runs when the pool has several domains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPlacement {
    /// Every expert's rows spread over all domains, like the trunk's (the default: each domain
    /// reads 1/D of every selected expert, so no domain waits on an unlucky draw; see
    /// `cargo xtask numa-model` and PERFORMANCE.md).
    #[default]
    Split,
    /// Each expert whole on its home domain (`ExpertStore::place`, else id modulo domains).
    Home,
}

/// The routed-expert shapes `config` implies (what an `ExpertStore` is opened with).
pub fn expert_shape(config: &K3Config) -> ExpertShape {
    ExpertShape {
        intermediate: config.moe.expert_intermediate,
        io: config.moe.expert_io(config.hidden_size),
    }
}

impl std::fmt::Debug for Model<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("layers", &self.layers.len())
            .field("tier", &self.kernels.tier())
            .finish()
    }
}

/// One sequence's state: KDA conv windows and recurrent states, the MLA latent cache.
#[derive(Debug, Clone)]
pub struct Session {
    position: usize,
    kda: Vec<Option<KdaState>>,
    mla: Vec<Option<MlaCache>>,
}

#[derive(Debug, Clone)]
struct KdaState {
    windows: [Vec<f32>; 3],
    state: Vec<f32>,
}

#[derive(Debug, Clone, Default)]
struct MlaCache {
    latent: Vec<f32>,
    k_pe: Vec<f32>,
}

impl Session {
    /// Tokens consumed so far.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Back to an empty sequence: KDA states and conv windows zeroed, MLA caches emptied (their
    /// memory kept for reuse).
    pub fn reset(&mut self) {
        self.position = 0;
        for state in self.kda.iter_mut().flatten() {
            state.state.fill(0.0);
            state.windows.iter_mut().for_each(|w| w.fill(0.0));
        }
        for cache in self.mla.iter_mut().flatten() {
            cache.latent.clear();
            cache.k_pe.clear();
        }
    }
}

impl<'a> Model<'a> {
    /// Builds the model over a checkpoint (validate it first with [`crate::checkpoint::validate`]),
    /// routed experts read through the file mapping.
    pub fn new(ckpt: &'a Checkpoint, config: &K3Config, kernels: Kernels) -> Result<Self> {
        Self::load(ckpt, config, kernels, None)
    }

    /// Builds the model with its routed experts served by `store` (opened over the same
    /// checkpoint with [`expert_shape`]); no expert byte is touched here. Logits are the same
    /// bits as [`Model::new`]'s, whatever the store's capacity, policy or preload.
    pub fn with_expert_store(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        store: Arc<ExpertStore>,
    ) -> Result<Self> {
        Self::load(ckpt, config, kernels, Some(store))
    }

    fn load(
        ckpt: &'a Checkpoint,
        config: &K3Config,
        kernels: Kernels,
        store: Option<Arc<ExpertStore>>,
    ) -> Result<Self> {
        let c = config;
        if let Some(store) = &store
            && store.shape() != expert_shape(c)
        {
            return Err(ModelError::StoreShape {
                store: store.shape(),
                config: expert_shape(c),
            });
        }
        let d = c.hidden_size;
        let vec = |name: &str, n: usize| ckpt.f32_values(name, &[n]);
        let row = |name: &str, n: usize| ckpt.f32_values(name, &[1, n]);
        let linear = |name: &str, rows: usize, cols: usize| ckpt.linear(name, rows, cols);
        let fold = |norm: Vec<f32>, proj: Vec<f32>| {
            norm.iter()
                .zip(&proj)
                .map(|(a, b)| a * b)
                .collect::<Vec<f32>>()
        };
        let mut layers = Vec::with_capacity(c.num_layers());
        for (i, spec) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let attention = match spec.attention {
                AttentionKind::Kda => {
                    let (h, k) = (c.kda.num_heads, c.kda.head_dim);
                    let w = c.kda_width();
                    let taps = c.kda.conv_kernel;
                    let conv = |name: &str| {
                        ckpt.f32_values(&format!("{p}self_attn.{name}.weight"), &[w, 1, taps])
                    };
                    Attention::Kda(Kda {
                        q: linear(&format!("{p}self_attn.q_proj.weight"), w, d)?,
                        k: linear(&format!("{p}self_attn.k_proj.weight"), w, d)?,
                        v: linear(&format!("{p}self_attn.v_proj.weight"), w, d)?,
                        g: linear(&format!("{p}self_attn.g_proj.weight"), w, d)?,
                        o: linear(&format!("{p}self_attn.o_proj.weight"), d, w)?,
                        conv: [conv("q_conv1d")?, conv("k_conv1d")?, conv("v_conv1d")?],
                        f_a: linear(&format!("{p}self_attn.f_a_proj.weight"), k, d)?,
                        f_b: linear(&format!("{p}self_attn.f_b_proj.weight"), w, k)?,
                        b: linear(&format!("{p}self_attn.b_proj.weight"), h, d)?,
                        a_log: a_log(ckpt, c, i)?,
                        dt_bias: vec(&format!("{p}self_attn.dt_bias"), w)?,
                        o_norm: vec(&format!("{p}self_attn.o_norm.weight"), k)?,
                    })
                }
                AttentionKind::Mla => {
                    let m = &c.mla;
                    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                    let kv_rows = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim);
                    let kv_b_view = linear(
                        &format!("{p}self_attn.kv_b_proj.weight"),
                        kv_rows,
                        m.kv_lora_rank,
                    )?;
                    let mut kv_b = vec![0.0; kv_rows * m.kv_lora_rank];
                    kernels.dequant(&kv_b_view, 0..kv_rows, &mut kv_b)?;
                    let v_width = m.num_heads * m.v_head_dim;
                    Attention::Mla(Mla {
                        q_a: linear(&format!("{p}self_attn.q_a_proj.weight"), m.q_lora_rank, d)?,
                        q_a_norm: vec(
                            &format!("{p}self_attn.q_a_layernorm.weight"),
                            m.q_lora_rank,
                        )?,
                        q_b: linear(
                            &format!("{p}self_attn.q_b_proj.weight"),
                            m.num_heads * qk,
                            m.q_lora_rank,
                        )?,
                        kv_a: linear(
                            &format!("{p}self_attn.kv_a_proj_with_mqa.weight"),
                            m.kv_lora_rank + m.qk_rope_head_dim,
                            d,
                        )?,
                        kv_a_norm: vec(
                            &format!("{p}self_attn.kv_a_layernorm.weight"),
                            m.kv_lora_rank,
                        )?,
                        kv_b,
                        g: if m.output_gate {
                            Some(linear(&format!("{p}self_attn.g_proj.weight"), v_width, d)?)
                        } else {
                            None
                        },
                        o: linear(&format!("{p}self_attn.o_proj.weight"), d, v_width)?,
                    })
                }
            };
            let mlp = |prefix: &str, width: usize| -> Result<Mlp<'a>> {
                Ok(Mlp {
                    gate: linear(&format!("{prefix}gate_proj.weight"), width, d)?,
                    up: linear(&format!("{prefix}up_proj.weight"), width, d)?,
                    down: linear(&format!("{prefix}down_proj.weight"), d, width)?,
                })
            };
            let ffn = match spec.ffn {
                FfnKind::Dense => Ffn::Dense(mlp(&format!("{p}mlp."), c.dense_intermediate)?),
                FfnKind::Moe => {
                    let moe = &c.moe;
                    let q = format!("{p}block_sparse_moe.");
                    let io = moe.expert_io(d);
                    let inter = moe.expert_intermediate;
                    let latent = match moe.latent {
                        None => None,
                        Some(l) => Some((
                            linear(&format!("{q}routed_expert_down_proj.weight"), l.hidden, d)?,
                            if l.use_norm {
                                Some(vec(&format!("{q}routed_expert_norm.weight"), l.hidden)?)
                            } else {
                                None
                            },
                            linear(&format!("{q}routed_expert_up_proj.weight"), d, l.hidden)?,
                        )),
                    };
                    let shared = match moe.shared_intermediate() {
                        0 => None,
                        width => Some(mlp(&format!("{q}shared_experts."), width)?),
                    };
                    let mapped = if store.is_some() { 0 } else { moe.num_experts };
                    let experts = (0..mapped)
                        .map(|e| {
                            let base = format!("{q}experts.{e}.");
                            Ok([
                                ckpt.mxfp4_matrix(&format!("{base}w1"), inter, io)?,
                                ckpt.mxfp4_matrix(&format!("{base}w3"), inter, io)?,
                                ckpt.mxfp4_matrix(&format!("{base}w2"), io, inter)?,
                            ])
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ffn::Moe(Moe {
                        router: linear(&format!("{q}gate.weight"), moe.num_experts, d)?,
                        bias: vec(&format!("{q}gate.e_score_correction_bias"), moe.num_experts)?,
                        latent,
                        shared,
                        layer: i,
                        experts,
                    })
                }
            };
            layers.push(Layer {
                input_norm: vec(&format!("{p}input_layernorm.weight"), d)?,
                post_norm: vec(&format!("{p}post_attention_layernorm.weight"), d)?,
                attn_res_score: fold(
                    vec(&format!("{p}self_attention_res_norm.weight"), d)?,
                    row(&format!("{p}self_attention_res_proj.weight"), d)?,
                ),
                mlp_res_score: fold(
                    vec(&format!("{p}mlp_res_norm.weight"), d)?,
                    row(&format!("{p}mlp_res_proj.weight"), d)?,
                ),
                attention,
                ffn,
            });
        }
        Ok(Self {
            config: c.clone(),
            kernels,
            pool: Arc::new(Pool::new(1).map_err(|e| ModelError::Pool(e.to_string()))?),
            parallel_min_bytes: PARALLEL_MIN_BYTES,
            situ: Situ {
                beta: c.situ.beta,
                linear_beta: c.situ.linear_beta,
            },
            embed: linear("model.embed_tokens.weight", c.vocab_size, d)?,
            lm_head: linear("lm_head.weight", c.vocab_size, d)?,
            final_norm: vec("model.norm.weight", d)?,
            output_res_score: fold(
                vec("model.output_attn_res_norm.weight", d)?,
                row("model.output_attn_res_proj.weight", d)?,
            ),
            layers,
            store,
            expert_placement: ExpertPlacement::default(),
            profile: None,
        })
    }

    /// Runs the model's work on `pool` (row blocks of every projection, expert tasks).
    /// Logits are bit-identical for any pool size.
    pub fn with_pool(mut self, pool: Arc<Pool>) -> Self {
        self.pool = pool;
        self
    }

    /// How routed experts are spread over the pool's domains (results do not depend on it).
    pub fn with_expert_placement(mut self, placement: ExpertPlacement) -> Self {
        self.expert_placement = placement;
        self
    }

    /// Charges the wall time of every forward pass's phases to `profile`'s buckets (timing
    /// only: the logits are the same bits).
    pub fn with_profile(mut self, profile: Arc<Profile>) -> Self {
        self.profile = Some(profile);
        self
    }

    /// Runs `f`, charging its wall time to `bucket` when profiling.
    fn timed<T>(&self, bucket: Bucket, f: impl FnOnce() -> T) -> T {
        match &self.profile {
            Some(p) => p.time(bucket, f),
            None => f(),
        }
    }

    /// Sets the work size (bytes of weights) below which a dispatch stays on the calling
    /// thread (default 128 KiB). Results do not depend on it; tests set 0 to split everything.
    pub fn with_parallel_threshold(mut self, bytes: usize) -> Self {
        self.parallel_min_bytes = bytes;
        self
    }

    /// A fresh sequence.
    pub fn session(&self) -> Session {
        let c = &self.config;
        let taps = c.kda.conv_kernel;
        let width = c.kda_width();
        Session {
            position: 0,
            kda: c
                .layers
                .iter()
                .map(|l| {
                    (l.attention == AttentionKind::Kda).then(|| KdaState {
                        windows: std::array::from_fn(|_| vec![0.0; width * (taps - 1)]),
                        state: vec![0.0; c.kda.num_heads * c.kda.head_dim * c.kda.head_dim],
                    })
                })
                .collect(),
            mla: c
                .layers
                .iter()
                .map(|l| (l.attention == AttentionKind::Mla).then(MlaCache::default))
                .collect(),
        }
    }

    /// `m · x_t` for every token of `xs`, through the batch-invariant GEMM in blocks of
    /// `MAX_TOKENS`: each row is bit-identical to a one-token GEMV.
    fn gemm(&self, m: &WeightMatrix<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .gemm_many(&[m], xs)?
            .pop()
            .expect("one matrix in, one result out"))
    }

    /// `task(0..tasks)` on the pool, task `i` on domain `domain_of(i)`, or all on this thread
    /// when `parallel` is false (work too small to be worth waking workers for); results in
    /// task order either way.
    fn run_tasks<T: Send>(
        &self,
        parallel: bool,
        tasks: usize,
        domain_of: impl Fn(usize) -> usize,
        task: impl Fn(usize) -> T + Sync + Send,
    ) -> Result<Vec<T>> {
        if parallel {
            self.pool
                .map_on(tasks, domain_of, task)
                .map_err(|e| ModelError::Pool(e.to_string()))
        } else {
            Ok((0..tasks).map(task).collect())
        }
    }

    /// The domain that runs routed expert `expert` of checkpoint layer `layer`: its home in
    /// the expert store when the store was placed on this pool's domains, else round-robin.
    fn expert_domain(&self, layer: usize, expert: usize) -> usize {
        let domains = self.pool.domains();
        match &self.store {
            Some(store) => store.home(layer, expert) % domains,
            None => expert % domains,
        }
    }

    /// `m · x_t` for several matrices that read the same inputs, as one list of tasks (one
    /// pool dispatch), each matrix's result `[token][row]`. Row blocks are tasks: every output
    /// row is computed by one task with the same arithmetic as a whole-matrix call, so the
    /// thread count cannot change a bit. Work under `PARALLEL_MIN_BYTES` runs on the calling
    /// thread: waking the pool costs more than it takes.
    fn gemm_many(&self, ms: &[&WeightMatrix<'_>], xs: &[Vec<f32>]) -> Result<Vec<Vec<Vec<f32>>>> {
        let cols = ms[0].cols();
        let total: usize = ms.iter().map(|m| m.weight_bytes()).sum();
        let threads = if total < self.parallel_min_bytes {
            1
        } else {
            self.pool.threads()
        };
        // Each matrix's rows split into blocks, the blocks spread over the domains in order:
        // each domain reads its own rows of every matrix.
        let domains = self.pool.domains();
        let tasks: Vec<(usize, std::ops::Range<usize>, usize)> = ms
            .iter()
            .enumerate()
            .flat_map(|(k, m)| {
                let blocks = row_tasks(m.rows(), threads.max(domains));
                let n = blocks.len();
                blocks
                    .into_iter()
                    .enumerate()
                    .map(move |(j, r)| (k, r, j * domains / n))
            })
            .collect();
        let mut out: Vec<Vec<Vec<f32>>> = ms.iter().map(|_| Vec::with_capacity(xs.len())).collect();
        for block in xs.chunks(MAX_TOKENS) {
            // The kernels run a block of more than 4 tokens in groups over cache-sized stretches
            // of rows (`by_tokens!`), so a block reads each weight from memory once.
            let flat: Vec<f32> = block.iter().flatten().copied().collect();
            let act = self.kernels.prepare(&flat, cols)?;
            let task = |i: usize| -> std::result::Result<Vec<f32>, mxfp4_kernels::Error> {
                let (k, range, _) = &tasks[i];
                let mut y = vec![0.0; range.len() * block.len()];
                self.kernels.matmul(ms[*k], &act, range.clone(), &mut y)?;
                Ok(y)
            };
            let parts = self.run_tasks(threads > 1, tasks.len(), |i| tasks[i].2, task)?;
            let mut ys: Vec<Vec<Vec<f32>>> = ms
                .iter()
                .map(|m| vec![vec![0.0; m.rows()]; block.len()])
                .collect();
            for ((k, range, _), part) in tasks.iter().zip(parts) {
                let part = part?;
                for (t, row) in ys[*k].iter_mut().enumerate() {
                    row[range.clone()]
                        .copy_from_slice(&part[t * range.len()..(t + 1) * range.len()]);
                }
            }
            for (o, y) in out.iter_mut().zip(ys) {
                o.extend(y);
            }
        }
        Ok(out)
    }

    /// Consumes `token` and returns the logits for the next position.
    pub fn decode_step(&self, session: &mut Session, token: usize) -> Result<Vec<f32>> {
        Ok(self
            .forward(session, &[token], Logits::All)?
            .pop()
            .expect("one token in, one row out"))
    }

    /// Consumes a prompt in chunks of `chunk` tokens and returns the logits after its last
    /// token (bit-identical to decoding it token by token).
    pub fn prefill(
        &self,
        session: &mut Session,
        tokens: &[usize],
        chunk: usize,
    ) -> Result<Vec<f32>> {
        // Only the final token's logits are wanted: earlier chunks skip the lm_head, the last
        // runs it for its last token alone (batch-invariant: the same bits as in a chunk).
        let parts: Vec<&[usize]> = tokens.chunks(chunk.max(1)).collect();
        let mut last = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let wanted = if i + 1 == parts.len() {
                Logits::Last
            } else {
                Logits::None
            };
            last = self
                .forward(session, part, wanted)?
                .pop()
                .unwrap_or_default();
        }
        Ok(last)
    }

    /// Teacher-forced scoring: consumes `tokens` in chunks of `chunk` (layer-major, each weight
    /// and expert read once per chunk) and returns the logits after every token. Bit-identical
    /// to calling [`Model::decode_step`] token by token, whatever the chunk size.
    pub fn score(
        &self,
        session: &mut Session,
        tokens: &[usize],
        chunk: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let mut logits = Vec::with_capacity(tokens.len());
        for part in tokens.chunks(chunk.max(1)) {
            logits.extend(self.forward(session, part, Logits::All)?);
        }
        Ok(logits)
    }

    /// Layer-major forward of a chunk of tokens: per-token state (conv windows, KDA states,
    /// the MLA cache, AttnRes banks) advances in token order; projections, MLPs and experts
    /// run as batch-invariant GEMMs over the chunk.
    /// One chunk through the whole model, run on one of the pool's workers so that every
    /// dispatch inside starts on that worker at once while the others join (from an outside
    /// thread, each dispatch would wake all workers and sleep): 6-8% faster on k3-0.40b with
    /// 2 threads, same bits (PERFORMANCE.md, phase 3).
    fn forward(
        &self,
        session: &mut Session,
        tokens: &[usize],
        wanted: Logits,
    ) -> Result<Vec<Vec<f32>>> {
        let mut groups = [(session, tokens)];
        Ok(self
            .pool
            .install(|| self.forward_on_worker(&mut groups, wanted))?
            .concat())
    }

    /// One decode step for several sequences at once: `steps[i]` feeds one token to its own
    /// session; returns each sequence's logits. Weights (projections of the MLPs and experts,
    /// lm_head) are read once for all of them through the batch-invariant GEMM, attention runs
    /// on each sequence's own state, so every sequence's logits are bit-identical to its
    /// [`Model::decode_step`] alone, whoever shares the step.
    pub fn decode_batch(&self, steps: &mut [(&mut Session, usize)]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<[usize; 1]> = steps.iter().map(|(_, t)| [*t]).collect();
        let mut groups: Vec<(&mut Session, &[usize])> = steps
            .iter_mut()
            .zip(&tokens)
            .map(|((session, _), token)| (&mut **session, &token[..]))
            .collect();
        Ok(self
            .pool
            .install(|| self.forward_on_worker(&mut groups, Logits::All))?
            .into_iter()
            .map(|mut rows| rows.pop().expect("one token in, one row out"))
            .collect())
    }

    /// Layer-major forward of several sequences' chunks (`groups[g]`: a session and the tokens
    /// it consumes): per-token state advances in each sequence's token order, weights are read
    /// once for all tokens. Returns each group's logits, one row per token.
    fn forward_on_worker(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        wanted: Logits,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let c = &self.config;
        let d = c.hidden_size;
        let eps = c.rms_norm_eps;
        let tokens: Vec<usize> = groups.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let mut spans = Vec::with_capacity(groups.len());
        let mut at = 0;
        for (_, t) in groups.iter() {
            spans.push(at..at + t.len());
            at += t.len();
        }
        let tokens = &tokens[..];
        let mut h: Vec<Vec<f32>> = Vec::with_capacity(tokens.len());
        for &token in tokens {
            if token >= c.vocab_size {
                return Err(ModelError::Token {
                    token,
                    vocab: c.vocab_size,
                });
            }
            let mut row = vec![0.0; d];
            self.kernels
                .dequant(&self.embed, token..token + 1, &mut row)?;
            h.push(row);
        }
        let mut banks: Vec<Vec<Vec<f32>>> = vec![Vec::new(); tokens.len()];
        let norm = |x: &[f32], w: &[f32]| {
            let mut y = vec![0.0; x.len()];
            rms_norm(x, Some(w), eps, &mut y);
            y
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let restart = c.layers[i].attn_res_snapshot;
            let mut raw = Vec::with_capacity(tokens.len());
            let mut normed = Vec::with_capacity(tokens.len());
            wide(
                &self.kernels,
                #[inline(always)]
                || {
                    for (t, bank) in banks.iter_mut().enumerate() {
                        // (a) attention-side mix over [bank..., h] (skipped while the bank is
                        // empty); (b) at a block boundary, bank the RAW layer input and
                        // restart the stream.
                        let input = std::mem::take(&mut h[t]);
                        let mut mixed = input.clone();
                        if !bank.is_empty() {
                            mix(bank, &input, &layer.attn_res_score, eps, &mut mixed);
                        }
                        if restart {
                            bank.push(input.clone());
                        }
                        normed.push(norm(&mixed, &layer.input_norm));
                        raw.push(input);
                    }
                },
            );
            // Projections once for all tokens; attention on each sequence's own state.
            let attn = match &layer.attention {
                Attention::Kda(kda) => {
                    let states = groups
                        .iter_mut()
                        .zip(&spans)
                        .map(|((session, _), span)| {
                            (session.kda[i].as_mut().expect("KDA state"), span.clone())
                        })
                        .collect();
                    self.timed(Bucket::Kda, || self.kda(kda, states, &normed))?
                }
                Attention::Mla(mla) => {
                    let caches = groups
                        .iter_mut()
                        .zip(&spans)
                        .map(|((session, _), span)| {
                            (session.mla[i].as_mut().expect("MLA cache"), span.clone())
                        })
                        .collect();
                    self.timed(Bucket::Mla, || self.mla(mla, caches, &normed))?
                }
            };
            let mut prefix = Vec::with_capacity(tokens.len());
            let mut post = Vec::with_capacity(tokens.len());
            wide(
                &self.kernels,
                #[inline(always)]
                || {
                    for (t, a) in attn.into_iter().enumerate() {
                        let p: Vec<f32> = if restart {
                            a
                        } else {
                            raw[t].iter().zip(&a).map(|(x, y)| x + y).collect()
                        };
                        // (c) mlp-side mix over [bank..., prefix] (never empty here).
                        let mut m = vec![0.0; d];
                        mix(&banks[t], &p, &layer.mlp_res_score, eps, &mut m);
                        post.push(norm(&m, &layer.post_norm));
                        prefix.push(p);
                    }
                },
            );
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => self.timed(Bucket::DenseMlp, || self.mlp(mlp, &post))?,
                Ffn::Moe(moe) => self.moe(moe, &post)?,
            };
            h = prefix
                .into_iter()
                .zip(f)
                .map(|(p, f)| p.iter().zip(&f).map(|(a, b)| a + b).collect())
                .collect();
        }
        // The tokens whose logits are wanted: all, each group's last, or none.
        let rows: Vec<usize> = match wanted {
            Logits::All => (0..tokens.len()).collect(),
            Logits::Last => spans.iter().filter_map(|s| s.end.checked_sub(1)).collect(),
            Logits::None => Vec::new(),
        };
        let mut finals = Vec::with_capacity(rows.len());
        for &t in &rows {
            let mut out = vec![0.0; d];
            mix(&banks[t], &h[t], &self.output_res_score, eps, &mut out);
            finals.push(norm(&out, &self.final_norm));
        }
        let mut logits = if finals.is_empty() {
            Vec::new().into_iter()
        } else {
            self.timed(Bucket::LmHead, || self.gemm(&self.lm_head, &finals))?
                .into_iter()
        };
        Ok(groups
            .iter_mut()
            .zip(&spans)
            .map(|((session, t), span)| {
                session.position += t.len();
                let here = rows.iter().filter(|&&r| span.contains(&r)).count();
                logits.by_ref().take(here).collect()
            })
            .collect())
    }

    #[allow(clippy::needless_range_loop)] // `head` indexes several per-head arrays
    /// KDA over the tokens of several sequences: `states[i]` is a sequence's state and the
    /// span of `xs` that is its tokens (in order). Projections read their weights once for
    /// all tokens; each sequence's recurrence runs on its own state.
    fn kda(
        &self,
        w: &Kda<'_>,
        states: Vec<(&mut KdaState, std::ops::Range<usize>)>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (heads, dim, taps) = (c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel);
        // One dispatch for the six projections of the normed input.
        let [q, k, v, gates, f_a, beta_logits]: [Vec<Vec<f32>>; 6] = self
            .gemm_many(&[&w.q, &w.k, &w.v, &w.g, &w.f_a, &w.b], xs)?
            .try_into()
            .expect("six matrices in, six results out");
        let projections = [q, k, v];
        let f = self.gemm(&w.f_b, &f_a)?;
        let scale = (dim as f32).powf(-0.5);
        let mut ys = Vec::with_capacity(xs.len());
        for (s, span) in states {
            // Head groups as tasks: each owns its heads' conv windows and states and runs the
            // chunk's tokens in order; heads are independent, so grouping cannot change a bit.
            let state_bytes = heads * dim * dim * 4 * span.len();
            let groups = if state_bytes < self.parallel_min_bytes {
                1
            } else {
                self.pool.threads().min(heads)
            };
            let per = heads.div_ceil(groups);
            let hist = taps - 1;
            let [wq, wk, wv] = &mut s.windows;
            let owned: Vec<std::sync::Mutex<[&mut [f32]; 4]>> = wq
                .chunks_mut(per * dim * hist)
                .zip(wk.chunks_mut(per * dim * hist))
                .zip(wv.chunks_mut(per * dim * hist))
                .zip(s.state.chunks_mut(per * dim * dim))
                .map(|(((a, b), c), d)| std::sync::Mutex::new([a, b, c, d]))
                .collect();
            let group = |g: usize| -> Vec<Vec<f32>> {
                wide(
                    &self.kernels,
                    #[inline(always)]
                    || {
                        let mut guard = owned[g].lock().expect("each group is locked by one task");
                        let [wq, wk, wv, state] = &mut *guard;
                        let first = g * per;
                        let count = state.len() / (dim * dim);
                        let channels = first * dim..(first + count) * dim;
                        let mut o = vec![0.0; dim];
                        let mut ys = Vec::with_capacity(span.len());
                        for t in span.clone() {
                            // The conv windows and the recurrent state advance token by token.
                            let mut qkv: [Vec<f32>; 3] =
                                std::array::from_fn(|_| vec![0.0; count * dim]);
                            let windows: [&mut [f32]; 3] = [&mut **wq, &mut **wk, &mut **wv];
                            for (((out, proj), weights), window) in
                                qkv.iter_mut().zip(&projections).zip(&w.conv).zip(windows)
                            {
                                let taps_range = channels.start * taps..channels.end * taps;
                                conv_step(
                                    &proj[t][channels.clone()],
                                    &weights[taps_range],
                                    taps,
                                    window,
                                    out,
                                );
                            }
                            // The group's SiLUs, decays and output gates, 16 channels at a time.
                            for x in &mut qkv {
                                silu_in_place(&self.kernels, x);
                            }
                            let mut alpha: Vec<f32> = channels
                                .clone()
                                .map(|ch| f[t][ch] + w.dt_bias[ch])
                                .collect();
                            let heads_a_log = &w.a_log[first..first + count];
                            kda_decays_in_place(
                                &self.kernels,
                                c.kda.gate,
                                heads_a_log,
                                dim,
                                &mut alpha,
                            );
                            let mut gate = gates[t][channels.clone()].to_vec();
                            self.kernels.sigmoid_in_place(&mut gate);
                            let [q, k, v] = &mut qkv;
                            let mut y = vec![0.0; count * dim];
                            for local in 0..count {
                                let head = first + local;
                                let range = local * dim..(local + 1) * dim;
                                l2_norm(&mut q[range.clone()]);
                                q[range.clone()].iter_mut().for_each(|a| *a *= scale);
                                l2_norm(&mut k[range.clone()]);
                                let head_state =
                                    &mut state[local * dim * dim..(local + 1) * dim * dim];
                                let beta = sigmoid(beta_logits[t][head]);
                                kda_step(
                                    head_state,
                                    &q[range.clone()],
                                    &k[range.clone()],
                                    &v[range.clone()],
                                    &alpha[range.clone()],
                                    beta,
                                    &mut o,
                                );
                                let out = &mut y[range.clone()];
                                rms_norm(&o, Some(&w.o_norm), c.rms_norm_eps, out);
                                for (a, &g) in out.iter_mut().zip(&gate[range]) {
                                    *a *= g;
                                }
                            }
                            ys.push(y);
                        }
                        ys
                    },
                )
            };
            let parts = self.run_tasks(
                owned.len() > 1,
                owned.len(),
                |g| self.pool.block_domain(g, owned.len()),
                group,
            )?;
            let mut span_ys = vec![vec![0.0; heads * dim]; span.len()];
            for (g, part) in parts.into_iter().enumerate() {
                for (y, piece) in span_ys.iter_mut().zip(part) {
                    y[g * per * dim..g * per * dim + piece.len()].copy_from_slice(&piece);
                }
            }
            ys.extend(span_ys);
        }
        self.gemm(&w.o, &ys)
    }

    /// Gated MLA over the tokens of several sequences (`caches[i]`: a sequence's cache and the
    /// span of `xs` that is its tokens); projections once for all, attention per sequence.
    fn mla(
        &self,
        w: &Mla<'_>,
        caches: Vec<(&mut MlaCache, std::ops::Range<usize>)>,
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let m = &self.config.mla;
        let (nope, rope, vd, rank) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        // One dispatch for the projections of the normed input (q_a, kv_a and the gate).
        let mut matrices = vec![&w.q_a, &w.kv_a];
        matrices.extend(w.g.as_ref());
        let mut projected = self.gemm_many(&matrices, xs)?.into_iter();
        let (q_a, ckvs) = (
            projected.next().expect("q_a"),
            projected.next().expect("kv_a"),
        );
        let gates = projected.next();
        let q_a: Vec<Vec<f32>> = q_a
            .iter()
            .map(|q| {
                let mut y = vec![0.0; q.len()];
                rms_norm(q, Some(&w.q_a_norm), MLA_NORM_EPS, &mut y);
                y
            })
            .collect();
        let qs = self.gemm(&w.q_b, &q_a)?;
        let scale = ((nope + rope) as f32).powf(-0.5);
        let mut ctxs = Vec::with_capacity(xs.len());
        for (cache, span) in caches {
            // Append the chunk's latents and k_pe in token order; token t then attends causally
            // to the cache rows before it and itself.
            let first_position = cache.latent.len() / rank;
            for ckv in &ckvs[span.clone()] {
                let mut latent = vec![0.0; rank];
                rms_norm(&ckv[..rank], Some(&w.kv_a_norm), MLA_NORM_EPS, &mut latent);
                cache.latent.extend_from_slice(&latent);
                cache.k_pe.extend_from_slice(&ckv[rank..rank + rope]);
            }
            let cache = &*cache;
            // One head's context for token t (the absorbed form, K3_SPEC §7.3).
            let head_context = |t: usize, head: usize, out: &mut [f32]| {
                let positions = first_position + (t - span.start) + 1;
                let qh = &qs[t][head * (nope + rope)..(head + 1) * (nope + rope)];
                let rows = &w.kv_b[head * (nope + vd) * rank..(head + 1) * (nope + vd) * rank];
                // q_abs = W_UKᵀ q_nope: [rank].
                let mut q_abs = vec![0.0f32; rank];
                for (i, &qi) in qh[..nope].iter().enumerate() {
                    for (a, &wv) in q_abs.iter_mut().zip(&rows[i * rank..(i + 1) * rank]) {
                        *a += qi * wv;
                    }
                }
                let scores: Vec<f32> = (0..positions)
                    .map(|p| {
                        let c = &cache.latent[p * rank..(p + 1) * rank];
                        let pe = &cache.k_pe[p * rope..(p + 1) * rope];
                        (dot(&q_abs, c) + dot(&qh[nope..], pe)) * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
                let total = exps.iter().fold(0.0f32, |a, &e| a + e);
                let mut ctx_latent = vec![0.0f32; rank];
                for (p, &e) in exps.iter().enumerate() {
                    let weight = e / total;
                    for (a, &cv) in ctx_latent
                        .iter_mut()
                        .zip(&cache.latent[p * rank..(p + 1) * rank])
                    {
                        *a += weight * cv;
                    }
                }
                // ctx_h = W_UV ctx_latent: [v_head_dim].
                for (j, o) in out.iter_mut().enumerate() {
                    let wrow = &rows[(nope + j) * rank..(nope + j + 1) * rank];
                    *o = dot(wrow, &ctx_latent);
                }
            };
            // Head groups as tasks over the read-only cache (heads are independent).
            let heads = m.num_heads;
            let work = heads * span.len() * (first_position + span.len()) * (rank + rope) * 4;
            let groups = if work < self.parallel_min_bytes {
                1
            } else {
                self.pool.threads().min(heads)
            };
            let per = heads.div_ceil(groups);
            let group = |g: usize| -> Vec<Vec<f32>> {
                wide(
                    &self.kernels,
                    #[inline(always)]
                    || {
                        let heads_here = g * per..((g + 1) * per).min(heads);
                        span.clone()
                            .map(|t| {
                                let mut ctx = vec![0.0; heads_here.len() * vd];
                                for (local, head) in heads_here.clone().enumerate() {
                                    head_context(t, head, &mut ctx[local * vd..(local + 1) * vd]);
                                }
                                ctx
                            })
                            .collect()
                    },
                )
            };
            let count = heads.div_ceil(per);
            let parts = self.run_tasks(
                count > 1,
                count,
                |g| self.pool.block_domain(g, count),
                group,
            )?;
            let mut span_ctxs = vec![vec![0.0; heads * vd]; span.len()];
            for (g, part) in parts.into_iter().enumerate() {
                for (ctx, piece) in span_ctxs.iter_mut().zip(part) {
                    ctx[g * per * vd..g * per * vd + piece.len()].copy_from_slice(&piece);
                }
            }
            ctxs.extend(span_ctxs);
        }
        if let Some(gates) = gates {
            for (ctx, mut gate) in ctxs.iter_mut().zip(gates) {
                self.kernels.sigmoid_in_place(&mut gate);
                for (a, &g) in ctx.iter_mut().zip(&gate) {
                    *a *= g;
                }
            }
        }
        self.gemm(&w.o, &ctxs)
    }

    fn mlp(&self, w: &Mlp<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let [gates, ups]: [Vec<Vec<f32>>; 2] = self
            .gemm_many(&[&w.gate, &w.up], xs)?
            .try_into()
            .expect("two matrices in, two results out");
        let mut hidden = Vec::with_capacity(xs.len());
        for (gate, up) in gates.iter().zip(&ups) {
            let mut h = vec![0.0; gate.len()];
            self.situ.apply(&self.kernels, gate, up, &mut h)?;
            hidden.push(h);
        }
        self.gemm(&w.down, &hidden)
    }

    fn moe(&self, w: &Moe<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let r = &c.moe.router;
        // The router and the latent down-projection read the same inputs: one dispatch.
        let (logits, zs) = match &w.latent {
            Some((down, _, _)) => {
                let [logits, zs]: [Vec<Vec<f32>>; 2] = self
                    .timed(Bucket::Latent, || self.gemm_many(&[&w.router, down], xs))?
                    .try_into()
                    .expect("two matrices in, two results out");
                (logits, zs)
            }
            None => (
                self.timed(Bucket::Router, || self.gemm(&w.router, xs))?,
                xs.to_vec(),
            ),
        };
        let routes: Vec<(Vec<usize>, Vec<f32>)> = self.timed(Bucket::Router, || {
            logits
                .iter()
                .map(|logits| {
                    route(
                        logits,
                        &w.bias,
                        r.top_k,
                        r.renormalize,
                        r.routed_scaling_factor,
                    )
                })
                .collect()
        });
        let io = zs.first().map_or(0, Vec::len);
        // Each expert runs once for all the chunk's tokens that chose it (batch-invariant, so
        // every token's output equals its one-token run); outputs[t][k] is token t's k-th pick.
        let mut outputs: Vec<Vec<Vec<f32>>> = routes
            .iter()
            .map(|(ids, _)| vec![vec![0.0; io]; ids.len()])
            .collect();
        let mut needed: Vec<usize> = routes.iter().flat_map(|(ids, _)| ids.clone()).collect();
        needed.sort_unstable();
        needed.dedup();
        let shared = match &self.store {
            None => {
                let experts: Vec<(usize, [MxFp4Matrix<'_>; 3])> =
                    needed.iter().map(|&e| (e, w.experts[e])).collect();
                self.timed(Bucket::RoutedExperts, || {
                    self.run_experts(w.layer, &experts, &routes, &zs, &mut outputs)
                })?;
                None
            }
            Some(store) => {
                // All of the layer's experts at once: misses load in file order while the
                // shared experts and then the resident experts compute; each missing one
                // runs as it lands. Outputs go to fixed slots, so arrival order is invisible.
                let mut request = store.request(w.layer, &needed);
                let shared = match &w.shared {
                    Some(mlp) if request.pending() > 0 => {
                        Some(self.timed(Bucket::SharedExperts, || self.mlp(mlp, xs))?)
                    }
                    _ => None,
                };
                loop {
                    let batch = self.timed(Bucket::LoadWait, || request.next_batch());
                    if batch.is_empty() {
                        break;
                    }
                    let guards = batch
                        .into_iter()
                        .map(|(i, expert)| Ok((needed[i], expert?)))
                        .collect::<Result<Vec<_>>>()?;
                    let experts: Vec<(usize, [MxFp4Matrix<'_>; 3])> =
                        guards.iter().map(|(e, g)| (*e, g.matrices())).collect();
                    self.timed(Bucket::RoutedExperts, || {
                        self.run_experts(w.layer, &experts, &routes, &zs, &mut outputs)
                    })?;
                }
                shared
            }
        };
        // Per token, the weighted sum in the router's order.
        let mut routed: Vec<Vec<f32>> = Vec::with_capacity(xs.len());
        for ((_, weights), outs) in routes.iter().zip(&outputs) {
            let mut sum = vec![0.0f32; io];
            for (&weight, y) in weights.iter().zip(outs) {
                for (s, &o) in sum.iter_mut().zip(y) {
                    *s += weight * o;
                }
            }
            routed.push(sum);
        }
        let mut routed = match &w.latent {
            Some((_, norm, up)) => self.timed(Bucket::Latent, || {
                if let Some(norm) = norm {
                    for y in &mut routed {
                        let raw = y.clone();
                        rms_norm(&raw, Some(norm), c.rms_norm_eps, y);
                    }
                }
                self.gemm(up, &routed)
            })?,
            None => routed,
        };
        let shared = match (shared, &w.shared) {
            (Some(done), _) => Some(done),
            (None, Some(mlp)) => Some(self.timed(Bucket::SharedExperts, || self.mlp(mlp, xs))?),
            (None, None) => None,
        };
        if let Some(shared) = shared {
            for (a, b) in routed.iter_mut().zip(shared) {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
            }
        }
        Ok(routed)
    }

    /// Runs `experts` (id and matrices) for the tokens that chose them, writing each output to
    /// `outputs[token][pick]`.
    fn run_experts(
        &self,
        layer: usize,
        experts: &[(usize, [MxFp4Matrix<'_>; 3])],
        routes: &[(Vec<usize>, Vec<f32>)],
        zs: &[Vec<f32>],
        outputs: &mut [Vec<Vec<f32>>],
    ) -> Result<()> {
        let c = &self.config;
        let io = zs.first().map_or(0, Vec::len);
        // Work items: (expert, block of up to MAX_TOKENS of its tokens). Each is split into row
        // blocks twice — gate/up rows of the hidden vector, then down rows of the output — so
        // that more workers than experts still share the work. Every row is computed by one
        // task with the arithmetic of the fused kernel, so the schedule cannot change a bit.
        let mut items: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
        for (slot, (e, _)) in experts.iter().enumerate() {
            let users: Vec<(usize, usize)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, (ids, _))| ids.iter().position(|id| id == e).map(|k| (t, k)))
                .collect();
            items.extend(users.chunks(MAX_TOKENS).map(|block| (slot, block.to_vec())));
        }
        let expert_bytes: usize = experts.first().map_or(0, |(_, [g, u, d])| {
            g.weight_bytes() + u.weight_bytes() + d.weight_bytes()
        });
        let threads = if items.len() * expert_bytes < self.parallel_min_bytes {
            1
        } else {
            self.pool.threads()
        };
        let inter = c.moe.expert_intermediate;
        // With split placement each expert's rows are spread over every domain (at least one
        // block each); with home placement an expert's blocks all run on its home domain.
        let domains = self.pool.domains();
        let split = self.expert_placement == ExpertPlacement::Split && domains > 1;
        let per_expert = threads.div_ceil(items.len().max(1));
        let splits = |rows: usize| {
            let blocks = row_tasks(
                rows,
                if split {
                    per_expert.max(domains)
                } else {
                    per_expert
                },
            );
            let n = blocks.len();
            blocks
                .into_iter()
                .enumerate()
                .map(move |(j, r)| (r, j * domains / n))
                .collect::<Vec<_>>()
        };
        let acts: Vec<mxfp4_kernels::Activations> = items
            .iter()
            .map(|(_, block)| {
                let flat: Vec<f32> = block
                    .iter()
                    .flat_map(|&(t, _)| zs[t].iter().copied())
                    .collect();
                self.kernels.prepare(&flat, io)
            })
            .collect::<std::result::Result<_, _>>()?;
        // Phase 1: SiTU(gate · z, up · z) by row blocks of the hidden vector.
        let phase1: Vec<(usize, std::ops::Range<usize>, usize)> = (0..items.len())
            .flat_map(|i| splits(inter).into_iter().map(move |(r, d)| (i, r, d)))
            .collect();
        let gate_up = |task: usize| -> Result<Vec<f32>> {
            let (i, range, _) = &phase1[task];
            let [gate, up, _] = &experts[items[*i].0].1;
            let mut hidden = vec![0.0; range.len() * items[*i].1.len()];
            let mut scratch = ExpertScratch::default();
            self.kernels.expert_gate_up(
                gate,
                up,
                &self.situ,
                &acts[*i],
                range.clone(),
                &mut scratch,
                &mut hidden,
            )?;
            Ok(hidden)
        };
        let domain = |i: usize, block_domain: usize| {
            if split {
                block_domain
            } else {
                self.expert_domain(layer, experts[items[i].0].0)
            }
        };
        let parts = self.run_tasks(
            threads > 1,
            phase1.len(),
            |t| domain(phase1[t].0, phase1[t].2),
            gate_up,
        )?;
        let mut hidden: Vec<Vec<f32>> = items
            .iter()
            .map(|(_, b)| vec![0.0; inter * b.len()])
            .collect();
        for ((i, range, _), part) in phase1.iter().zip(parts) {
            let part = part?;
            let tokens = items[*i].1.len();
            for t in 0..tokens {
                hidden[*i][t * inter + range.start..t * inter + range.end]
                    .copy_from_slice(&part[t * range.len()..(t + 1) * range.len()]);
            }
        }
        let hidden_acts: Vec<mxfp4_kernels::Activations> = hidden
            .iter()
            .map(|h| self.kernels.prepare(h, inter))
            .collect::<std::result::Result<_, _>>()?;
        // Phase 2: down · hidden by row blocks of the output.
        let phase2: Vec<(usize, std::ops::Range<usize>, usize)> = (0..items.len())
            .flat_map(|i| splits(io).into_iter().map(move |(r, d)| (i, r, d)))
            .collect();
        let down_rows = |task: usize| -> Result<Vec<f32>> {
            let (i, range, _) = &phase2[task];
            let [_, _, down] = &experts[items[*i].0].1;
            let mut y = vec![0.0; range.len() * items[*i].1.len()];
            self.kernels
                .matmul_mxfp4(down, &hidden_acts[*i], range.clone(), &mut y)?;
            Ok(y)
        };
        let parts = self.run_tasks(
            threads > 1,
            phase2.len(),
            |t| domain(phase2[t].0, phase2[t].2),
            down_rows,
        )?;
        for ((i, range, _), part) in phase2.iter().zip(parts) {
            let part = part?;
            for (n, &(t, k)) in items[*i].1.iter().enumerate() {
                outputs[t][k][range.clone()]
                    .copy_from_slice(&part[n * range.len()..(n + 1) * range.len()]);
            }
        }
        Ok(())
    }
}

/// Row ranges for one matrix: about four tasks per worker, in blocks of 64 rows (a multiple
/// of every kernel's row block, so no task runs a needless row tail).
fn row_tasks(rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    if threads <= 1 {
        return std::iter::once(0..rows).collect();
    }
    let block = rows.div_ceil(4 * threads).div_ceil(64).max(1) * 64;
    (0..rows.div_ceil(block))
        .map(|i| i * block..((i + 1) * block).min(rows))
        .collect()
}

/// The AttnRes mix of `[bank..., current]`.
#[inline(always)]
fn mix(bank: &[Vec<f32>], current: &[f32], score: &[f32], eps: f32, out: &mut [f32]) {
    let mut candidates: Vec<&[f32]> = bank.iter().map(Vec::as_slice).collect();
    candidates.push(current);
    attn_res_mix(&candidates, score, eps, out);
}

/// Runs `f` inside a function compiled with AVX-512 enabled when the kernels' tier proves the
/// CPU has it, so the per-head loops it inlines (`ops`: the KDA step, norms, dot products) use
/// 512-bit vectors instead of the baseline's SSE2. Same bits: the same IEEE operations in the
/// same order, only wider registers (Rust never contracts or reassociates float arithmetic).
#[inline(always)]
fn wide<T>(kernels: &Kernels, f: impl FnOnce() -> T) -> T {
    #[cfg(target_arch = "x86_64")]
    if kernels.tier() != mxfp4_kernels::Tier::Scalar {
        // SAFETY: a non-scalar `Kernels` exists only where avx512f/bw/vl were detected.
        return unsafe { avx512(f) };
    }
    f()
}

/// # Safety
/// The CPU must have avx512f, avx512bw and avx512vl.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn avx512<T>(f: impl FnOnce() -> T) -> T {
    f()
}

/// FNV-1a 64 of the little-endian bytes of `logits`: the fingerprint the determinism tests and
/// the decode bench compare.
pub fn fingerprint(logits: &[f32]) -> u64 {
    logits
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}
