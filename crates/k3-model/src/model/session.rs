//! One sequence's state: the KDA conv windows and recurrent states, the MLA latent cache; and
//! the journal a verify pass of drafted tokens keeps so the session can go back to any
//! position since its checkpoint ([`Session::checkpoint`], `Model::rollback`).

use super::lines::Lines;
use super::mirror::MirrorTag;

/// One sequence's state: KDA conv windows and recurrent states, the MLA latent cache.
#[derive(Debug, Clone)]
pub struct Session {
    pub(super) position: usize,
    pub(super) kda: Vec<Option<KdaState>>,
    pub(super) mla: Vec<Option<MlaCache>>,
    /// Armed by [`Session::checkpoint`]: what taking tokens back needs.
    pub(super) journal: Option<Journal>,
    /// A finished journal's buffers, reused by the next checkpoint (no page faults per pass).
    pub(super) spare: Option<Journal>,
    /// What the other ranks hold of it (several ranks only; a copy starts with nothing).
    pub(super) mirror: MirrorTag,
}

/// What a session keeps from its checkpoint on: the position then, and per KDA layer its
/// state then and the inputs of every token fed since. The MLA cache needs nothing: taking
/// tokens back truncates it.
#[derive(Debug, Clone)]
pub(super) struct Journal {
    pub(super) position: usize,
    pub(super) kda: Vec<Option<KdaJournal>>,
}

/// One KDA layer's state at the checkpoint and its recurrence inputs since.
#[derive(Debug, Clone)]
pub(super) struct KdaJournal {
    pub(super) saved: KdaState,
    pub(super) inputs: Vec<KdaInputs>,
}

/// One token's inputs to a KDA layer's recurrence: the q, k, v projections (before the conv),
/// the decay projection `f_b · f_a x` and the beta logits. Replaying them through the same
/// code gives the same windows and state bits as the pass did.
#[derive(Debug, Clone)]
pub(super) struct KdaInputs {
    pub(super) projections: [Vec<f32>; 3],
    pub(super) decay: Vec<f32>,
    pub(super) beta_logits: Vec<f32>,
}

#[derive(Debug, Clone)]
pub(super) struct KdaState {
    pub(super) windows: [Vec<f32>; 3],
    pub(super) state: Vec<f32>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct MlaCache {
    /// `rank` values per position, each position's row starting a cache line where `rank`
    /// is a multiple of 16 (`Lines`: the attention kernels' loads stay within lines).
    pub(super) latent: Lines,
    /// `rope` values per position, aligned as `latent`.
    pub(super) k_pe: Lines,
}

impl MlaCache {
    /// Keeps the first `position` positions (rows of `rank` latents and `rope` k_pe values).
    pub(super) fn truncate(&mut self, position: usize, rank: usize, rope: usize) {
        self.latent.truncate(position * rank);
        self.k_pe.truncate(position * rope);
    }
}

impl Session {
    /// Tokens consumed so far.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Starts keeping what it takes to go back here: the tokens fed from now on can be taken
    /// back with `Model::rollback` to any position since (a verify pass of drafted tokens
    /// keeps the accepted ones). Saves each KDA layer's state (a copy) and, as tokens are fed,
    /// their KDA recurrence inputs (four rows of the KDA width and the beta logits per layer
    /// and token). A checkpoint already armed is moved here.
    pub fn checkpoint(&mut self) {
        let mut journal = self
            .journal
            .take()
            .or_else(|| self.spare.take())
            .unwrap_or_else(|| Journal {
                position: 0,
                kda: Vec::new(),
            });
        journal.position = self.position;
        journal.kda.resize_with(self.kda.len(), || None);
        for (kept, state) in journal.kda.iter_mut().zip(&self.kda) {
            match (kept, state) {
                (Some(kept), Some(state)) => {
                    kept.saved.state.clone_from(&state.state);
                    for (to, from) in kept.saved.windows.iter_mut().zip(&state.windows) {
                        to.clone_from(from);
                    }
                    kept.inputs.clear();
                }
                (kept, state) => {
                    *kept = state.as_ref().map(|state| KdaJournal {
                        saved: state.clone(),
                        inputs: Vec::new(),
                    });
                }
            }
        }
        self.journal = Some(journal);
    }

    /// Keeps every token fed since the checkpoint: the journal ends (its buffers kept for the
    /// next). Nothing happens without a checkpoint.
    pub fn commit(&mut self) {
        if let Some(journal) = self.journal.take() {
            self.spare = Some(journal);
        }
    }

    /// The position of the armed checkpoint, if any.
    pub fn checkpoint_position(&self) -> Option<usize> {
        self.journal.as_ref().map(|j| j.position)
    }

    /// Back to an empty sequence: KDA states and conv windows zeroed, MLA caches emptied (their
    /// memory kept for reuse); a checkpoint is dropped.
    pub fn reset(&mut self) {
        self.commit();
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
