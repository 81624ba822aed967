//! Several ranks, one forward pass: rank 0 (the leader) announces each step (its tokens, how
//! they split into sequences, which logits are wanted) and every other rank runs the same
//! step on its share of the rows ([`Model::follow`]). Only the leader holds sequences: the
//! others run the step with stateless stand-ins, and take the attention outputs from the
//! leader (`share_attention`). Every rank makes the same collectives in the same order, because
//! each runs the same code on the same inputs.

use super::error::{ModelError, Result};
use super::forward::{Model, Want};
use super::session::Session;

/// Announcement words: a step, or the end.
const STOP: u64 = 0;
const STEP: u64 = 1;

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
        let mut words = vec![STEP, groups.len() as u64];
        words.extend(groups.iter().map(|(_, t)| t.len() as u64));
        words.extend(wanted.iter().map(|&w| wanted_word(w)));
        words.extend(groups.iter().flat_map(|(_, t)| t.iter().map(|&x| x as u64)));
        ranks.broadcast_words(&mut words);
        self.pool.install(|| self.forward_on_worker(groups, wanted))
    }

    /// On a rank other than 0: runs every step rank 0 announces, until rank 0's model is
    /// dropped (returns `Ok`). On rank 0 it returns at once.
    pub fn follow(&self) -> Result<()> {
        let ranks = self.pool.ranks();
        if ranks.is_leader() {
            return Ok(());
        }
        loop {
            let mut words = Vec::new();
            ranks.broadcast_words(&mut words);
            let Some((wanted, lengths, tokens)) = parse_step(&words) else {
                return Ok(());
            };
            let mut sessions: Vec<Session> = lengths.iter().map(|_| self.stand_in()).collect();
            let mut groups = Vec::with_capacity(lengths.len());
            let mut at = 0;
            for (session, &n) in sessions.iter_mut().zip(&lengths) {
                groups.push((session, &tokens[at..at + n]));
                at += n;
            }
            self.pool
                .install(|| self.forward_on_worker(&mut groups, &wanted))?;
        }
    }

    /// A session with no state, for a rank that is not the leader.
    fn stand_in(&self) -> Session {
        Session {
            position: 0,
            kda: vec![None; self.config.layers.len()],
            mla: vec![None; self.config.layers.len()],
            journal: None,
            spare: None,
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

/// `(wanted per group, group lengths, tokens)` of a step announcement; `None` for the end.
fn parse_step(words: &[u64]) -> Option<(Vec<Want>, Vec<usize>, Vec<usize>)> {
    let (&kind, rest) = words.split_first()?;
    if kind != STEP {
        return None;
    }
    let groups = rest[0] as usize;
    let lengths: Vec<usize> = rest[1..1 + groups].iter().map(|&n| n as usize).collect();
    let wanted = rest[1 + groups..1 + 2 * groups]
        .iter()
        .map(|&w| match w {
            0 => Want::All,
            1 => Want::Last,
            _ => Want::None,
        })
        .collect();
    let tokens = rest[1 + 2 * groups..].iter().map(|&t| t as usize).collect();
    Some((wanted, lengths, tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip() {
        let words = [STEP, 2, 3, 1, 0, 1, 10, 11, 12, 13];
        let (wanted, lengths, tokens) = parse_step(&words).expect("a step");
        assert_eq!(wanted, vec![Want::All, Want::Last]);
        assert_eq!(lengths, vec![3, 1]);
        assert_eq!(tokens, vec![10, 11, 12, 13]);
        assert!(parse_step(&[STOP]).is_none());
        assert!(parse_step(&[]).is_none());
        assert_eq!(wanted_word(Want::None), 2);
    }
}
