//! Whether the packed trunk is faster than the stored one on the machine at hand, measured at
//! startup with every worker busy: both GEMVs streaming from memory, each worker its rows of
//! a matrix larger than the last-level cache, the way a decode streams the trunk
//! (`--no-pack-trunk` skips it). Their in-cache rates (each kernel's compute ceiling per core)
//! and each core's share of the all-core read rate are printed beside them.
//!
//! A GEMV over BF16 reads 2 bytes per weight, over packed BF16 49/32, and the packed decode
//! costs more arithmetic per weight. On a 2-core slice of a Zen 4 a core reads 15-25 GB/s and
//! the two come out close; on a server sharing 12 channels over 96 cores a core reads
//! 3-7 GB/s, and the packed trunk's fewer bytes win. So it is measured, not named by the tier.
//! An earlier rule predicted the from-memory rates from the in-cache ones and the read share
//! (`bytes / read + 1 / compute` per weight, assuming no overlap): once the packed kernel
//! prefetched per row it overlapped its decode with its loads, and that rule kept the stored
//! trunk where the packed one streamed 1.1x the weights per second (PERFORMANCE.md,
//! phase 29).

use std::hint::black_box;
use std::time::{Duration, Instant};

use mxfp4_kernels::codes::f32_to_bf16;
use mxfp4_kernels::{Bf16Matrix, Kernels, PackedBf16, PackedBf16Matrix, WeightMatrix};
use numa_sched::Pool;

/// The in-cache test matrix's BF16 bytes: in a core's L2, so the GEMV runs at its compute
/// ceiling. Its columns are the model's hidden size (most trunk matrices' width: the kernels
/// keep copies compiled for K3's widths, and a 4096-wide BF16 GEMV ran at half the 7168-wide
/// one's rate).
const MATRIX_BYTES: usize = 448 << 10;
/// The streamed matrix's BF16 bytes (its packed twin is 0.77x that): the in-cache matrix's
/// rows repeated, larger than the last-level caches of most sockets, so every worker streams
/// its rows from memory.
const STREAM_BYTES: usize = 256 << 20;
/// How long each worker runs each kernel per round.
const RUN: Duration = Duration::from_millis(25);
/// The read buffer over all workers: larger than the last-level caches of most sockets.
const READ_BYTES: usize = 512 << 20;
/// The packed trunk is taken where it streams more than 1 / this of the stored one's weights
/// per second (the two GEMVs' measured rates move by a few percent from run to run).
const MARGIN: f64 = 0.97;

/// What was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PackedRate {
    /// BF16 GEMV in cache, weights per second per core, every worker running it.
    pub(super) bf16: f64,
    /// Packed BF16 GEMV in cache, likewise.
    pub(super) packed: f64,
    /// BF16 GEMV from memory, weights per second per core, every worker streaming its rows.
    pub(super) bf16_stream: f64,
    /// Packed BF16 GEMV from memory, likewise.
    pub(super) packed_stream: f64,
    /// Bytes per second per core, every worker reading its part of [`READ_BYTES`].
    pub(super) read: f64,
    /// Workers.
    pub(super) workers: usize,
}

