//! The crate's error: a pool that cannot start, and a task that panicked or named no domain.

/// Errors of pool construction and of tasks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A pool of zero workers was asked for.
    #[error("a pool needs at least one thread")]
    NoThreads,
    /// rayon could not start a domain's workers (its message).
    #[error("could not start the worker pool: {0}")]
    Start(String),
    /// A task panicked; the pool stays usable.
    #[error("task {task} (domain {domain}) panicked: {message}")]
    TaskPanicked {
        /// The task's index in its `map_on` call.
        task: usize,
        /// The domain it ran on.
        domain: usize,
        /// The panic's message (or a note that the payload was not a string).
        message: String,
    },
    /// A task was tagged with a domain the pool does not have.
    #[error("task {task} was tagged with domain {domain}, but the pool has {domains}")]
    NoDomain {
        /// The task's index in its `map_on` call.
        task: usize,
        /// The domain it was tagged with.
        domain: usize,
        /// The pool's domain count.
        domains: usize,
    },
}
