//! Work spread over the pool: row-block GEMMs of the trunk's matrices and the task runner
//! every phase uses.

use mxfp4_kernels::{MAX_TOKENS, WeightMatrix};

use super::error::{ModelError, Result};
use super::forward::Model;

/// Smallest matrix whose GEMV is split across the pool.
pub(super) const PARALLEL_MIN_BYTES: usize = 128 << 10;

impl Model<'_> {
    /// `m · x_t` for every token of `xs`, through the batch-invariant GEMM in blocks of
    /// `MAX_TOKENS`: each row is bit-identical to a one-token GEMV.
    pub(super) fn gemm(&self, m: &WeightMatrix<'_>, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .gemm_many(&[m], xs)?
            .pop()
            .expect("one matrix in, one result out"))
    }

    /// `task(0..tasks)` on the pool, task `i` on domain `domain_of(i)`, or all on this thread
    /// when `parallel` is false (work too small to be worth waking workers for); results in
    /// task order either way.
    pub(super) fn run_tasks<T: Send>(
        &self,
        parallel: bool,
        tasks: usize,
        domain_of: impl Fn(usize) -> usize,
        task: impl Fn(usize) -> T + Sync + Send,
    ) -> Result<Vec<T>> {
        if parallel {
            self.pool
                .map_on(tasks, domain_of, task)
                .map_err(|e| ModelError::Pool(e.to_string()))
        } else {
            Ok((0..tasks).map(task).collect())
        }
    }

    /// `m · x_t` for several matrices that read the same inputs, as one list of tasks (one
    /// pool dispatch), each matrix's result `[token][row]`. Row blocks are tasks: every output
    /// row is computed by one task with the same arithmetic as a whole-matrix call, so the
    /// thread count cannot change a bit. Work under `PARALLEL_MIN_BYTES` runs on the calling
    /// thread: waking the pool costs more than it takes.
    pub(super) fn gemm_many(
        &self,
        ms: &[&WeightMatrix<'_>],
        xs: &[Vec<f32>],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let cols = ms[0].cols();
        let total: usize = ms.iter().map(|m| m.weight_bytes()).sum();
        let threads = if total < self.parallel_min_bytes {
            1
        } else {
            self.pool.threads()
        };
        // Each matrix's rows: this rank's share (all of them in one process), split into blocks
        // spread over the domains in order: each domain reads its own rows of every matrix.
        let domains = self.pool.domains();
        let ranks = self.pool.ranks();
        let shares: Vec<std::ops::Range<usize>> =
            ms.iter().map(|m| ranks.share(m.rows())).collect();
        let tasks: Vec<(usize, std::ops::Range<usize>, usize)> = shares
            .iter()
            .enumerate()
            .flat_map(|(k, share)| {
                own_blocks(share.clone(), threads.max(domains), domains)
                    .into_iter()
                    .map(move |(r, d)| (k, r, d))
            })
            .collect();
        // With several ranks, each matrix's share of rows looked up on its own: the resident
        // trunk holds only this rank's rows (packed or requantised where the plan holds them
        // so), which a lookup of the whole matrix misses. Each row's arithmetic is that of
        // the whole matrix's call (the kernels compute rows alone), so the bits do not change.
        let subs = match ranks.size() {
            1 => Vec::new(),
            _ => ms
                .iter()
                .zip(&shares)
                .map(|(m, own)| self.own_rows(m, own.clone()))
                .collect::<Result<Vec<_>>>()?,
        };
        let own: Vec<Option<WeightMatrix<'_>>> = subs
            .iter()
            .map(|s| s.as_ref().map(|s| self.resident_view(s)).transpose())
            .collect::<Result<_>>()?;
        let mut out: Vec<Vec<Vec<f32>>> = ms.iter().map(|_| Vec::with_capacity(xs.len())).collect();
        for block in xs.chunks(MAX_TOKENS) {
            // The kernels run a block of more than 4 tokens in groups over cache-sized stretches
            // of rows (`by_tokens!`), so a block reads each weight from memory once.
            let flat: Vec<f32> = block.iter().flatten().copied().collect();
            let act = self.kernels.prepare(&flat, cols)?;
            let task = |i: usize| -> std::result::Result<Vec<f32>, mxfp4_kernels::Error> {
                let (k, range, _) = &tasks[i];
                let mut y = vec![0.0; range.len() * block.len()];
                match own.get(*k).and_then(Option::as_ref) {
                    Some(m) => {
                        let from = shares[*k].start;
                        self.kernels.matmul(
                            m,
                            &act,
                            range.start - from..range.end - from,
                            &mut y,
                        )?
                    }
                    None => self.kernels.matmul(ms[*k], &act, range.clone(), &mut y)?,
                }
                Ok(y)
            };
            let parts = self.run_tasks(threads > 1, tasks.len(), |i| tasks[i].2, task)?;
            let mut ys: Vec<Vec<Vec<f32>>> = ms
                .iter()
                .map(|m| vec![vec![0.0; m.rows()]; block.len()])
                .collect();
            for ((k, range, _), part) in tasks.iter().zip(parts) {
                let part = part?;
                for (t, row) in ys[*k].iter_mut().enumerate() {
                    row[range.clone()]
                        .copy_from_slice(&part[t * range.len()..(t + 1) * range.len()]);
                }
            }
            if ranks.size() > 1 {
                let mut rows: Vec<Vec<&mut [f32]>> = ys
                    .iter_mut()
                    .map(|y| y.iter_mut().map(Vec::as_mut_slice).collect())
                    .collect();
                self.gather_rows(&mut rows);
            }
            for (o, y) in out.iter_mut().zip(ys) {
                o.extend(y);
            }
        }
        Ok(out)
    }
}

