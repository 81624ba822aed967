//! Ranks: processes, usually on different hosts, as the outermost domains. Each rank owns a
//! contiguous share of every row-split matrix ([`Ranks::share`]), computes those rows, and the
//! rows meet again through collectives ([`Ranks::all_gather`], [`Ranks::broadcast`]).
//!
//! Without the `mpi` feature, or outside `mpirun`, there is one rank and every collective is a
//! copy. With it, `Ranks::mpi` joins the job `mpirun` started (MPI's own environment says
//! which rank this is; no flag). Collectives never reduce: a gathered row is the bits one rank
//! computed, so results cannot depend on the number of ranks.
//!
//! MPI calls are made by one thread at a time: every collective takes the [`Ranks`]' lock,
//! and MPI is initialised at `MPI_THREAD_SERIALIZED` or better (refused otherwise).

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

mod error;
#[cfg(feature = "mpi")]
mod mpi_backend;

pub use error::RanksError;

/// Rows of a share start at a multiple of this (the kernels' largest row block), so a rank's
/// row tasks are the blocks a single process would run.
pub const SHARE_ALIGN: usize = 64;

/// Collectives made so far by this rank: calls, bytes it sent plus received, time inside.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CollectiveStats {
    /// Collective calls.
    pub calls: u64,
    /// Bytes this rank sent plus received.
    pub bytes: u64,
    /// Wall time inside the calls (waiting for the other ranks included).
    pub seconds: f64,
}

impl CollectiveStats {
    /// `self - earlier`: the collectives made in between.
    pub fn since(&self, earlier: &CollectiveStats) -> CollectiveStats {
        CollectiveStats {
            calls: self.calls - earlier.calls,
            bytes: self.bytes - earlier.bytes,
            seconds: self.seconds - earlier.seconds,
        }
    }
}

enum Backend {
    Single,
    #[cfg(feature = "mpi")]
    Mpi(mpi_backend::Mpi),
}

/// This process's place among the ranks of one engine, and the collectives between them.
pub struct Ranks {
    rank: usize,
    size: usize,
    /// Ranks on this host, and this one's index among them (for sharing the host's CPUs).
    local: (usize, usize),
    host: String,
    backend: Mutex<Backend>,
    /// Held for a whole step of collectives (see [`Ranks::lock_steps`]).
    steps: Mutex<()>,
    calls: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("host", &self.host)
            .finish()
    }
}

impl Default for Ranks {
    fn default() -> Self {
        Self::single()
    }
}

impl Ranks {
    /// One process: rank 0 of 1; collectives are copies.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local: (0, 1),
            host: host_name(),
            backend: Mutex::new(Backend::Single),
            steps: Mutex::new(()),
            calls: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    /// Joins the MPI job this process was started in (`mpirun -np N ...`; a process started
    /// alone is rank 0 of 1). MPI is finalised when the `Ranks` is dropped.
    #[cfg(feature = "mpi")]
    pub fn mpi() -> Result<Self, RanksError> {
        let (backend, rank, size, local) = mpi_backend::Mpi::init()?;
        Ok(Self {
            rank,
            size,
            local,
            host: backend.host(),
            backend: Mutex::new(Backend::Mpi(backend)),
            steps: Mutex::new(()),
            calls: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        })
    }

    /// This process's ranks, as built: with the `mpi` feature the MPI job it was started in
    /// (`Ranks::mpi`; a process started alone is rank 0 of 1), else [`Ranks::single`].
    pub fn join() -> Result<Self, RanksError> {
        #[cfg(feature = "mpi")]
        return Self::mpi();
        #[cfg(not(feature = "mpi"))]
        Ok(Self::single())
    }

    /// This process's rank, 0-based.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in all.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Rank 0: the one that holds sequences, samples and talks to clients.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }

    /// `(index, count)` of the ranks on this host.
    pub fn local(&self) -> (usize, usize) {
        self.local
    }

    /// The host's name as MPI (or the kernel) reports it.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The rows of a `rows`-row matrix this rank owns.
    pub fn share(&self, rows: usize) -> Range<usize> {
        share(rows, self.size, self.rank)
    }

    /// Every rank's share of `rows` rows, in rank order (they tile `0..rows`).
    pub fn shares(&self, rows: usize) -> Vec<Range<usize>> {
        (0..self.size).map(|r| share(rows, self.size, r)).collect()
    }

