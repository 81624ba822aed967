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

    /// For timing at depth only: every MLA cache extended to `depth` positions by repeating
    /// the rows it holds, in order, and the position moved there; the KDA states and conv
    /// windows (whose size does not depend on the depth) stay as they are, and a checkpoint is
    /// dropped. A decode step after this runs the same attention over `depth` cached positions
    /// as after a real prefill of `depth` tokens — the same work and the same memory — but the
    /// state is that of no token sequence, so its logits mean nothing. Seconds instead of the
    /// hours a real prefill of 64k tokens takes on a small machine (`teacher_forced_decode_bench
    /// --depth N --depth-fill M`). Under several ranks the mirrors get the whole caches at the
    /// next step. Refused for an empty session or a `depth` below the position.
    pub fn repeat_context(&mut self, depth: usize) -> Result<(), super::error::ModelError> {
        let filled = self.position;
        if filled == 0 || depth < filled {
            return Err(super::error::ModelError::Repeat(format!(
                "a context of {filled} positions cannot be repeated to {depth}: it needs at \
                 least one position and a depth no lower than it"
            )));
        }
        self.commit();
        for cache in self.mla.iter_mut().flatten() {
            for lines in [&mut cache.latent, &mut cache.k_pe] {
                let row = lines.len() / filled;
                let held = lines[..filled * row].to_vec();
                let mut rows = filled;
                while rows < depth {
                    let take = (depth - rows).min(filled);
                    lines.extend_from_slice(&held[..take * row]);
                    rows += take;
                }
            }
        }
        self.position = depth;
        self.mirror.forget();
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A session of `filled` positions: one KDA layer (any values) and one MLA layer whose row
    /// `p` holds `p * 1000 + j` (latent) and `-(p * 1000 + j)` (k_pe) in column `j`.
    fn session(filled: usize, rank: usize, rope: usize) -> Session {
        let rows = |width: usize, sign: f32| -> Lines {
            (0..filled * width)
                .map(|i| sign * ((i / width) * 1000 + i % width) as f32)
                .collect::<Vec<_>>()
                .into()
        };
        Session {
            position: filled,
            kda: vec![Some(KdaState {
                windows: std::array::from_fn(|w| vec![w as f32 + 0.5; 6]),
                state: (0..16).map(|i| i as f32 * 0.25).collect(),
            })],
            mla: vec![
                None,
                Some(MlaCache {
                    latent: rows(rank, 1.0),
                    k_pe: rows(rope, -1.0),
                }),
            ],
            journal: None,
            spare: None,
            mirror: MirrorTag::default(),
        }
    }

    /// `repeat_context` fills positions `filled..depth` with the held rows in order (row `p`
    /// is row `p mod filled`), moves the position, leaves the KDA state alone, and refuses an
    /// empty session and a depth below the position.
    #[test]
    fn a_repeated_context_holds_the_rows_in_order_up_to_the_depth() {
        let (rank, rope, filled, depth) = (16, 4, 3, 8);
        let mut s = session(filled, rank, rope);
        let kda = s.kda[0]
            .as_ref()
            .map(|k| (k.windows.clone(), k.state.clone()));
        s.repeat_context(depth).unwrap();
        assert_eq!(s.position(), depth);
        let cache = s.mla[1].as_ref().unwrap();
        assert_eq!(cache.latent.len(), depth * rank);
        assert_eq!(cache.k_pe.len(), depth * rope);
        for p in 0..depth {
            let from = (p % filled) as f32 * 1000.0;
            let latent: Vec<f32> = (0..rank).map(|j| from + j as f32).collect();
            let k_pe: Vec<f32> = (0..rope).map(|j| -(from + j as f32)).collect();
            assert_eq!(
                &cache.latent[p * rank..(p + 1) * rank],
                &latent[..],
                "row {p}"
            );
            assert_eq!(&cache.k_pe[p * rope..(p + 1) * rope], &k_pe[..], "row {p}");
        }
        let after = s.kda[0]
            .as_ref()
            .map(|k| (k.windows.clone(), k.state.clone()));
        assert_eq!(after, kda);
        // The same depth again changes nothing; a lower one and an empty session are refused.
        s.repeat_context(depth).unwrap();
        assert_eq!(s.mla[1].as_ref().unwrap().latent.len(), depth * rank);
        assert!(s.repeat_context(depth - 1).is_err());
        assert!(session(0, rank, rope).repeat_context(4).is_err());
    }
}