impl Model<'_> {
    /// Rank 0's attention outputs (`tokens` rows of `width`) to every rank: the other ranks
    /// hold no sequence state and pass an empty `rows`.
    pub(super) fn share_attention(&self, rows: &mut Vec<Vec<f32>>, tokens: usize, width: usize) {
        let ranks = self.pool.ranks();
        if ranks.size() == 1 {
            return;
        }
        let mut flat: Vec<f32> = if ranks.is_leader() {
            rows.iter().flatten().copied().collect()
        } else {
            vec![0.0; tokens * width]
        };
        ranks.broadcast(&mut flat);
        *rows = flat.chunks(width.max(1)).map(<[f32]>::to_vec).collect();
    }

    /// Makes rows whole on every rank: `segments[k][t]` is token `t`'s output of segment `k`
    /// (a matrix's full row count long), of which this rank computed its share
    /// ([`numa_sched::Ranks::share`]). One all-gather for all segments; each gathered row is
    /// the bits its rank computed.
    pub(super) fn gather_rows(&self, segments: &mut [Vec<&mut [f32]>]) {
        let ranks = self.pool.ranks();
        if ranks.size() == 1 {
            return;
        }
        let shares: Vec<Vec<std::ops::Range<usize>>> = segments
            .iter()
            .map(|s| ranks.shares(s.first().map_or(0, |row| row.len())))
            .collect();
        self.gather_shares(segments, &shares);
    }

    /// [`Model::gather_rows`] with the shares given: `shares[k][r]` is the part of segment
    /// `k`'s rows rank `r` computed (they tile the row).
    pub(super) fn gather_shares(
        &self,
        segments: &mut [Vec<&mut [f32]>],
        shares: &[Vec<std::ops::Range<usize>>],
    ) {
        let ranks = self.pool.ranks();
        if ranks.size() == 1 {
            return;
        }
        let counts: Vec<usize> = (0..ranks.size())
            .map(|r| {
                segments
                    .iter()
                    .zip(shares)
                    .map(|(s, sh)| s.len() * sh[r].len())
                    .sum()
            })
            .collect();
        let me = ranks.rank();
        let mut mine = Vec::with_capacity(counts[me]);
        for (s, sh) in segments.iter().zip(shares) {
            for row in s {
                mine.extend_from_slice(&row[sh[me].clone()]);
            }
        }
        let all = ranks.all_gather(&mine, &counts);
        let mut at = 0;
        for r in 0..ranks.size() {
            for (s, sh) in segments.iter_mut().zip(shares) {
                for row in s.iter_mut() {
                    let n = sh[r].len();
                    row[sh[r].clone()].copy_from_slice(&all[at..at + n]);
                    at += n;
                }
            }
        }
    }
}

/// This rank's rows `own` of a matrix as row blocks (see [`row_tasks`]), each with the domain
/// it runs on (blocks spread over the domains in order); no empty block.
pub(super) fn own_blocks(
    own: std::ops::Range<usize>,
    threads: usize,
    domains: usize,
) -> Vec<(std::ops::Range<usize>, usize)> {
    if own.is_empty() {
        return Vec::new();
    }
    let blocks = row_tasks(own.len(), threads);
    let n = blocks.len();
    blocks
        .into_iter()
        .enumerate()
        .map(|(j, r)| (r.start + own.start..r.end + own.start, j * domains / n))
        .collect()
}

/// Row ranges for one matrix: about four tasks per worker, in blocks of 64 rows (a multiple
/// of every kernel's row block, so no task runs a needless row tail).
pub(super) fn row_tasks(rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    if threads <= 1 {
        return std::iter::once(0..rows).collect();
    }
    let block = rows.div_ceil(4 * threads).div_ceil(64).max(1) * 64;
    (0..rows.div_ceil(block))
        .map(|i| i * block..((i + 1) * block).min(rows))
        .collect()
}
