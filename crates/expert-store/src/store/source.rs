//! The store as an [`ExpertSource`]: a layer's experts requested at once, the misses loading in
//! file order while the consumer runs its overlap work and then the experts already resident;
//! each missing one is handed over as it lands.

use mxfp4_kernels::MxFp4Matrix;

use super::config::StoreError;
use super::open::ExpertStore;
use crate::source::{ExpertHooks, ExpertSource, MxFp4Matrices};

/// Experts of `N` MXFP4 matrices, in the order of the store's layout; any consumer whose error
/// converts from [`StoreError`]. A store whose layout has another number of matrices fails each
/// call with [`StoreError::Matrices`].
impl<const N: usize, E: From<StoreError>> ExpertSource<MxFp4Matrices<N>, E> for ExpertStore {
    /// The expert's home in the store ([`ExpertStore::place`]).
    fn home(&self, layer: usize, expert: usize) -> usize {
        ExpertStore::home(self, layer, expert)
    }

    fn experts(
        &self,
        layer: usize,
        needed: &[usize],
        hooks: ExpertHooks<'_, MxFp4Matrices<N>, E>,
    ) -> Result<(), E> {
        // All of the layer's experts at once: misses load in file order while the overlap
        // work and then the resident experts compute; each missing one runs as it lands.
        // Outputs go to fixed slots, so arrival order is invisible.
        let mut request = self.request(layer, needed);
        if request.pending() > 0 {
            (hooks.overlap)()?;
        }
        loop {
            let mut batch = Vec::new();
            (hooks.wait)(&mut || batch = request.next_batch());
            if batch.is_empty() {
                break;
            }
            let guards = batch
                .into_iter()
                .map(|(i, expert)| Ok((needed[i], expert?)))
                .collect::<Result<Vec<_>, E>>()?;
            let experts = guards
                .iter()
                .map(|(e, guard)| {
                    let matrices = <[MxFp4Matrix<'_>; N]>::try_from(guard.matrices());
                    Ok((*e, matrices.map_err(|_| self.not_matrices(N))?))
                })
                .collect::<Result<Vec<_>, E>>()?;
            (hooks.run)(&experts)?;
        }
        Ok(())
    }
}

impl ExpertStore {
    /// The error for a consumer that computes experts of `expected` matrices.
    fn not_matrices(&self, expected: usize) -> StoreError {
        StoreError::Matrices {
            layout: self.layout().to_string(),
            expected,
        }
    }
}
