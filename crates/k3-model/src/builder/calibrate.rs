//! Whether the packed trunk is faster than the stored one on the machine at hand, measured at
//! startup with every worker busy: each kernel's weights per second per core (in cache: its
//! compute ceiling) against each core's share of the all-core read rate (`--no-pack-trunk`
//! skips it).
//!
//! A GEMV over BF16 reads 2 bytes per weight, over packed BF16 49/32. With every core
//! streaming, a core gets `read` bytes per second, and a weight costs `bytes / read +
//! 1 / compute` seconds: the sum, not the larger, because a core's loads and its decode share
//! its issue slots and neither hides the other fully. That is what the Zen 4 figures
//! show (2 threads: 18 GB/s of read per core, 27.5 and 12.4 G weights/s in cache predict 6.8
//! and 6.0 G weights/s from memory; measured 6.3 and 5.8). The packed trunk wins where its
//! decode costs less than the quarter of the bytes it saves. On a 2-core slice of a Zen 4 a core reads 15-25 GB/s and the packed decode computes
//! about as fast as the BF16 read; on a server sharing 12 channels over 96 cores a core reads
//! 3-7 GB/s, and the packed trunk's fewer bytes win. So it is measured, not named by the tier.

use std::hint::black_box;
use std::time::{Duration, Instant};

use mxfp4_kernels::codes::f32_to_bf16;
use mxfp4_kernels::{Bf16Matrix, Kernels, PackedBf16, WeightMatrix};
use numa_sched::Pool;

/// Bytes per weight of the packed form (49 per block of 32).
const PACKED_BYTES: f64 =
    mxfp4_kernels::packed::PACKED_BLOCK_BYTES as f64 / mxfp4_kernels::packed::PACKED_BLOCK as f64;
/// The test matrix's BF16 bytes: in a core's L2, so the GEMV runs at its compute ceiling. Its
/// columns are the model's hidden size (most trunk matrices' width: the kernels keep copies
/// compiled for K3's widths, and a 4096-wide BF16 GEMV ran at half the 7168-wide one's rate).
const MATRIX_BYTES: usize = 448 << 10;
/// How long each worker runs each kernel.
const RUN: Duration = Duration::from_millis(25);
/// The read buffer over all workers: larger than the last-level caches of most sockets.
const READ_BYTES: usize = 512 << 20;
/// The packed trunk is taken where a weight costs less than this share of the stored one's
/// (the two GEMVs' measured rates move by a few percent from run to run).
const MARGIN: f64 = 0.97;

/// What was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PackedRate {
    /// BF16 GEMV, weights per second per core, every worker running it.
    pub(super) bf16: f64,
    /// Packed BF16 GEMV, likewise.
    pub(super) packed: f64,
    /// Bytes per second per core, every worker reading its part of [`READ_BYTES`].
    pub(super) read: f64,
    /// Workers.
    pub(super) workers: usize,
}

