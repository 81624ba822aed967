//! Software prefetch of the weight stream: the MXFP4 and packed kernels stream the next row
//! block as one sequential window while this one computes (`prefetch_step`, `prefetch_ahead`,
//! the `avx2` tier's `Prefetch`); the AVX-512 BF16 kernels prefetch per row
//! (`bf16_prefetch_offset`), and the `avx512` packed kernel likewise
//! (`packed_prefetch_offset`). All need only sse (`prefetcht0`), so every x86 tier calls them
//! (`Prefetch::step` is compiled for the `avx2` tier, its only user).

use core::arch::x86_64::*;
use std::ops::Range;

/// Prefetches step `step` of `steps` of a row block `PREFETCH_AHEAD` bytes (rounded up to
/// whole blocks) past the block that starts at `start` and spans `window` bytes. A row block
/// of a matrix is one contiguous window (rows are contiguous), so this is one sequential
/// prefetch stream running ahead of the demand loads whatever the row length: short MXFP4
/// rows (1.5-1.8 KB) end before a per-row prefetcher ramps up.
///
/// Needs only sse (`prefetcht0`), so the AVX2 tier calls it too.
#[target_feature(enable = "sse")]
#[inline]
pub(crate) fn prefetch_ahead(start: *const u8, window: usize, step: usize, steps: usize) {
    let ahead = prefetch_distance(window);
    let lines = window.div_ceil(64);
    for line in lines * step / steps..lines * (step + 1) / steps {
        // Prefetch hint only: it never faults, so an address past the matrix is harmless.
        _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(ahead + 64 * line).cast());
    }
}

/// A row block's stream in fixed steps: a kernel that walks a block of rows in equal steps of
/// `step_bytes` (a value block or group of each of its rows) prefetches at step `step` the
/// lines from `start + ahead + step * step_bytes`, `step_bytes` rounded up to whole lines, so
/// the steps cover the window `ahead` bytes on in order (a line at most missed at a step's end
/// is the next step's first). The row blocks of a range are one contiguous window, so this
/// streams the next row block while this one computes. No division and no data-dependent trip
/// count: `prefetch_ahead`'s two divisions per step, and `Prefetch`'s count of the lines
/// up to each step's exact end, cost the packed kernels a third of their rate in cache
/// (PERFORMANCE.md, phase 17).
#[target_feature(enable = "sse")]
#[inline]
pub(crate) fn prefetch_step(start: *const u8, ahead: usize, step: usize, step_bytes: usize) {
    step_lines::<_MM_HINT_T0>(start, ahead, step, step_bytes);
}

/// [`prefetch_step`] into L2 (`prefetcht2`), [`PREFETCH_AHEAD_L2`] farther: a second stream
/// for the `avx512` MXFP4 kernel, whose decode between its loads left the L1 stream alone too
/// few lines in flight.
#[target_feature(enable = "sse")]
#[inline]
pub(crate) fn prefetch_step_l2(start: *const u8, ahead: usize, step: usize, step_bytes: usize) {
    step_lines::<_MM_HINT_T2>(start, ahead + PREFETCH_AHEAD_L2, step, step_bytes);
}

/// The lines of step `step` ([`step_offsets`]) prefetched with hint `HINT`.
#[target_feature(enable = "sse")]
#[inline]
fn step_lines<const HINT: i32>(start: *const u8, ahead: usize, step: usize, step_bytes: usize) {
    for offset in step_offsets(ahead, step, step_bytes) {
        // Prefetch hint only: it never faults, so an address past the matrix is harmless.
        _mm_prefetch::<HINT>(start.wrapping_add(offset).cast());
    }
}

/// How much farther than the L1 stream [`prefetch_step_l2`] runs. On Zen 4 (2 threads, the
/// k3-wide slice's decode, alternated with the binary without it) the routed experts' bucket
/// took 0.84x the time (PERFORMANCE.md, phase 30).
pub(crate) const PREFETCH_AHEAD_L2: usize = 16 << 10;

/// The offsets [`prefetch_step`] prefetches at step `step`, one per line.
#[inline(always)]
fn step_offsets(ahead: usize, step: usize, step_bytes: usize) -> impl Iterator<Item = usize> {
    let from = ahead + step * step_bytes;
    (0..step_bytes.div_ceil(64)).map(move |line| from + 64 * line)
}

/// How far ahead a row block of `window` bytes prefetches ([`prefetch_step`],
/// [`prefetch_ahead`], [`Prefetch`]): `PREFETCH_AHEAD` rounded up to whole row blocks.
#[inline(always)]
pub(crate) fn prefetch_distance(window: usize) -> usize {
    PREFETCH_AHEAD.div_ceil(window.max(1)) * window
}

/// How far ahead the MXFP4 row-block prefetch runs (measured best of 5-28 KB, PERFORMANCE.md).
pub(crate) const PREFETCH_AHEAD: usize = 16 << 10;

