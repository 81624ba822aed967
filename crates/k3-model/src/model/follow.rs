//! Several ranks, one forward pass: rank 0 (the leader) announces each step (its tokens, how
//! they split into sequences, which logits are wanted, each sequence's id and position) and
//! every other rank runs the same step on its share of the rows ([`Model::follow`]). Only the
//! leader holds whole sequences: the others keep mirrors of their MLA caches
//! ([`super::mirror`]), compute their share of the MLA heads on them, and take the KDA outputs
//! from the leader (`share_attention`). Every rank makes the same collectives in the same
//! order, because each runs the same code on the same inputs.

use std::collections::HashMap;

use super::error::{ModelError, Result};
use super::forward::{Model, Want};
use super::lines::Lines;
use super::mirror::Standing;
use super::session::{MlaCache, Session};

/// Announcement words: a step, the end, or a profile reset.
const STOP: u64 = 0;
const STEP: u64 = 1;
const PROFILE_RESET: u64 = 2;

/// A step as rank 0 announces it.
#[derive(Debug, PartialEq)]
struct Step {
    wanted: Vec<Want>,
    lengths: Vec<usize>,
    /// Each group's sequence: its id, its position before the step, whether it is sent whole.
    standings: Vec<Standing>,
    /// Ids of dropped sequences.
    gone: Vec<u64>,
    tokens: Vec<usize>,
}

impl Model<'_> {
    /// One step of the forward pass over `groups`, announced to the other ranks first when
    /// there are any.
    pub(super) fn run_step(
        &self,
        groups: &mut [(&mut Session, &[usize])],
        wanted: &[Want],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let ranks = self.pool.ranks();
        if ranks.size() == 1 {
            return self.pool.install(|| self.forward_on_worker(groups, wanted));
        }
        // A bad token is refused before the announcement, so no rank starts a step the leader
        // will not finish.
        let vocab = self.config.vocab_size;
        if let Some(&token) = groups
            .iter()
            .flat_map(|(_, t)| t.iter())
            .find(|&&t| t >= vocab)
        {
            return Err(ModelError::Token { token, vocab });
        }
        let _step = ranks.lock_steps();
        let standings: Vec<Standing> = groups
            .iter_mut()
            .map(|(session, _)| {
                let position = session.position;
                Standing::of(&mut session.mirror, position, &self.mirror_ids, &self.gone)
            })
            .collect();
        let gone = std::mem::take(&mut *self.gone.lock().unwrap_or_else(|p| p.into_inner()));
        let mut words = step_words(&Step {
            wanted: wanted.to_vec(),
            lengths: groups.iter().map(|(_, t)| t.len()).collect(),
            standings: standings.clone(),
            gone,
            tokens: groups.iter().flat_map(|(_, t)| t.iter().copied()).collect(),
        });
        ranks.broadcast_words(&mut words);
        // The sequences the other ranks do not hold, whole, in group and layer order.
        for ((session, _), standing) in groups.iter_mut().zip(&standings) {
            if standing.send {
                for cache in session.mla.iter_mut().flatten() {
                    ranks.broadcast(&mut cache.latent);
                    ranks.broadcast(&mut cache.k_pe);
                }
            }
        }
        let out = self.pool.install(|| self.forward_on_worker(groups, wanted));
        for (session, _) in groups.iter_mut() {
            if out.is_ok() {
                session.mirror.held = Some(session.position);
            } else {
                session.mirror.forget();
            }
        }
        out
    }

    /// Sets this model's profile ([`Model::with_profile`]) back to zero, and every other
    /// rank's (their models were given one too: a run profiles on every rank or none), so
    /// that each rank's buckets cover the same steps.
    pub fn reset_profile(&self) {
        let Some(profile) = &self.profile else {
            return;
        };
        profile.reset();
        let ranks = self.pool.ranks();
        if ranks.size() > 1 && ranks.is_leader() {
            let _step = ranks.lock_steps();
            ranks.broadcast_words(&mut vec![PROFILE_RESET]);
        }
    }

    /// On a rank other than 0: runs every step rank 0 announces, until rank 0's model is
    /// dropped (returns `Ok`). On rank 0 it returns at once. This rank keeps a mirror of each
    /// sequence's MLA caches ([`super::mirror`]); KDA states stay on rank 0.
    pub fn follow(&self) -> Result<()> {
        let ranks = self.pool.ranks();
        if ranks.is_leader() {
            return Ok(());
        }
        let mut mirrors: HashMap<u64, Session> = HashMap::new();
        loop {
            let mut words = Vec::new();
            ranks.broadcast_words(&mut words);
            if words.first() == Some(&PROFILE_RESET) {
                if let Some(profile) = &self.profile {
                    profile.reset();
                }
                continue;
            }
            let Some(step) = parse_step(&words) else {
                return Ok(());
            };
            for id in &step.gone {
                mirrors.remove(id);
            }
            let mut sessions = Vec::with_capacity(step.standings.len());
            for standing in &step.standings {
                let session = if standing.send {
                    self.received_mirror(standing.position)
                } else {
                    let mut session = mirrors.remove(&standing.id).ok_or_else(|| {
                        ModelError::Ranks(format!(
                            "rank {} holds no sequence {} that rank 0 announced",
                            ranks.rank(),
                            standing.id
                        ))
                    })?;
                    self.truncate_mirror(&mut session, standing.position)?;
                    session
                };
                sessions.push(session);
            }
            let mut groups = Vec::with_capacity(sessions.len());
            let mut at = 0;
            for (session, &n) in sessions.iter_mut().zip(&step.lengths) {
                groups.push((session, &step.tokens[at..at + n]));
                at += n;
            }
            self.pool
                .install(|| self.forward_on_worker(&mut groups, &step.wanted))?;
            for (standing, session) in step.standings.iter().zip(sessions) {
                mirrors.insert(standing.id, session);
            }
        }
    }

    /// A mirror of a sequence at `position` whose MLA caches rank 0 sends now (in layer
    /// order, the latents then the `k_pe` of each); no KDA state.
    fn received_mirror(&self, position: usize) -> Session {
        let ranks = self.pool.ranks();
        let m = &self.config.mla;
        let mut session = self.stand_in();
        session.position = position;
        for (cache, layer) in session.mla.iter_mut().zip(&self.config.layers) {
            if layer.attention == crate::config::AttentionKind::Mla {
                let mut latent = Lines::zeros(position * m.kv_lora_rank);
                let mut k_pe = Lines::zeros(position * m.qk_rope_head_dim);
                ranks.broadcast(&mut latent);
                ranks.broadcast(&mut k_pe);
                *cache = Some(MlaCache { latent, k_pe });
            }
        }
        session
    }

    /// A mirror back to `position` (rank 0's sequence was rolled back or reset): its caches
    /// truncated; an error if it holds fewer positions.
    fn truncate_mirror(&self, session: &mut Session, position: usize) -> Result<()> {
        if session.position < position {
            return Err(ModelError::Ranks(format!(
                "rank {} holds {} positions of a sequence rank 0 has at {position}",
                self.pool.ranks().rank(),
                session.position
            )));
        }
        let m = &self.config.mla;
        for cache in session.mla.iter_mut().flatten() {
            cache.truncate(position, m.kv_lora_rank, m.qk_rope_head_dim);
        }
        session.position = position;
        Ok(())
    }

    /// A session with no state, for a rank that is not the leader.
    fn stand_in(&self) -> Session {
        Session {
            position: 0,
            kda: vec![None; self.config.layers.len()],
            mla: vec![None; self.config.layers.len()],
            journal: None,
            spare: None,
            mirror: Default::default(),
        }
    }
}