    /// Takes the step lock: a caller that makes a sequence of collectives the other ranks
    /// must see in the same order (one forward step) holds it throughout, so two threads of
    /// this rank cannot interleave theirs.
    pub fn lock_steps(&self) -> std::sync::MutexGuard<'_, ()> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Collectives so far.
    pub fn stats(&self) -> CollectiveStats {
        CollectiveStats {
            calls: self.calls.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    fn counted<T>(&self, bytes: usize, f: impl FnOnce(&mut Backend) -> T) -> T {
        let mut backend = self.backend.lock().unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        let out = f(&mut backend);
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        out
    }

    /// All-gather: rank `r` contributes `mine` (`counts[r]` values); every rank gets the
    /// contributions concatenated in rank order.
    pub fn all_gather(&self, mine: &[f32], counts: &[usize]) -> Vec<f32> {
        assert_eq!(counts.len(), self.size, "one count per rank");
        assert_eq!(mine.len(), counts[self.rank], "this rank's count");
        if self.size == 1 {
            return mine.to_vec();
        }
        let total: usize = counts.iter().sum();
        self.counted(4 * total, |backend| match backend {
            Backend::Single => unreachable!("one rank returned above"),
            #[cfg(feature = "mpi")]
            Backend::Mpi(m) => m.all_gather_f32(mine, counts),
        })
    }

    /// Rank 0's `values` to every rank (the others' `values` are overwritten; every rank
    /// passes a slice of the same length).
    pub fn broadcast(&self, values: &mut [f32]) {
        if self.size == 1 {
            return;
        }
        self.counted(4 * values.len(), |backend| match backend {
            Backend::Single => unreachable!("one rank returned above"),
            #[cfg(feature = "mpi")]
            Backend::Mpi(m) => m.broadcast_f32(values),
        })
    }

    /// Rank 0's `words` to every rank, whatever length the others passed.
    pub fn broadcast_words(&self, words: &mut Vec<u64>) {
        if self.size == 1 {
            return;
        }
        self.counted(8 * (words.len() + 1), |backend| match backend {
            Backend::Single => unreachable!("one rank returned above"),
            #[cfg(feature = "mpi")]
            Backend::Mpi(m) => m.broadcast_words(words),
        })
    }

    /// Every rank's `words` (all the same length), in rank order.
    pub fn gather_words(&self, words: &[u64]) -> Vec<Vec<u64>> {
        if self.size == 1 {
            return vec![words.to_vec()];
        }
        self.counted(8 * words.len() * self.size, |backend| match backend {
            Backend::Single => unreachable!("one rank returned above"),
            #[cfg(feature = "mpi")]
            Backend::Mpi(m) => m.gather_words(words),
        })
    }

    /// Every rank's host name, in rank order.
    pub fn hosts(&self) -> Vec<String> {
        let mut name = [0u64; 8];
        for (w, chunk) in name.iter_mut().zip(self.host.as_bytes().chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        self.gather_words(&name)
            .into_iter()
            .map(|words| {
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                String::from_utf8_lossy(&bytes)
                    .trim_end_matches('\0')
                    .to_string()
            })
            .collect()
    }

    /// Checks that every rank has the same `value` of `what` (say, a checkpoint's size and
    /// header hash); a rank that differs is named with both values.
    pub fn agree(&self, what: &str, value: &[u64]) -> Result<(), RanksError> {
        let all = self.gather_words(value);
        let hosts = self.hosts();
        let show = |v: &[u64]| {
            v.iter()
                .map(|w| format!("{w:#x}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        match all.iter().position(|v| v != &all[0]) {
            None => Ok(()),
            Some(rank) => Err(RanksError::Mismatch {
                what: what.to_string(),
                rank,
                rank_host: hosts[rank].clone(),
                theirs: show(&all[rank]),
                leader_host: hosts[0].clone(),
                ours: show(&all[0]),
            }),
        }
    }
}

/// Rank `rank`'s rows of a `rows`-row matrix split over `size` ranks: contiguous, in rank
/// order, starts at multiples of [`SHARE_ALIGN`] (so a rank may own none of a small matrix).
pub fn share(rows: usize, size: usize, rank: usize) -> Range<usize> {
    let bound = |r: usize| {
        if r >= size {
            rows
        } else {
            (rows * r / size) / SHARE_ALIGN * SHARE_ALIGN
        }
    };
    bound(rank)..bound(rank + 1)
}

/// `(index, count)` of CPUs: the `index`-th of `count` contiguous shares of `cpus` (at least
/// one CPU each: with more shares than CPUs they wrap around).
pub fn cpu_share(cpus: &[usize], index: usize, count: usize) -> Vec<usize> {
    if cpus.is_empty() || count <= 1 {
        return cpus.to_vec();
    }
    let from = cpus.len() * index / count;
    let to = cpus.len() * (index + 1) / count;
    if to > from {
        cpus[from..to].to_vec()
    } else {
        vec![cpus[index % cpus.len()]]
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_tile_the_rows_in_order_aligned() {
        for rows in [0, 1, 63, 64, 100, 1024, 7168, 163_840] {
            for size in 1..=5 {
                let parts: Vec<_> = (0..size).map(|r| share(rows, size, r)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[size - 1].end, rows);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "{rows} rows over {size}");
                }
                for p in &parts {
                    assert!(p.start % SHARE_ALIGN == 0 || p.start == rows);
                }
                // Large matrices split evenly up to one alignment block.
                if rows >= 1024 {
                    for p in &parts {
                        assert!(
                            p.len() + SHARE_ALIGN >= rows / size,
                            "{p:?} of {rows}/{size}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_single_rank_copies() {
        let ranks = Ranks::single();
        assert_eq!(ranks.all_gather(&[1.0, 2.0], &[2]), vec![1.0, 2.0]);
        let mut v = vec![3.0];
        ranks.broadcast(&mut v);
        assert_eq!(v, vec![3.0]);
        assert!(ranks.agree("checkpoint", &[1, 2]).is_ok());
        assert_eq!(ranks.stats(), CollectiveStats::default());
        assert_eq!(ranks.share(1000), 0..1000);
    }

    #[test]
    fn cpu_shares_split_a_host() {
        let cpus = [0, 1, 2, 3];
        assert_eq!(cpu_share(&cpus, 0, 2), vec![0, 1]);
        assert_eq!(cpu_share(&cpus, 1, 2), vec![2, 3]);
        assert_eq!(cpu_share(&cpus, 2, 3), vec![2, 3]);
        assert_eq!(cpu_share(&[0, 1], 0, 3), vec![0]);
        assert_eq!(cpu_share(&[0, 1], 2, 3), vec![1]);
        assert_eq!(cpu_share(&[0, 1], 0, 1), vec![0, 1]);
    }
}