/// [`prefetch_ahead`]'s sequential stream over a row block (the same lines, `PREFETCH_AHEAD`
/// bytes rounded up to whole blocks ahead), without its two divisions per step: the stream
/// keeps its position and each step prefetches the lines up to its share of the window.
pub(crate) struct Prefetch {
    /// Byte offset from the block's start of the next line to prefetch.
    next: usize,
    /// Bytes of the window per step: `window / steps` (rounded up).
    per_step: usize,
    /// The first prefetched offset (`ahead`): step `s` covers up to `ahead + (s + 1) * per_step`.
    ahead: usize,
}

impl Prefetch {
    /// A stream over a row block of `window` bytes walked in `steps` steps.
    #[inline(always)]
    pub(crate) fn new(window: usize, steps: usize) -> Self {
        let ahead = prefetch_distance(window);
        Self {
            next: ahead,
            per_step: window.div_ceil(steps.max(1)),
            ahead,
        }
    }

    /// Prefetches step `step`'s lines of the stream from `start` (steps in order from 0).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn step(&mut self, start: *const u8, step: usize) {
        for offset in self.lines(step).step_by(64) {
            // Prefetch hint only: it never faults, so an address past the matrix is harmless.
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset).cast());
        }
    }

    /// The byte offsets of step `step`'s lines (from the block's start; whole lines of 64).
    #[inline(always)]
    fn lines(&mut self, step: usize) -> Range<usize> {
        let end = self.ahead + (step + 1) * self.per_step;
        let first = self.next;
        while self.next < end {
            self.next += 64;
        }
        first..self.next
    }
}

/// Where a BF16 row block's row `r` prefetches while at value block `block` (32 values), as an
/// offset in values from that row's current position: `PREFETCH_BF16` ahead in the row, and
/// near the row's end the same distance into row `r` of the *next* row block (the next row is
/// already streaming in this one), so a short row's first lines are not all demand misses.
#[inline(always)]
pub(crate) fn bf16_prefetch_offset(rows: usize, cols: usize, block: usize) -> usize {
    let ahead = 32 * block + PREFETCH_BF16;
    if ahead < cols {
        PREFETCH_BF16
    } else {
        rows * cols + ahead - cols - 32 * block
    }
}

/// Per-row software prefetch distance in BF16 rows, in values (512 bytes: 8 lines ahead).
/// BF16 rows are long (14 KB for K3's 7168 columns), so each row is its own stream; measured
/// best of 128..2048 values and better than the row-block prefetch here (PERFORMANCE.md).
pub(crate) const PREFETCH_BF16: usize = 256;

/// Where row `r` of a packed row block of `rows` rows of `row_bytes` prefetches while at byte
/// `pos` of its row, as an offset in bytes from there: [`PREFETCH_PACKED`] ahead in the row,
/// and near the row's end as far into row `r` of the next row block (rows are contiguous), as
/// [`bf16_prefetch_offset`] does for BF16 rows. A packed block is 49 bytes, so one prefetch
/// per row and block covers each line of the row.
#[inline(always)]
pub(crate) fn packed_prefetch_offset(rows: usize, row_bytes: usize, pos: usize) -> usize {
    row_prefetch_offset(PREFETCH_PACKED, rows, row_bytes, pos)
}

/// As [`packed_prefetch_offset`], [`PREFETCH_PACKED_L2`] ahead: the second, farther prefetch
/// of a packed row, into L2 (`prefetcht2`).
#[inline(always)]
pub(crate) fn packed_l2_prefetch_offset(rows: usize, row_bytes: usize, pos: usize) -> usize {
    row_prefetch_offset(PREFETCH_PACKED_L2, rows, row_bytes, pos)
}

/// `distance` ahead in the row, or as far into the same row of the next row block.
#[inline(always)]
fn row_prefetch_offset(distance: usize, rows: usize, row_bytes: usize, pos: usize) -> usize {
    if pos + distance < row_bytes {
        distance
    } else {
        rows * row_bytes + distance - row_bytes
    }
}

/// Per-row prefetch distance in packed rows, in bytes (16 lines ahead). Measured on Zen 4
/// against 512 and 2,048 (PERFORMANCE.md, phase 29).
pub(crate) const PREFETCH_PACKED: usize = 1024;