impl PackedRate {
    /// Runs the measurements on every worker of `pool` (about 0.5 s, and 0.45 GB held while
    /// it runs), the GEMVs over `hidden` columns (rounded up to whole blocks).
    pub(super) fn measure(kernels: &Kernels, pool: &Pool, hidden: usize) -> Result<Self, String> {
        let workers = pool.threads().max(1);
        let cols = hidden
            .max(1)
            .next_multiple_of(mxfp4_kernels::packed::PACKED_BLOCK);
        let rows = (MATRIX_BYTES / (2 * cols)).clamp(8, 256);
        // Weights like a trained matrix's: magnitudes over a few binades (so no block needs
        // an exception, and the repeated rows below need no exception index), both signs.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut bf16 = Vec::with_capacity(2 * rows * cols);
        for _ in 0..rows * cols {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            let sign = if state >> 63 == 1 { -1.0 } else { 1.0 };
            let value = sign * (0.002 + 0.05 * unit);
            bf16.extend_from_slice(&f32_to_bf16(value).to_le_bytes());
        }
        let packed = PackedBf16::pack(&bf16, rows, cols).map_err(|e| e.to_string())?;
        if packed.exception_count() != 0 {
            return Err("the test matrix packed with exception blocks".into());
        }
        let plain = Bf16Matrix::new(&bf16, rows, cols).map_err(|e| e.to_string())?;
        let x: Vec<f32> = (0..cols).map(|c| (c % 7) as f32 * 0.25 - 0.75).collect();
        let act = kernels.prepare(&x, cols).map_err(|e| e.to_string())?;
        // Each worker runs `matrix`'s GEMV for `RUN` over all `rows` rows (in cache), or over
        // its share of them (`split`, streaming): weights per second per core, the mean over
        // the workers.
        let rate = |matrix: WeightMatrix<'_>, rows: usize, split: bool| -> Result<f64, String> {
            let per_worker = pool
                .map(workers, |w| {
                    // Rows outnumber workers where split (`big_rows` is thousands), so no
                    // share is empty.
                    let mine = match split {
                        true => rows * w / workers..rows * (w + 1) / workers,
                        false => 0..rows,
                    };
                    let mut out = vec![0.0f32; mine.len()];
                    let (started, mut weights) = (Instant::now(), 0usize);
                    while started.elapsed() < RUN {
                        kernels
                            .matmul(&matrix, &act, mine.clone(), &mut out)
                            .expect("the shapes were checked");
                        black_box(&out);
                        weights += mine.len() * cols;
                    }
                    weights as f64 / started.elapsed().as_secs_f64()
                })
                .map_err(|e| e.to_string())?;
            Ok(per_worker.iter().sum::<f64>() / workers as f64)
        };
        let bf16_rate = rate(plain.into(), rows, false)?;
        let packed_rate = rate(packed.view().into(), rows, false)?;
        // From memory: the small matrix's rows repeated (both forms), each worker its rows;
        // two rounds alternated, so a drift of the host's read rate weighs on both alike.
        let copies = (STREAM_BYTES / bf16.len()).max(1);
        let big_rows = copies * rows;
        let big_bf16 = bf16.repeat(copies);
        let big_body = packed.view().body().repeat(copies);
        let index = vec![0u32; big_rows + 1];
        let big_plain = Bf16Matrix::new(&big_bf16, big_rows, cols).map_err(|e| e.to_string())?;
        let big_packed = PackedBf16Matrix::new(&big_body, &[], &index, big_rows, cols)
            .map_err(|e| e.to_string())?;
        let (mut bf16_stream, mut packed_stream) = (0.0, 0.0);
        for _ in 0..2 {
            bf16_stream += rate(big_plain.into(), big_rows, true)? / 2.0;
            packed_stream += rate(big_packed.into(), big_rows, true)? / 2.0;
        }
        drop((big_bf16, big_body, index));
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
            bf16_stream,
            packed_stream,
            read: read.iter().sum::<f64>() / workers as f64,
            workers,
        })
    }

    /// Whether the packed trunk is faster here: it streams more weights per second from
    /// memory, by more than the margin.
    pub(super) fn packed_faster(&self) -> bool {
        MARGIN * self.packed_stream > self.bf16_stream
    }

    /// The measurement and the choice, in a line.
    pub(super) fn describe(&self) -> String {
        let gw = |w: f64| w / 1e9;
        format!(
            "packed trunk: per core, with {} workers busy, from memory: BF16 GEMV {:.1} G \
             weights/s, packed {:.1} ({:.2}x; in cache {:.1} and {:.1}, a read share of {:.1} \
             GB/s): {}",
            self.workers,
            gw(self.bf16_stream),
            gw(self.packed_stream),
            self.packed_stream / self.bf16_stream,
            gw(self.bf16),
            gw(self.packed),
            self.read / 1e9,
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

    /// The choice follows the streamed rates: the packed trunk where it streams more
    /// weights per second than the stored one beyond the margin, the stored one on a tie.
    #[test]
    fn the_choice_is_the_faster_stream() {
        let rate = |bf16_stream: f64, packed_stream: f64| PackedRate {
            bf16: 30e9,
            packed: 18e9,
            bf16_stream: bf16_stream * 1e9,
            packed_stream: packed_stream * 1e9,
            read: 16e9,
            workers: 2,
        };
        // A 2-core Zen 4 slice after phase 29: 7.2 against 8.0 G weights/s per core.
        assert!(rate(7.2, 8.0).packed_faster());
        // A busy server socket, 5 GB/s per core: 0.77x the bytes.
        assert!(rate(2.5, 3.2).packed_faster());
        // A packed decode that cannot keep up with the read: stored.
        assert!(!rate(8.0, 6.0).packed_faster());
        // Within the margin: stored.
        assert!(!rate(8.0, 8.1).packed_faster());
        assert!(rate(7.2, 8.0).describe().contains("(1.11x;"));
    }

    /// The measurement runs on a real pool and gives positive rates.
    #[test]
    fn a_measurement_gives_rates() {
        let pool = Pool::new(2).unwrap();
        let rate = PackedRate::measure(&Kernels::detect(), &pool, 1000).unwrap();
        assert!(
            rate.bf16 > 0.0
                && rate.packed > 0.0
                && rate.bf16_stream > 0.0
                && rate.packed_stream > 0.0
                && rate.read > 0.0,
            "{rate:?}"
        );
        assert!(rate.describe().starts_with("packed trunk: per core"));
    }
}
