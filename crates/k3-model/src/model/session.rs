//! One sequence's state: the KDA conv windows and recurrent states, the MLA latent cache.

/// One sequence's state: KDA conv windows and recurrent states, the MLA latent cache.
#[derive(Debug, Clone)]
pub struct Session {
    pub(super) position: usize,
    pub(super) kda: Vec<Option<KdaState>>,
    pub(super) mla: Vec<Option<MlaCache>>,
}

#[derive(Debug, Clone)]
pub(super) struct KdaState {
    pub(super) windows: [Vec<f32>; 3],
    pub(super) state: Vec<f32>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct MlaCache {
    pub(super) latent: Vec<f32>,
    pub(super) k_pe: Vec<f32>,
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
