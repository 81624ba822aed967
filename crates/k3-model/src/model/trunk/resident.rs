//! The trunk tensors a plan keeps resident, read once with `O_DIRECT` and packed where the plan
//! packs them.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use expert_store::Checkpoint;
use expert_store::io::{AlignedBuf, ShardReader, drop_page_cache, read_full, read_pieces};
use mxfp4_kernels::{MxFp4Matrix, PackedBf16Matrix, WeightMatrix};
use numa_sched::Pool;

use crate::io::checksum::Checksum;
use crate::io::chunks::{pack_on, quantise_on, read_chunks, reader};
use crate::io::error::checkpoint_io;
use crate::model::error::{ModelError, Result};
use crate::packcache::types::{PackCache, PackCacheError};
use crate::plan::{PackAs, QuantFormat, StoredTensor};

/// The trunk tensors the plan keeps resident, read once with `O_DIRECT` (no copy of them
/// stays in the page cache), shared by every model built over the engine: BF16 matrices the
/// plan packs (`StoredTensor::pack_cols`) in their packed form (`mxfp4_kernels::packed`,
/// lossless), the rest as stored in one buffer.
#[derive(Debug)]
pub struct ResidentTrunk {
    pub(super) buffer: AlignedBuf,
    /// `(address of the tensor in the mapping, its length, its offset in the buffer)`, by
    /// address.
    pub(super) tensors: Vec<(usize, usize, usize)>,
    /// The packed matrices' bodies, back to back.
    pub(super) bodies: AlignedBuf,
    /// The packed matrices (or leading row blocks), by address.
    pub(super) packed: Vec<PackedPiece>,
    /// The indices of the pack cache's matrices read whole, each found matching its checksum
    /// as it landed (the build checks the others: [`PackCache::verify`]).
    pub(crate) cache_checked: Vec<usize>,
}

/// A resident matrix (or row block) held packed (BF16, lossless) or requantised.
#[derive(Debug)]
pub(super) struct PackedPiece {
    /// Address and length of its stored bytes in the mapping.
    pub(super) address: usize,
    pub(super) len: usize,
    /// Where its body starts in `ResidentTrunk::bodies`.
    pub(super) body_at: usize,
    pub(super) cols: usize,
    /// How it is held.
    pub(super) how: PackAs,
    pub(super) exceptions: Vec<u8>,
    pub(super) row_exceptions: Vec<u32>,
    /// Read packed from the pack cache (else packed at load).
    pub(super) cached: bool,
}

/// The packed part of a [`ResidentTrunk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSummary {
    /// Matrices (or leading row blocks) held packed.
    pub pieces: usize,
    /// Of them, those requantised (a lossy `--trunk-format`) rather than packed losslessly.
    pub requantised: usize,
    /// Of them, those read packed from the pack cache.
    pub cached: usize,
    /// Their blocks kept as BF16 (exponents too far apart for the codes).
    pub exceptions: usize,
    /// The stored bytes they stand for.
    pub bf16_bytes: usize,
    /// Bytes they take: bodies, exception blocks, row indexes.
    pub packed_bytes: usize,
}

/// Bytes of one stored row of a packed piece.
fn row_of(p: &PackedPiece) -> usize {
    p.how.stored_bytes_per_weight() * p.cols
}

/// Where rows `rows` of a requantised matrix of `all` rows whose body starts at `body` in the
/// pack cache lie: `(offset in the file, range in the piece's body)` of each part (Q8_0: the
/// rows' blocks; MXFP4: their codes, then their scales, as the body keeps all codes first).
fn quant_rows(
    how: PackAs,
    body: usize,
    all: usize,
    rows: Range<usize>,
) -> Vec<(usize, Range<usize>)> {
    let PackAs::Quant { format, cols, .. } = how else {
        unreachable!("only requantised bodies are read whole")
    };
    match format {
        QuantFormat::Q8_0 => {
            let at = |r: usize| format.bytes(r, cols);
            vec![(body + at(rows.start), 0..at(rows.len()))]
        }
        QuantFormat::MxFp4 => {
            let (codes, scales) = (cols / 2, cols / 32);
            let n = rows.len();
            vec![
                (body + rows.start * codes, 0..n * codes),
                (
                    body + all * codes + rows.start * scales,
                    n * codes..n * (codes + scales),
                ),
            ]
        }
    }
}

/// BF16 rows read at a time for packing: the staging buffer's size.
pub(super) const PACK_STAGING: usize = 32 << 20;

