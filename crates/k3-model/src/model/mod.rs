//! The K3 forward pass (docs/MODEL.md §6-§9), layer-major over a chunk of tokens (a decode step is a
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
//!
//! One idea per file: this one holds the public types and the layer loop; `weights` the
//! weight structs and their loading; `dispatch` the pool dispatch and the trunk's GEMMs;
//! `kda`, `mla` and `moe` the blocks; `experts` the routed experts' tasks; `source` where the
//! routed experts come from ([`ExpertSource`]); `clock` the decode clock a memory plan sizes
//! its stream by; `follow` the steps of several ranks and `mirror` what the other ranks hold of
//! a sequence; `wide` the AVX-512-compiled wrapper.
//!
//! [`WeightMatrix`]: mxfp4_kernels::WeightMatrix
//! [`Checkpoint::linear`]: expert_store::Checkpoint::linear
//! [`ExpertSource`]: expert_store::source::ExpertSource

mod attend;
mod clock;
mod dispatch;
mod error;
mod follow;
mod forward;
mod kda;
mod lines;
mod load;
mod mirror;
mod mla;
mod moe;
mod rollback;
mod routed;
mod session;
pub mod snapshot;
mod source;
mod timing;
mod trunk;
mod weights;
mod wide;

pub use clock::DecodeClock;
pub use error::ModelError;
pub use forward::{ExpertPlacement, Model, PREFILL_CHUNK, Want, fingerprint};
pub use session::Session;
pub use snapshot::{Snapshot, SnapshotError, state_bytes};
pub use trunk::{PackedSummary, ResidentTrunk};

/// The routed-expert layout `config` implies (what an `ExpertStore` is opened with).
pub use crate::inventory::expert_layout;
