//! The MPI side of [`super::Ranks`], through rsmpi over the system's Open MPI or MPICH.
//!
//! Errors inside a collective (a peer that died, a broken link) are MPI's: the default error
//! handler aborts the job, and `mpirun` reports which rank failed and stops the others.

use mpi::Threading;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::error::RanksError;

pub(super) struct Mpi {
    world: SimpleCommunicator,
    /// Kept to the end: dropping it finalises MPI.
    _universe: Universe,
}

// SAFETY: MPI was initialised at MPI_THREAD_SERIALIZED or better (checked in `init`), and
// `Ranks` keeps its `Mpi` behind a mutex, so MPI is called from one thread at a time, which is
// what that level allows; the communicator handle is plain data valid in any thread.
unsafe impl Send for Mpi {}

impl Mpi {
    /// Initialises MPI; returns the backend, this rank, the rank count and `(index, count)`
    /// of the ranks on this host.
    pub(super) fn init() -> Result<(Self, usize, usize, (usize, usize)), RanksError> {
        let (universe, level) =
            mpi::initialize_with_threading(Threading::Serialized).ok_or(RanksError::Init)?;
        if !matches!(level, Threading::Serialized | Threading::Multiple) {
            return Err(RanksError::ThreadLevel {
                got: format!("{level:?}"),
            });
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        let host = world.split_shared(0);
        let local = (host.rank() as usize, host.size() as usize);
        Ok((
            Self {
                world,
                _universe: universe,
            },
            rank,
            size,
            local,
        ))
    }

    pub(super) fn host(&self) -> String {
        mpi::environment::processor_name().unwrap_or_else(|_| "unknown".into())
    }

    pub(super) fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Vec<f32> {
        let total: usize = counts.iter().sum();
        let mut out = vec![0.0f32; total];
        let counts_c: Vec<i32> = counts.iter().map(|&c| count(c)).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0usize, |at, &c| {
                let d = *at;
                *at += c;
                Some(count(d))
            })
            .collect();
        {
            let mut partition = PartitionMut::new(&mut out[..], counts_c, displs);
            self.world.all_gather_varcount_into(mine, &mut partition);
        }
        out
    }

    pub(super) fn broadcast_f32(&self, values: &mut [f32]) {
        self.world.process_at_rank(0).broadcast_into(values);
    }

    pub(super) fn broadcast_words(&self, words: &mut Vec<u64>) {
        let root = self.world.process_at_rank(0);
        let mut len = words.len() as u64;
        root.broadcast_into(&mut len);
        words.resize(len as usize, 0);
        root.broadcast_into(&mut words[..]);
    }

    pub(super) fn gather_words(&self, words: &[u64]) -> Vec<Vec<u64>> {
        let mut all = vec![0u64; words.len() * self.world.size() as usize];
        self.world.all_gather_into(words, &mut all[..]);
        all.chunks(words.len().max(1))
            .map(<[u64]>::to_vec)
            .collect()
    }
}

/// An element count as MPI's `int`; the engine's messages are far below 2^31 elements.
fn count(n: usize) -> i32 {
    i32::try_from(n).expect("a collective of more than 2^31 elements")
}
