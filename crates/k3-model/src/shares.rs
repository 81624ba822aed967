//! What one rank of a several-rank engine owns of a checkpoint, and the check that every
//! rank opened the same checkpoint.
//!
//! Every matrix the forward pass multiplies is split by rows over the ranks
//! ([`numa_sched::Ranks::share`]): the trunk's projections, the router, the latent and shared
//! expert matrices, every routed expert and the lm_head. Replicated on every rank: the
//! embedding table (one row is read per token), every vector (norms, biases, decays, AttnRes
//! queries) and MLA's `kv_b`, which the model copies to f32 at load for the attention that only
//! rank 0 runs.

use expert_store::Checkpoint;
use numa_sched::{Ranks, RanksError};

use crate::config::K3Config;
use crate::model::snapshot::file::checkpoint_identity;

/// Bytes of a checkpoint by what a rank does with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankShare {
    /// Bytes of this rank's rows of the row-split matrices.
    pub owned: u64,
    /// Bytes of the row-split matrices over all ranks.
    pub split: u64,
    /// Bytes every rank holds (embedding, vectors, MLA `kv_b`).
    pub replicated: u64,
}

impl RankShare {
    /// This rank's share of `ckpt`'s tensors.
    pub fn of(ckpt: &Checkpoint, ranks: &Ranks) -> Self {
        let mut share = Self::default();
        for name in ckpt.tensor_names() {
            let Some(t) = ckpt.tensor(name) else { continue };
            let bytes = t.bytes.len() as u64;
            if !row_split(name, t.shape) {
                share.replicated += bytes;
            } else {
                let rows = t.shape[0].max(1);
                share.split += bytes;
                share.owned += bytes * ranks.share(rows).len() as u64 / rows as u64;
            }
        }
        share
    }

    /// The startup line of a rank: who it is and what it holds.
    pub fn describe(&self, ranks: &Ranks) -> String {
        format!(
            "rank {} of {} on {}: owns {:.3} GB of {:.3} GB of row-split weights ({:.1}%), plus {:.3} GB replicated (embedding, vectors, MLA kv_b)",
            ranks.rank(),
            ranks.size(),
            ranks.host(),
            self.owned as f64 / 1e9,
            self.split as f64 / 1e9,
            100.0 * self.owned as f64 / self.split.max(1) as f64,
            self.replicated as f64 / 1e9,
        )
    }
}

/// Whether a rank computes (and holds) only its rows of the tensor `name` of `shape`: every
/// matrix but the embedding, MLA's `kv_b` and the AttnRes projections, which every rank holds
/// whole.
pub(crate) fn row_split(name: &str, shape: &[usize]) -> bool {
    shape.len() >= 2
        && !name.contains("embed_tokens")
        && !name.contains("kv_b_proj")
        && !name.contains("res_proj")
}

/// Refuses a job whose ranks opened different checkpoints (by tensor-data size and
/// [`checkpoint_identity`]), naming the first rank that differs from rank 0 and both values.
pub(crate) fn same_checkpoint(
    ckpt: &Checkpoint,
    config: &K3Config,
    ranks: &Ranks,
) -> Result<(), RanksError> {
    ranks.agree(
        "the checkpoint (tensor bytes/identity hash)",
        &[ckpt.data_bytes() as u64, checkpoint_identity(ckpt, config)],
    )
}
