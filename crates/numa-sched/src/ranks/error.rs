//! What can go wrong joining the ranks or running a collective between them.

/// Errors of joining or running collectives.
#[derive(Debug, thiserror::Error)]
pub enum RanksError {
    /// `MPI_Init_thread` failed, or MPI was initialised before.
    #[error("MPI could not be initialised (was MPI already initialised in this process?)")]
    Init,
    /// MPI gave less than `MPI_THREAD_SERIALIZED`.
    #[error(
        "MPI gave thread level {got}, but the engine needs MPI_THREAD_SERIALIZED or better (rebuild MPI with thread support)"
    )]
    ThreadLevel {
        /// The level MPI gave, by name.
        got: String,
    },
    /// A feature that does not run across ranks yet was asked for with several.
    #[error("{what} is not supported with several ranks yet (this job has {ranks})")]
    Unsupported {
        /// The feature, in the words of its flag or mode.
        what: &'static str,
        /// The job's rank count.
        ranks: usize,
    },
    /// Something every rank must agree on (a config, a checkpoint's identity) differs.
    #[error(
        "{what} differs between ranks: rank {rank} ({rank_host}) has {theirs}, rank 0 ({leader_host}) has {ours}"
    )]
    Mismatch {
        /// What was compared.
        what: String,
        /// The first rank that differs from rank 0.
        rank: usize,
        /// That rank's host name.
        rank_host: String,
        /// Its value.
        theirs: String,
        /// Rank 0's host name.
        leader_host: String,
        /// Rank 0's value.
        ours: String,
    },
}