impl ResidentTrunk {
    /// Reads the tensors of `ckpt` whose stored names are `names`, and the row blocks `rows`
    /// (a [`TrunkPlan`]'s `resident` and `resident_rows`), in file order: those named in
    /// `packed` (stored name to columns) a few MB at a time, packed as they land; the others
    /// each from a 4 KiB boundary of one new buffer.
    ///
    /// Packing runs on `pool`'s workers, the reads on an I/O thread on `io_cpus`, a chunk
    /// ahead. The packed matrices `cache` holds are read packed from it instead (0.77x the
    /// bytes, nothing to pack), with its exception blocks and row index; those read whole are
    /// checked against their checksums (a damaged file: [`PackCacheError::Damaged`]).
    ///
    /// [`TrunkPlan`]: crate::plan::TrunkPlan
    pub fn load(
        ckpt: &Checkpoint,
        names: &HashSet<String>,
        rows: &[StoredTensor],
        packed: &HashMap<String, PackAs>,
        cache: Option<&PackCache>,
        pool: &Pool,
        io_cpus: &[usize],
    ) -> Result<Self> {
        // (file, offset in it, address in the mapping, length, columns if packed, stored
        // name, offset in the tensor) of each.
        let mut found = Vec::with_capacity(names.len() + rows.len());
        for name in names {
            let t = ckpt.require(name)?;
            let cols = packed.get(name).copied();
            found.push((
                t.path,
                t.offset,
                t.bytes.as_ptr() as usize,
                t.bytes.len(),
                cols,
                t.name,
                0,
            ));
        }
        for block in rows {
            // A row block is a range of its tensor's bytes.
            let t = ckpt.require(&block.name)?;
            let within = block
                .offset
                .checked_sub(t.offset)
                .filter(|&w| w + block.bytes as usize <= t.bytes.len());
            let Some(within) = within else {
                return Err(ModelError::Plan(format!(
                    "the resident rows of {} (bytes {}..{}) lie outside it (bytes {}..{})",
                    block.name,
                    block.offset,
                    block.offset + block.bytes as usize,
                    t.offset,
                    t.offset + t.bytes.len()
                )));
            };
            found.push((
                t.path,
                block.offset,
                t.bytes.as_ptr() as usize + within,
                block.bytes as usize,
                packed.get(&block.name).copied(),
                t.name,
                within,
            ));
        }
        found.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let (to_pack, plain): (Vec<_>, Vec<_>) = found.into_iter().partition(|f| f.4.is_some());
        let mut readers = Vec::new();
        let mut pieces = Vec::with_capacity(plain.len());
        for &(path, offset, _, len, ..) in &plain {
            pieces.push((reader(&mut readers, path)?, offset..offset + len));
        }
        let borrowed: Vec<(&ShardReader, Range<usize>)> = pieces
            .iter()
            .map(|(r, range)| (&**r, range.clone()))
            .collect();
        let (buffer, starts) =
            read_pieces(&borrowed, None, |_, _| {}).map_err(|e| checkpoint_io(e.path, e.source))?;
        let mut tensors: Vec<(usize, usize, usize)> = plain
            .iter()
            .zip(&starts)
            .map(|(&(_, _, address, len, ..), &at)| (address, len, at))
            .collect();
        tensors.sort_unstable();
        // The packed ones: whole rows a staging buffer at a time, packed (or requantised)
        // into their body.
        let mut packed = Vec::with_capacity(to_pack.len());
        // Per piece: its shard, offset and row bytes; then every piece's chunks of whole rows.
        let mut sources = Vec::with_capacity(to_pack.len());
        let mut chunks = Vec::new();
        // Requantised bodies the pack cache holds: (piece, the cache file, where it starts).
        let mut whole = Vec::new();
        // Per piece: the cache's index of its matrix and its body's running checksum, where
        // the piece is the whole matrix read from the cache.
        let mut checks: Vec<Option<(usize, Checksum)>> = Vec::with_capacity(to_pack.len());
        let mut at = 0;
        for &(path, offset, address, len, how, name, within) in &to_pack {
            let how = how.expect("partitioned on it");
            let cols = how.cols();
            let row = how.stored_bytes_per_weight() * cols;
            if !len.is_multiple_of(row) || !within.is_multiple_of(row) {
                return Err(ModelError::Plan(format!(
                    "packed resident bytes {offset}..{} of {} are not whole rows of {cols} values",
                    offset + len,
                    path.display()
                )));
            }
            let (rows, first_row) = (len / row, within / row);
            let packed_row = how.body_bytes(1);
            let held = cache.and_then(|c| {
                let k = c.position(name)?;
                let t = c.at(k);
                let same = t.cols == cols && t.format == how.code();
                match how {
                    // A rank's rows of a matrix are a row range of the cached one.
                    PackAs::Packed { .. } | PackAs::Quant { .. } => {
                        same && first_row + rows <= t.rows
                    }
                }
                .then_some((c, t, k))
            });
            checks.push(
                held.filter(|&(_, t, _)| first_row == 0 && rows == t.rows)
                    .map(|(_, _, k)| (k, Checksum::new())),
            );
            let (unit, exceptions, row_exceptions) = match held {
                // Read whole below, not in chunks: its body is not rows of one size.
                Some((c, t, _)) if matches!(how, PackAs::Quant { .. }) => {
                    sources.push((reader(&mut readers, c.path())?, t.body, row));
                    whole.push((
                        packed.len(),
                        c.path().to_owned(),
                        quant_rows(how, t.body, t.rows, first_row..first_row + rows),
                    ));
                    (0, Vec::new(), Vec::new())
                }
                Some((c, t, _)) => {
                    sources.push((
                        reader(&mut readers, c.path())?,
                        t.body + first_row * packed_row,
                        packed_row,
                    ));
                    // Those rows' exception blocks and index, counted from their first.
                    let index = &t.row_exceptions[first_row..=first_row + rows];
                    let bytes = mxfp4_kernels::packed::EXCEPTION_BYTES;
                    (
                        packed_row,
                        t.exceptions[index[0] as usize * bytes..index[rows] as usize * bytes]
                            .to_vec(),
                        index.iter().map(|&i| i - index[0]).collect(),
                    )
                }
                None => {
                    sources.push((reader(&mut readers, path)?, offset, row));
                    (row, Vec::new(), Vec::with_capacity(rows + 1))
                }
            };
            if unit > 0 {
                let step = (PACK_STAGING / unit).max(1);
                for first in (0..rows).step_by(step) {
                    chunks.push((packed.len(), first, (first + step).min(rows)));
                }
            }
            packed.push(PackedPiece {
                address,
                len,
                body_at: at,
                cols,
                how,
                exceptions,
                row_exceptions,
                cached: held.is_some(),
            });
            // Each body from a 64-byte boundary (the kernels load unaligned; this keeps rows of
            // different matrices off shared cache lines).
            at += how.body_bytes(rows).next_multiple_of(64);
        }
        let mut bodies = AlignedBuf::zeroed(at);
        read_chunks(sources, &chunks, io_cpus, |piece, first, last, bytes| {
            let p = &mut packed[piece];
            if let PackAs::Quant {
                format,
                cols,
                dtype,
            } = p.how
            {
                let rows = p.len / (cols * p.how.stored_bytes_per_weight());
                let body = &mut bodies[p.body_at..p.body_at + format.bytes(rows, cols)];
                return match format {
                    QuantFormat::Q8_0 => {
                        let at = |r: usize| format.bytes(r, cols);
                        quantise_on(
                            pool,
                            bytes,
                            dtype,
                            cols,
                            format,
                            &mut body[at(first)..at(last)],
                            &mut [],
                        )
                    }
                    // Codes of every row, then scales of every row.
                    QuantFormat::MxFp4 => {
                        let (codes, scales) = body.split_at_mut(rows * cols / 2);
                        quantise_on(
                            pool,
                            bytes,
                            dtype,
                            cols,
                            format,
                            &mut codes[first * cols / 2..last * cols / 2],
                            &mut scales[first * cols / 32..last * cols / 32],
                        )
                    }
                };
            }
            let packed_row = p.how.body_bytes(1);
            let body = &mut bodies[p.body_at + first * packed_row..p.body_at + last * packed_row];
            if p.cached {
                body.copy_from_slice(bytes);
                if let Some((_, sum)) = &mut checks[piece] {
                    sum.update(bytes);
                }
                return Ok(());
            }
            pack_on(
                pool,
                bytes,
                p.cols,
                body,
                &mut p.exceptions,
                &mut p.row_exceptions,
            )
        })?;
        for (piece, path, parts) in whole {
            let p = &packed[piece];
            let body = &mut bodies[p.body_at..p.body_at + p.how.body_bytes(p.len / row_of(p))];
            let file = std::fs::File::open(&path).map_err(|e| checkpoint_io(path.clone(), e))?;
            for (at, within) in parts {
                let part = &mut body[within];
                let got = read_full(&file, part, at).map_err(|e| checkpoint_io(path.clone(), e))?;
                if got != part.len() {
                    return Err(ModelError::Plan(format!(
                        "the pack cache {} ends inside a requantised body",
                        path.display()
                    )));
                }
            }
            let _ = drop_page_cache(&file, 0, 0);
            // A whole body is the file's: codes then scales.
            if let Some((_, sum)) = &mut checks[piece] {
                sum.update(body);
            }
        }
        let mut cache_checked = Vec::new();
        for (k, sum) in checks.into_iter().flatten() {
            let (c, t) = cache
                .map(|c| (c, c.at(k)))
                .expect("checked pieces are cached");
            if sum.finish() != t.sum {
                return Err(PackCacheError::Damaged {
                    path: c.path().to_owned(),
                    tensor: t.name.clone(),
                }
                .into());
            }
            cache_checked.push(k);
        }
        for p in packed
            .iter_mut()
            .filter(|p| !p.cached && matches!(p.how, PackAs::Packed { .. }))
        {
            let count = p.exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES;
            p.row_exceptions
                .push(u32::try_from(count).expect("under 2^32 exception blocks"));
            p.exceptions.shrink_to_fit();
        }
        packed.sort_unstable_by_key(|p| p.address);
        Ok(Self {
            buffer,
            tensors,
            bodies,
            packed,
            cache_checked,
        })
    }