impl Drop for Model<'_> {
    /// Rank 0's model going away ends the other ranks' [`Model::follow`].
    fn drop(&mut self) {
        let ranks = self.pool.ranks();
        if ranks.size() > 1 && ranks.is_leader() {
            let _step = ranks.lock_steps();
            ranks.broadcast_words(&mut vec![STOP]);
        }
    }
}

fn wanted_word(wanted: Want) -> u64 {
    match wanted {
        Want::All => 0,
        Want::Last => 1,
        Want::None => 2,
    }
}

/// A step's announcement: `STEP`, the group count `g`, then per group its length, wanted
/// rows, sequence id, position and whether it is sent (g words each), then the count of gone
/// ids and the ids, then the tokens.
fn step_words(step: &Step) -> Vec<u64> {
    let mut words = vec![STEP, step.lengths.len() as u64];
    words.extend(step.lengths.iter().map(|&n| n as u64));
    words.extend(step.wanted.iter().map(|&w| wanted_word(w)));
    words.extend(step.standings.iter().map(|s| s.id));
    words.extend(step.standings.iter().map(|s| s.position as u64));
    words.extend(step.standings.iter().map(|s| u64::from(s.send)));
    words.push(step.gone.len() as u64);
    words.extend(&step.gone);
    words.extend(step.tokens.iter().map(|&t| t as u64));
    words
}

/// A step announcement ([`step_words`]); `None` for the end.
fn parse_step(words: &[u64]) -> Option<Step> {
    let (&kind, rest) = words.split_first()?;
    if kind != STEP {
        return None;
    }
    let groups = rest[0] as usize;
    let field = |k: usize| &rest[1 + k * groups..1 + (k + 1) * groups];
    let lengths: Vec<usize> = field(0).iter().map(|&n| n as usize).collect();
    let wanted = field(1)
        .iter()
        .map(|&w| match w {
            0 => Want::All,
            1 => Want::Last,
            _ => Want::None,
        })
        .collect();
    let standings = (0..groups)
        .map(|g| Standing {
            id: field(2)[g],
            position: field(3)[g] as usize,
            send: field(4)[g] != 0,
        })
        .collect();
    let at = 1 + 5 * groups;
    let gone_count = rest[at] as usize;
    let gone = rest[at + 1..at + 1 + gone_count].to_vec();
    let tokens = rest[at + 1 + gone_count..]
        .iter()
        .map(|&t| t as usize)
        .collect();
    Some(Step {
        wanted,
        lengths,
        standings,
        gone,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip() {
        let step = Step {
            wanted: vec![Want::All, Want::Last],
            lengths: vec![3, 1],
            standings: vec![
                Standing {
                    id: 7,
                    position: 0,
                    send: true,
                },
                Standing {
                    id: 9,
                    position: 41,
                    send: false,
                },
            ],
            gone: vec![2, 5],
            tokens: vec![10, 11, 12, 13],
        };
        let words = step_words(&step);
        assert_eq!(parse_step(&words), Some(step));
        assert!(parse_step(&[STOP]).is_none());
        assert!(parse_step(&[]).is_none());
        assert_eq!(wanted_word(Want::None), 2);
    }
}
