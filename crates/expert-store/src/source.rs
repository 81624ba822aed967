//! The seam between a forward pass and where its routed experts come from: a consumer (a
//! model's MoE layer) asks an [`ExpertSource`] for the experts its router picked and computes
//! each batch the source hands back through [`ExpertHooks`]. [`ExpertStore`](crate::ExpertStore)
//! is one source (its
//! residency cache); a checkpoint's file mapping, a remote or a partitioned store are others,
//! and a store written elsewhere needs only this crate and `mxfp4-kernels` to be one.
//!
//! Generic twice, so neither side imposes its types on the other:
//! - over what an expert is ([`ExpertWeights`]): K3's routed expert is
//!   [`MxFp4Matrices<3>`] (gate, up, down), another model's may be two matrices or another
//!   format;
//! - over the error `E` the call returns: the consumer's own, into which a source converts its
//!   failures (`E: From<ItsError>`) and through which it passes the hooks' failures untouched.
//!
//! Cost. A consumer holds a `Box<dyn ExpertSource<..>>` and the hooks are `&mut dyn FnMut`: the
//! indirect calls are few and coarse. Per MoE layer and forward pass there is one call to
//! [`ExpertSource::experts`] and one to [`ExpertHooks::run`] per batch of ready experts (one
//! batch when everything is resident); [`ExpertSource::home`] is called once per expert task
//! to pick its domain, and each such task multiplies a block of an expert's rows (tens of KiB
//! of weights at the least), next to which an indirect call is noise. Nothing per row, per
//! token or per weight goes through the seam.
//!
//! Determinism. Where the matrices come from cannot change a bit of the result as long as the
//! consumer writes each expert's output to a slot fixed by its router and sums in a fixed
//! order: a source decides batches and their order, never the bytes.
//!
//! # Example: an expert read from a safetensors file, run through the fused FFN
//!
//! One routed expert in the compressed-tensors layout (`weight_packed`: U8 E2M1 code pairs,
//! `weight_scale`: U8 E8M0 scales, one per 32 columns), written here, served by an
//! [`ExpertStore`](crate::ExpertStore) through the seam, computed with `mxfp4-kernels`' fused
//! expert FFN and checked against a plain dequantise-then-matmul:
//!
//! ```
//! use expert_store::source::{ExpertHooks, ExpertSource, MxFp4Matrices};
//! use expert_store::writer::{TensorOut, write_safetensors};
//! use expert_store::{Checkpoint, Dtype, ExpertLayout, ExpertStore, MatrixLayout, StoreConfig};
//! use mxfp4_kernels::{ExpertScratch, Kernels, Situ};
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//! let (hidden, inter) = (64, 32);
//! let matrix = |proj: &'static str, rows, cols| {
//!     let name = |part| format!("model.layers.{{layer}}.mlp.experts.{{expert}}.{proj}.{part}");
//!     MatrixLayout::new(proj, &name("weight_packed"), &name("weight_scale"), rows, cols)
//! };
//! let layout = ExpertLayout::new(vec![
//!     matrix("gate_proj", inter, hidden)?,
//!     matrix("up_proj", inter, hidden)?,
//!     matrix("down_proj", hidden, inter)?,
//! ])?;
//!
//! // Expert 5 of layer 0: codes from an xorshift, scales 2^-3..2^0 (E8M0 bytes 124..=127).
//! let dir = std::env::temp_dir().join(format!("expert-store-source-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let mut tensors = Vec::new();
//! for m in layout.matrices() {
//!     let u8s = |name, cols| TensorOut { name, dtype: Dtype::U8, shape: vec![m.rows, cols] };
//!     tensors.push(u8s(m.codes.name(0, 5), m.cols / 2));
//!     tensors.push(u8s(m.scales.name(0, 5), m.cols / 32));
//! }
//! let mut state = 0x2545_f491_4f6c_dd1d_u64;
//! write_safetensors(&dir.join("model.safetensors"), tensors, |t, buf| {
//!     for _ in 0..t.bytes() {
//!         state ^= state << 13;
//!         state ^= state >> 7;
//!         state ^= state << 17;
//!         let scale = t.name.ends_with("weight_scale");
//!         buf.push(if scale { 124 + (state % 4) as u8 } else { state as u8 });
//!     }
//! })?;
//!
//! // The store reads the expert; the consumer names its expert kind and its error type.
//! let ckpt = Checkpoint::open(&dir)?;
//! let config = StoreConfig { io_threads: 1, ..StoreConfig::default() };
//! let store = ExpertStore::open(&ckpt, layout, config)?;
//! let source: &dyn ExpertSource<MxFp4Matrices<3>, BoxError> = &store;
//! let kernels = Kernels::detect();
//! let x: Vec<f32> = (0..hidden).map(|i| ((i * 37 % 64) as f32 - 32.0) / 32.0).collect();
//! let z = kernels.prepare(&x, hidden)?;
//! let mut scratch = ExpertScratch::default();
//! let mut out = vec![0.0f32; hidden];
//! let mut handed = Vec::new();
//! source.experts(0, &[5], ExpertHooks {
//!     overlap: &mut || Ok(()),
//!     wait: &|wait| wait(),
//!     run: &mut |batch| {
//!         for (expert, [gate, up, down]) in batch {
//!             handed.push(*expert);
//!             kernels.expert_ffn(gate, up, down, &Situ::K3, &z, &mut scratch, &mut out)?;
//!         }
//!         Ok(())
//!     },
//! })?;
//! assert_eq!(handed, [5]);
//!
//! // The reference: each weight decoded by hand (E2M1 code x 2^(scale - 127)), then matmuls.
//! const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
//! let dense = |proj: &str, rows: usize, cols: usize| -> Result<Vec<f32>, BoxError> {
//!     let tensor = |part| ckpt.require(&format!("model.layers.0.mlp.experts.5.{proj}.{part}"));
//!     let (codes, scales) = (tensor("weight_packed")?.bytes, tensor("weight_scale")?.bytes);
//!     let weight = |r: usize, c: usize| {
//!         let code = (codes[r * cols / 2 + c / 2] >> (4 * (c % 2))) & 0xF;
//!         let sign = if code & 8 == 0 { 1.0 } else { -1.0 };
//!         let scale = 2f32.powi(i32::from(scales[r * cols / 32 + c / 32]) - 127);
//!         sign * E2M1[usize::from(code & 7)] * scale
//!     };
//!     Ok((0..rows * cols).map(|i| weight(i / cols, i % cols)).collect())
//! };
//! let matvec = |w: &[f32], v: &[f32]| -> Vec<f32> {
//!     w.chunks(v.len()).map(|row| row.iter().zip(v).map(|(a, b)| a * b).sum()).collect()
//! };
//! let gate = matvec(&dense("gate_proj", inter, hidden)?, &x);
//! let up = matvec(&dense("up_proj", inter, hidden)?, &x);
//! let h: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| Situ::K3.eval(g, u)).collect();
//! let expected = matvec(&dense("down_proj", hidden, inter)?, &h);
//! let largest = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
//! assert!(largest > 1.0);
//! for (got, want) in out.iter().zip(&expected) {
//!     assert!((got - want).abs() <= 1e-4 * largest, "{got} vs {want}");
//! }
//! std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), BoxError>(())
//! ```