    /// Bytes held: the buffer, the packed bodies, their exception blocks and row indexes.
    pub fn bytes(&self) -> usize {
        self.buffer.len() + self.packed_summary().packed_bytes
    }

    /// What is held packed.
    pub fn packed_summary(&self) -> PackedSummary {
        PackedSummary {
            pieces: self.packed.len(),
            requantised: self
                .packed
                .iter()
                .filter(|p| matches!(p.how, PackAs::Quant { .. }))
                .count(),
            cached: self.packed.iter().filter(|p| p.cached).count(),
            exceptions: self
                .packed
                .iter()
                .map(|p| p.exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES)
                .sum(),
            bf16_bytes: self.packed.iter().map(|p| p.len).sum(),
            packed_bytes: self.bodies.len()
                + self
                    .packed
                    .iter()
                    .map(|p| p.exceptions.len() + 4 * p.row_exceptions.len())
                    .sum::<usize>(),
        }
    }

    /// Where `bytes` (a loaded view's) are in the buffer, if they are resident as stored.
    pub(super) fn find(&self, bytes: &[u8]) -> Option<&[u8]> {
        let at = bytes.as_ptr() as usize;
        let i = self.tensors.partition_point(|&(start, _, _)| start <= at);
        let &(start, len, offset) = self.tensors.get(i.checked_sub(1)?)?;
        (at + bytes.len() <= start + len).then(|| {
            let from = offset + (at - start);
            &self.buffer[from..from + bytes.len()]
        })
    }

