//! What the other ranks hold of a sequence. Under several ranks every rank computes its share
//! of the MLA heads (issue 35), so every rank needs each sequence's latent cache: the ranks
//! other than 0 keep a mirror of it, under an id rank 0 gives the sequence at its first step.
//! Rank 0 tracks, in the sequence's [`MirrorTag`], how many positions the mirrors hold; each
//! step announces every sequence's id and position, so a mirror that is ahead (the sequence
//! was rolled back or reset) is truncated, and a sequence the mirrors do not hold (new, or
//! restored from a snapshot) is sent whole once. The cache rows are appended by the same code
//! from the same gathered projections on every rank, so a mirror is the bits of rank 0's
//! cache. A dropped sequence's id goes to the next step's announcement, and its mirrors go.
//!
//! KDA states stay on rank 0 (their size does not grow with the context; issue 35's note).

use std::sync::{Arc, Mutex};

/// Ids of dropped sequences whose mirrors the other ranks still hold.
pub(super) type Gone = Arc<Mutex<Vec<u64>>>;

/// A sequence's standing with the other ranks (rank 0's side). A copy of a session is a new
/// sequence to them (no id, nothing held); dropping one that they hold queues its id.
#[derive(Debug, Default)]
pub(super) struct MirrorTag {
    /// The id the other ranks know this sequence by; 0 until its first step.
    pub(super) id: u64,
    /// Positions of its MLA caches the other ranks hold; `None`: nothing.
    pub(super) held: Option<usize>,
    /// Where its id goes when it is dropped or forgotten.
    pub(super) gone: Option<Gone>,
}

impl Clone for MirrorTag {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl Drop for MirrorTag {
    fn drop(&mut self) {
        if self.held.is_some()
            && let Some(gone) = &self.gone
        {
            gone.lock().unwrap_or_else(|p| p.into_inner()).push(self.id);
        }
    }
}

impl MirrorTag {
    /// The other ranks' copy no longer matches (the session was overwritten): their mirror
    /// goes with the next step, and the sequence is sent whole at its next step.
    pub(super) fn forget(&mut self) {
        *self = Self::default();
    }
}

/// One sequence of a step, as the other ranks need it: its id, its position before the step,
/// and whether rank 0 sends its caches whole first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Standing {
    pub(super) id: u64,
    pub(super) position: usize,
    pub(super) send: bool,
}

impl Standing {
    /// Rank 0's view of `tag` for a step starting at `position`: an id given if it has none
    /// (`next` counts them out), and whether the mirrors need the caches sent (they hold
    /// nothing, or fewer positions than the session has: never for a session only stepped
    /// and rolled back).
    pub(super) fn of(
        tag: &mut MirrorTag,
        position: usize,
        next: &std::sync::atomic::AtomicU64,
        gone: &Gone,
    ) -> Self {
        if tag.id == 0 {
            tag.id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tag.gone = Some(Arc::clone(gone));
        }
        Standing {
            id: tag.id,
            position,
            send: tag.held.is_none_or(|held| held < position),
        }
    }
}

/// `count` heads as `ranks` contiguous shares, the larger first: rank `rank`'s share.
pub(super) fn head_share(count: usize, ranks: usize, rank: usize) -> std::ops::Range<usize> {
    let base = count / ranks;
    let extra = count % ranks;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn head_shares_tile_the_heads() {
        for count in [1, 7, 8, 96] {
            for ranks in 1..=5 {
                let shares: Vec<_> = (0..ranks).map(|r| head_share(count, ranks, r)).collect();
                assert_eq!(shares[0].start, 0);
                assert_eq!(shares[ranks - 1].end, count);
                for pair in shares.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                    assert!(pair[0].len() >= pair[1].len());
                }
            }
        }
        assert_eq!(head_share(96, 3, 1), 32..64);
        assert_eq!(head_share(7, 3, 0), 0..3);
    }

    #[test]
    fn a_held_sequence_is_queued_when_dropped_and_a_copy_is_new() {
        let gone: Gone = Arc::default();
        let next = AtomicU64::new(1);
        let mut tag = MirrorTag::default();
        let first = Standing::of(&mut tag, 0, &next, &gone);
        assert_eq!((first.id, first.send), (1, true));
        tag.held = Some(5);
        // Rolled back to 3: the mirrors truncate, nothing is sent.
        assert!(!Standing::of(&mut tag, 3, &next, &gone).send);
        let copy = tag.clone();
        assert_eq!((copy.id, copy.held), (0, None));
        drop(copy);
        assert!(
            gone.lock().unwrap().is_empty(),
            "an unheld copy queues nothing"
        );
        tag.forget();
        assert_eq!(*gone.lock().unwrap(), vec![1]);
        let again = Standing::of(&mut tag, 3, &next, &gone);
        assert_eq!((again.id, again.send), (2, true));
        tag.held = Some(4);
        drop(tag);
        assert_eq!(*gone.lock().unwrap(), vec![1, 2]);
    }
}