use std::sync::Arc;

use mxfp4_kernels::MxFp4Matrix;

/// What one routed expert is, as its consumer computes it: [`Self::View`] borrows the
/// expert's weights for as long as a batch lives (from a file mapping, a cache buffer held by
/// a guard, or memory of one's own). Implemented by marker types (hence `'static`).
pub trait ExpertWeights: 'static {
    /// An expert's weights, borrowed for `'m`.
    type View<'m>;
}

/// Experts made of `N` MXFP4 matrices, handed out in the order the consumer expects (K3's:
/// gate, up, down, as `MxFp4Matrices<3>`). A marker type: it has no values.
#[derive(Debug)]
pub enum MxFp4Matrices<const N: usize> {}

impl<const N: usize> ExpertWeights for MxFp4Matrices<N> {
    type View<'m> = [MxFp4Matrix<'m>; N];
}

/// A batch of ready experts: each one's id and its weights.
pub type ExpertBatch<'m, K> = [(usize, <K as ExpertWeights>::View<'m>)];

/// The callbacks through which an [`ExpertSource`] hands a layer's routed experts to the
/// consumer. Each returns the consumer's error `E`, which the source passes on unchanged.
pub struct ExpertHooks<'h, K: ExpertWeights, E> {
    /// Work to overlap with loads (a model's shared experts): called at most once, before the
    /// first wait, and only when some expert is not ready.
    pub overlap: &'h mut dyn FnMut() -> Result<(), E>,
    /// Wraps each wait for experts to land (a model charges it to its load-wait clock): the
    /// source calls `wait(&mut waiting)`, and `wait` must call `waiting` once.
    pub wait: &'h dyn Fn(&mut dyn FnMut()),
    /// Computes a batch of ready experts.
    pub run: &'h mut dyn FnMut(&ExpertBatch<'_, K>) -> Result<(), E>,
}