impl PackedRate {
    /// Runs the three measurements on every worker of `pool` (about 0.2 s), the GEMVs over
    /// `hidden` columns (rounded up to whole blocks).
    pub(super) fn measure(kernels: &Kernels, pool: &Pool, hidden: usize) -> Result<Self, String> {
        let workers = pool.threads().max(1);
        let cols = hidden
            .max(1)
            .next_multiple_of(mxfp4_kernels::packed::PACKED_BLOCK);
        let rows = (MATRIX_BYTES / (2 * cols)).clamp(8, 256);
        // Weights like a trained matrix's: magnitudes over a few binades, both signs.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut bf16 = Vec::with_capacity(2 * rows * cols);
        for _ in 0..rows * cols {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            let value = (unit - 0.5) * 0.05;
            bf16.extend_from_slice(&f32_to_bf16(value).to_le_bytes());
        }
        let packed = PackedBf16::pack(&bf16, rows, cols).map_err(|e| e.to_string())?;
        let plain = Bf16Matrix::new(&bf16, rows, cols).map_err(|e| e.to_string())?;
        let x: Vec<f32> = (0..cols).map(|c| (c % 7) as f32 * 0.25 - 0.75).collect();
        let act = kernels.prepare(&x, cols).map_err(|e| e.to_string())?;
        let rate = |matrix: WeightMatrix<'_>| -> Result<f64, String> {
            let per_worker = pool
                .map(workers, |_| {
                    let mut out = vec![0.0f32; rows];
                    let (started, mut weights) = (Instant::now(), 0usize);
                    while started.elapsed() < RUN {
                        kernels
                            .matmul(&matrix, &act, 0..rows, &mut out)
                            .expect("the shapes were checked");
                        black_box(&out);
                        weights += rows * cols;
                    }
                    weights as f64 / started.elapsed().as_secs_f64()
                })
                .map_err(|e| e.to_string())?;
            Ok(per_worker.iter().sum::<f64>() / workers as f64)
        };
        let bf16_rate = rate(plain.into())?;
        let packed_rate = rate(packed.view().into())?;
        // Each worker's part of the read buffer, written (so placed) by that worker, then
        // read twice: the second read is timed.
        let words = (READ_BYTES / workers / 8).max(1 << 20);
        let read = pool
            .map(workers, |_| {
                let buffer = vec![1u64; words];
                let sum = |buffer: &[u64]| {
                    let mut lanes = [0u64; 8];
                    for chunk in buffer.chunks_exact(8) {
                        for (lane, &w) in lanes.iter_mut().zip(chunk) {
                            *lane = lane.wrapping_add(w);
                        }
                    }
                    black_box(lanes);
                };
                sum(&buffer);
                let started = Instant::now();
                sum(&buffer);
                (8 * words) as f64 / started.elapsed().as_secs_f64()
            })
            .map_err(|e| e.to_string())?;
        Ok(Self {
            bf16: bf16_rate,
            packed: packed_rate,
            read: read.iter().sum::<f64>() / workers as f64,
            workers,
        })
    }

    /// Seconds per weight of a GEMV streaming `bytes` per weight at `compute` weights per
    /// second, each core reading at [`Self::read`].
    fn cost(&self, bytes: f64, compute: f64) -> f64 {
        bytes / self.read + 1.0 / compute
    }

    /// Whether the packed trunk is faster here.
    pub(super) fn packed_faster(&self) -> bool {
        self.cost(PACKED_BYTES, self.packed) < MARGIN * self.cost(2.0, self.bf16)
    }

    /// The measurement and the choice, in a line.
    pub(super) fn describe(&self) -> String {
        let gw = |w: f64| w / 1e9;
        format!(
            "packed trunk: per core, with {} workers busy: BF16 GEMV {:.1} G weights/s, packed \
             {:.1}, a read share of {:.1} GB/s (BF16 {:.1} G weights/s from memory, packed \
             {:.1}): {}",
            self.workers,
            gw(self.bf16),
            gw(self.packed),
            self.read / 1e9,
            gw(1.0 / self.cost(2.0, self.bf16)),
            gw(1.0 / self.cost(PACKED_BYTES, self.packed)),
            match self.packed_faster() {
                true => "the packed trunk is faster here, so the trunk is held packed",
                false => "the stored trunk is as fast here, so it is read as stored",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The choice follows the costs: compute-bound packed loses to a memory-bound BF16 on a
    /// fast read share, and wins on a slow one; the margin keeps a tie stored.
    #[test]
    fn the_choice_is_the_cheaper_weight() {
        let rate = |bf16: f64, packed: f64, read: f64| PackedRate {
            bf16: bf16 * 1e9,
            packed: packed * 1e9,
            read: read * 1e9,
            workers: 2,
        };
        // A 2-core Zen 4 slice: 27 G/s BF16 and 12 G/s packed in cache, 20 GB/s per core.
        assert!(!rate(27.0, 12.0, 20.0).packed_faster());
        // A busy server socket: 5 GB/s per core.
        assert!(rate(27.0, 12.0, 5.0).packed_faster());
        // Both decodes cheap (Zen 5's packed decode): 0.77x the bytes wins.
        assert!(rate(100.0, 100.0, 20.0).packed_faster());
        // A packed decode as slow as the saved bytes: within the margin, stored.
        assert!(!rate(100.0, 30.0, 20.0).packed_faster());
    }

    /// The measurement runs on a real pool and gives positive rates.
    #[test]
    fn a_measurement_gives_rates() {
        let pool = Pool::new(2).unwrap();
        let rate = PackedRate::measure(&Kernels::detect(), &pool, 1000).unwrap();
        assert!(
            rate.bf16 > 0.0 && rate.packed > 0.0 && rate.read > 0.0,
            "{rate:?}"
        );
        assert!(rate.describe().starts_with("packed trunk: per core"));
    }
}