    /// The packed (or requantised) form of `bytes` (a loaded view's whole rows), if they are
    /// resident so.
    pub(super) fn find_packed(&self, bytes: &[u8]) -> Option<WeightMatrix<'_>> {
        let at = bytes.as_ptr() as usize;
        let i = self.packed.partition_point(|p| p.address <= at);
        let p = self.packed.get(i.checked_sub(1)?)?;
        let (row, within) = (p.how.stored_bytes_per_weight() * p.cols, at - p.address);
        if bytes.is_empty()
            || at + bytes.len() > p.address + p.len
            || !within.is_multiple_of(row)
            || !bytes.len().is_multiple_of(row)
        {
            return None;
        }
        // Only those rows: the view checks the index of the rows it covers.
        let rows = within / row..(within + bytes.len()) / row;
        let cols = p.cols;
        match p.how {
            PackAs::Packed { .. } => {
                let packed_row = mxfp4_kernels::packed::packed_body_bytes(1, cols);
                let at = p.body_at + rows.start * packed_row;
                PackedBf16Matrix::new(
                    &self.bodies[at..at + rows.len() * packed_row],
                    &p.exceptions,
                    &p.row_exceptions[rows.start..=rows.end],
                    rows.len(),
                    cols,
                )
                .ok()
                .map(WeightMatrix::from)
            }
            PackAs::Quant {
                format: QuantFormat::Q8_0,
                ..
            } => {
                let row = QuantFormat::Q8_0.bytes(1, cols);
                let at = p.body_at + rows.start * row;
                mxfp4_kernels::Q8_0Matrix::new(
                    &self.bodies[at..at + rows.len() * row],
                    rows.len(),
                    cols,
                )
                .ok()
                .map(WeightMatrix::from)
            }
            PackAs::Quant {
                format: QuantFormat::MxFp4,
                ..
            } => {
                let all = p.len / row;
                let codes = &self.bodies[p.body_at..p.body_at + all * cols / 2];
                let scales = &self.bodies[p.body_at + all * cols / 2..][..all * cols / 32];
                MxFp4Matrix::new(
                    &codes[rows.start * cols / 2..rows.end * cols / 2],
                    &scales[rows.start * cols / 32..rows.end * cols / 32],
                    rows.len(),
                    cols,
                )
                .ok()
                .map(WeightMatrix::from)
            }
        }
    }
}