/// The packed rows' second prefetch distance, into L2: 4 KB past [`PREFETCH_PACKED`]. On Zen 4
/// (2 threads, the k3-wide slice's decode, alternated with the binary without it) 0.90-0.93x
/// the time per token in five of six pairs (PERFORMANCE.md, phase 30): with the decode's work
/// between its loads, the L1 prefetch alone kept too few lines in flight.
pub(crate) const PREFETCH_PACKED_L2: usize = PREFETCH_PACKED + 4096;

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed row's prefetches, one per 49-byte block, reach every line of the row from its
    /// `PREFETCH_PACKED`-th byte, then the first `PREFETCH_PACKED` bytes of the same row of
    /// the next row block, and nothing of any other row (rows longer than the distance, as
    /// every K3 width is: 512 columns are 784 bytes, and such short rows run ahead into the
    /// next block's following rows, which a hint allows).
    ///
    /// The same of the L2 prefetch, `PREFETCH_PACKED_L2` ahead, on the widths whose rows are
    /// longer than that (7168 and 12288 columns).
    #[test]
    fn packed_prefetches_cover_the_row_then_the_next_blocks_row() {
        let (near, far) = (
            packed_prefetch_offset as fn(usize, usize, usize) -> usize,
            packed_l2_prefetch_offset as fn(usize, usize, usize) -> usize,
        );
        for (rows, row_bytes, offset, distance) in [
            (4usize, 7168 / 32 * 49, near, PREFETCH_PACKED),
            (4, 1536 / 32 * 49, near, PREFETCH_PACKED),
            (3, 12288 / 32 * 49, near, PREFETCH_PACKED),
            (4, 7168 / 32 * 49, far, PREFETCH_PACKED_L2),
            (3, 12288 / 32 * 49, far, PREFETCH_PACKED_L2),
        ] {
            for r in 0..rows {
                let start = r * row_bytes;
                let lines: std::collections::BTreeSet<usize> = (0..row_bytes / 49)
                    .map(|block| {
                        let pos = 49 * block;
                        (start + pos + offset(rows, row_bytes, pos)) / 64
                    })
                    .collect();
                let next = start + rows * row_bytes;
                let first_line = (start + distance.min(row_bytes)) / 64;
                let wanted = (first_line..(start + row_bytes).div_ceil(64))
                    .chain(next / 64..(next + distance.min(row_bytes) - 1) / 64);
                for line in wanted {
                    if line * 64 >= start + distance && line * 64 + 64 <= start + row_bytes
                        || line * 64 >= next && line * 64 + 64 <= next + distance
                    {
                        assert!(
                            lines.contains(&line),
                            "{rows}x{row_bytes} row {r}: line {line}"
                        );
                    }
                }
                for &line in &lines {
                    let byte = line * 64;
                    let in_row = byte + 64 > start && byte < start + row_bytes;
                    let in_next = byte + 64 > next && byte < next + row_bytes;
                    assert!(
                        in_row || in_next,
                        "{rows}x{row_bytes} row {r}: line {line} is another row's"
                    );
                }
            }
        }
    }

    /// The fixed-step stream prefetches every line of the window ahead (the row block after
    /// this one, or the one after that for small blocks) by the end of the walk, for the
    /// kernels' row blocks and steps: packed blocks of 3 and 4 rows, MXFP4 groups of 4 and 8.
    #[test]
    fn prefetch_steps_cover_the_next_row_block() {
        for (rows, step_bytes_per_row) in [(3usize, 49usize), (4, 49), (4, 16), (8, 16)] {
            for steps in [1usize, 16, 48, 112, 224, 384] {
                let step_bytes = rows * step_bytes_per_row;
                let window = steps * step_bytes;
                let ahead = prefetch_distance(window);
                assert!(ahead >= PREFETCH_AHEAD && ahead.is_multiple_of(window));
                let lines: std::collections::BTreeSet<usize> = (0..steps)
                    .flat_map(|s| step_offsets(ahead, s, step_bytes))
                    .map(|o| o / 64)
                    .collect();
                for byte in (ahead..ahead + window)
                    .step_by(16)
                    .chain([ahead + window - 1])
                {
                    assert!(
                        lines.contains(&(byte / 64)),
                        "{rows} rows x {step_bytes_per_row} bytes, {steps} steps: byte {byte}"
                    );
                }
            }
        }
    }

    /// Over a row block's steps the stream prefetches each line once, in order, from `ahead`
    /// (`PREFETCH_AHEAD` rounded up to whole windows) through the whole window, as
    /// `prefetch_ahead` does, overshooting by less than a line plus `steps` bytes (the
    /// per-step share is rounded up).
    #[test]
    fn prefetch_stream_covers_the_window_ahead_once() {
        for window in [1usize, 63, 64, 100, 3 * 1792, 4 * 2048, 16 << 10, 57_344] {
            for steps in [1usize, 2, 3, 32, 56, 224] {
                let mut stream = Prefetch::new(window, steps);
                let ahead = PREFETCH_AHEAD.div_ceil(window) * window;
                let mut next = ahead;
                for step in 0..steps {
                    let lines = stream.lines(step);
                    assert_eq!(lines.start, next, "window {window}, step {step}/{steps}");
                    assert!(lines.end >= lines.start && (lines.end - ahead).is_multiple_of(64));
                    next = lines.end;
                }
                assert!(
                    next >= ahead + window && next < ahead + window + 64 + steps,
                    "window {window} in {steps} steps ends at {next}, ahead {ahead}"
                );
            }
        }
    }
}
