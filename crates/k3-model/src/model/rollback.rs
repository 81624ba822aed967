//! Taking tokens back ([`Model::rollback`]): a verify pass feeds a sequence's last token and
//! its drafted tokens, and keeps those the sampler accepts. The session goes back to the
//! position after the last kept token: each KDA layer's state and conv windows restored from
//! the checkpoint's copy and the kept tokens' recurrence replayed from the inputs the journal
//! kept (the same code, so the same bits as feeding only those tokens), the MLA caches
//! truncated. No weight matrix is read: the replay needs only the layers' vectors.

use super::error::{ModelError, Result};
use super::forward::Model;
use super::session::Session;
use super::weights::Attention;

impl Model<'_> {
    /// Takes `session` back to `position`, between its checkpoint ([`Session::checkpoint`])
    /// and where it is now: afterwards it is, bit for bit, the session that was fed only the
    /// tokens up to `position`. The checkpoint ends (as [`Session::commit`] would).
    ///
    /// # Errors
    /// No checkpoint armed, or `position` outside it: the session is left unchanged.
    pub fn rollback(&self, session: &mut Session, position: usize) -> Result<()> {
        let Some(start) = session.checkpoint_position() else {
            return Err(ModelError::Rollback(format!(
                "no checkpoint to go back to position {position}"
            )));
        };
        if position < start || position > session.position {
            return Err(ModelError::Rollback(format!(
                "position {position} is outside the checkpoint's span {start}..={}",
                session.position
            )));
        }
        let mut journal = session.journal.take().expect("checked above");
        let keep = position - start;
        if position < session.position {
            for (i, (state, kept)) in session.kda.iter_mut().zip(&journal.kda).enumerate() {
                let (Some(state), Some(kept)) = (state, kept) else {
                    continue;
                };
                state.state.copy_from_slice(&kept.saved.state);
                for (to, from) in state.windows.iter_mut().zip(&kept.saved.windows) {
                    to.copy_from_slice(from);
                }
                if keep == 0 {
                    continue;
                }
                let Attention::Kda(w) = &self.layers[i].attention else {
                    unreachable!("a KDA state belongs to a KDA layer");
                };
                self.pool
                    .install(|| self.kda_replay(w, state, &kept.inputs[..keep]))?;
            }
            let m = &self.config.mla;
            for cache in session.mla.iter_mut().flatten() {
                cache.truncate(position, m.kv_lora_rank, m.qk_rope_head_dim);
            }
            session.position = position;
        }
        for kept in journal.kda.iter_mut().flatten() {
            kept.inputs.clear();
        }
        session.spare = Some(journal);
        Ok(())
    }
}