impl<K: ExpertWeights, E> std::fmt::Debug for ExpertHooks<'_, K, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertHooks").finish_non_exhaustive()
    }
}

/// A supplier of routed experts of kind `K` to a consumer whose calls fail with `E`. Where the
/// weights come from cannot change a bit of the consumer's result: outputs go to fixed slots,
/// whatever the batches and their order.
///
/// # Example: a store of one's own
///
/// Experts kept in memory as owned bytes, with an error of the store's own; any consumer
/// whose error converts from it can use the store. Here the consumer computes each expert
/// with the fused FFN and a plain `gate · up` activation:
///
/// ```
/// use std::collections::BTreeMap;
///
/// use expert_store::source::{ExpertHooks, ExpertSource, MxFp4Matrices};
/// use mxfp4_kernels::{ExpertScratch, GluActivation, Kernels, MxFp4Matrix};
///
/// type KernelResult = mxfp4_kernels::Result<()>;
/// type BoxError = Box<dyn std::error::Error>;
///
/// /// Square experts of side `dim`: each matrix's packed codes and E8M0 scales.
/// struct InMemory {
///     dim: usize,
///     experts: BTreeMap<(usize, usize), [(Vec<u8>, Vec<u8>); 3]>,
/// }
///
/// #[derive(Debug)]
/// struct NotHere {
///     layer: usize,
///     expert: usize,
/// }
///
/// impl std::fmt::Display for NotHere {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         write!(f, "layer {} has no expert {}", self.layer, self.expert)
///     }
/// }
///
/// impl std::error::Error for NotHere {}
///
/// fn view(dim: usize, (codes, scales): &(Vec<u8>, Vec<u8>)) -> MxFp4Matrix<'_> {
///     MxFp4Matrix::new(codes, scales, dim, dim).expect("checked when stored")
/// }
///
/// impl<E: From<NotHere>> ExpertSource<MxFp4Matrices<3>, E> for InMemory {
///     fn home(&self, _layer: usize, expert: usize) -> usize {
///         expert
///     }
///
///     fn experts(
///         &self,
///         layer: usize,
///         needed: &[usize],
///         hooks: ExpertHooks<'_, MxFp4Matrices<3>, E>,
///     ) -> Result<(), E> {
///         let batch = needed
///             .iter()
///             .map(|&expert| match self.experts.get(&(layer, expert)) {
///                 Some([gate, up, down]) => {
///                     Ok((expert, [gate, up, down].map(|m| view(self.dim, m))))
///                 }
///                 None => Err(NotHere { layer, expert }.into()),
///             })
///             .collect::<Result<Vec<_>, E>>()?;
///         // All in memory: one batch, nothing to overlap or wait for.
///         (hooks.run)(&batch)
///     }
/// }
///
/// /// The consumer's activation: `gate · up`.
/// struct Bilinear;
///
/// impl GluActivation for Bilinear {
///     fn apply(&self, _: &Kernels, gate: &[f32], up: &[f32], out: &mut [f32]) -> KernelResult {
///         for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
///             *o = g * u;
///         }
///         Ok(())
///     }
/// }
///
/// // 32 x 32 matrices of ones (code 2 is 1.0) times 2^(scale - 127); expert e's down is 2^-e.
/// let ones = |scale: u8| (vec![0x22u8; 32 * 16], vec![scale; 32]);
/// let experts = (0..4u8).map(|e| ((0, usize::from(e)), [ones(127), ones(127), ones(127 - e)]));
/// let store = InMemory { dim: 32, experts: experts.collect() };
/// let source: Box<dyn ExpertSource<MxFp4Matrices<3>, BoxError>> = Box::new(store);
///
/// let kernels = Kernels::detect();
/// let z = kernels.prepare(&[0.5; 32], 32)?;
/// let mut scratch = ExpertScratch::default();
/// let mut outputs = BTreeMap::new();
/// source.experts(0, &[1, 3], ExpertHooks {
///     overlap: &mut || Ok(()),
///     wait: &|wait| wait(),
///     run: &mut |batch| {
///         for (expert, [gate, up, down]) in batch {
///             let mut out = vec![0.0; 32];
///             kernels.expert_ffn(gate, up, down, &Bilinear, &z, &mut scratch, &mut out)?;
///             outputs.insert(*expert, out);
///         }
///         Ok(())
///     },
/// })?;
/// // gate · z = up · z = 16, hidden = 256, down · hidden = 32 · 256 · 2^-e.
/// assert_eq!(outputs[&1], [4096.0; 32]);
/// assert_eq!(outputs[&3], [1024.0; 32]);
///
/// let hooks = ExpertHooks { overlap: &mut || Ok(()), wait: &|wait| wait(), run: &mut |_| Ok(()) };
/// let missing = source.experts(0, &[9], hooks).unwrap_err();
/// assert_eq!(missing.to_string(), "layer 0 has no expert 9");
/// # Ok::<(), BoxError>(())
/// ```
pub trait ExpertSource<K: ExpertWeights, E>: Send + Sync {
    /// The domain expert `expert` of checkpoint layer `layer` calls home (the caller takes it
    /// modulo its pool's domains): where the consumer runs that expert's work when it places
    /// experts by home.
    fn home(&self, layer: usize, expert: usize) -> usize;

    /// Hands every expert of `needed` (distinct ids of checkpoint layer `layer`, ascending) to
    /// `hooks.run` exactly once, in batches of experts ready to compute, and returns the first
    /// error of a hook unchanged. An expert that cannot be supplied fails the call (this step;
    /// the consumer carries on).
    fn experts(
        &self,
        layer: usize,
        needed: &[usize],
        hooks: ExpertHooks<'_, K, E>,
    ) -> Result<(), E>;
}

/// A shared source is a source: a consumer can own an `Arc` of a store its caller keeps too
/// (for statistics, or to hand to a second consumer).
impl<K: ExpertWeights, E, S: ExpertSource<K, E> + ?Sized> ExpertSource<K, E> for Arc<S> {
    fn home(&self, layer: usize, expert: usize) -> usize {
        (**self).home(layer, expert)
    }

    fn experts(
        &self,
        layer: usize,
        needed: &[usize],
        hooks: ExpertHooks<'_, K, E>,
    ) -> Result<(), E> {
        (**self).experts(layer, needed, hooks)
    }
}
