//! Work spread over the pool: row-block GEMMs of the trunk's matrices and the task runner
//! every phase uses.

use mxfp4_kernels::{MAX_TOKENS, WeightMatrix};

use super::{Model, ModelError, Result};

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
        // Each matrix's rows split into blocks, the blocks spread over the domains in order:
        // each domain reads its own rows of every matrix.
        let domains = self.pool.domains();
        let tasks: Vec<(usize, std::ops::Range<usize>, usize)> = ms
            .iter()
            .enumerate()
            .flat_map(|(k, m)| {
                let blocks = row_tasks(m.rows(), threads.max(domains));
                let n = blocks.len();
                blocks
                    .into_iter()
                    .enumerate()
                    .map(move |(j, r)| (k, r, j * domains / n))
            })
            .collect();
        let mut out: Vec<Vec<Vec<f32>>> = ms.iter().map(|_| Vec::with_capacity(xs.len())).collect();
        for block in xs.chunks(MAX_TOKENS) {
            // The kernels run a block of more than 4 tokens in groups over cache-sized stretches
            // of rows (`by_tokens!`), so a block reads each weight from memory once.
            let flat: Vec<f32> = block.iter().flatten().copied().collect();
            let act = self.kernels.prepare(&flat, cols)?;
            let task = |i: usize| -> std::result::Result<Vec<f32>, mxfp4_kernels::Error> {
                let (k, range, _) = &tasks[i];
                let mut y = vec![0.0; range.len() * block.len()];
                self.kernels.matmul(ms[*k], &act, range.clone(), &mut y)?;
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
            for (o, y) in out.iter_mut().zip(ys) {
                o.extend(y);
            }
        }
        Ok(out)
    }
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
