//! Rows of the checkpoint in bulk: read in chunks a chunk ahead on an I/O thread, and packed
//! (`mxfp4_kernels::pack_rows_into`) or requantised (a lossy `--trunk-format`) with the rows
//! split over the pool's workers. The resident
//! trunk's load and the pack cache's write both go through here.

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use expert_store::Dtype;
use expert_store::io::{AlignedBuf, ShardReader, read_pieces};
use mxfp4_kernels::codes::{
    Q8_0_BLOCK_BYTES, bf16_to_f32, f16_to_f32, quantize_group, quantize_q8_0,
};
use numa_sched::Pool;

use super::error::{IoError, checkpoint_io};
use crate::plan::QuantFormat;

/// The index in the name of the I/O thread that reads checkpoint rows in bulk, apart from the
/// expert store's `k3-io-0..`.
pub(crate) const BULK_IO_THREAD: usize = 999;

/// Reads `chunks` (a piece, its first and end row) of `sources` (per piece: its shard, the
/// offset of its row 0 and its bytes per row) in order, on an I/O thread on `io_cpus` a chunk
/// ahead, and hands each chunk's bytes to `each` (two or three staging buffers of a chunk).
pub(crate) fn read_chunks<E: From<IoError>>(
    sources: Vec<(Arc<ShardReader>, usize, usize)>,
    chunks: &[(usize, usize, usize)],
    io_cpus: &[usize],
    mut each: impl FnMut(usize, usize, usize, &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    if chunks.is_empty() {
        return Ok(());
    }
    let rows: Vec<usize> = sources.iter().map(|s| s.2).collect();
    let (full_tx, full) = std::sync::mpsc::sync_channel(0);
    let (free, free_rx) = channel::<AlignedBuf>();
    let order = chunks.to_vec();
    let io = numa_sched::spawn_io_thread(BULK_IO_THREAD, io_cpus, move || {
        for (piece, first, last) in order {
            let (shard, offset, row): &(Arc<ShardReader>, usize, usize) = &sources[piece];
            let range = offset + first * row..offset + last * row;
            let read = read_pieces(&[(&**shard, range)], free_rx.try_recv().ok(), |_, _| {})
                .map_err(|e| (e.path, e.source));
            let failed = read.is_err();
            if full_tx.send(read).is_err() || failed {
                return;
            }
        }
    })
    .map_err(|e| IoError::Pool(format!("the packing reader: {e}")))?;
    let mut result = Ok(());
    for &(piece, first, last) in chunks {
        let (buf, starts) = match full.recv() {
            Ok(Ok(read)) => read,
            Ok(Err((path, e))) => {
                result = Err(checkpoint_io(path, e).into());
                break;
            }
            Err(_) => {
                result = Err(IoError::Pool("the packing reader stopped".into()).into());
                break;
            }
        };
        let len = (last - first) * rows[piece];
        result = each(piece, first, last, &buf[starts[0]..starts[0] + len]);
        let _ = free.send(buf);
        if result.is_err() {
            break;
        }
    }
    drop(full);
    let _ = io.join();
    result
}

/// Packs whole rows of `cols` BF16 values (`src`) into `dst`, the rows split over `pool`'s
/// workers; appends their exception blocks and row starts as one [`pack_rows_into`] would.
///
/// [`pack_rows_into`]: mxfp4_kernels::pack_rows_into
pub(crate) fn pack_on(
    pool: &Pool,
    src: &[u8],
    cols: usize,
    dst: &mut [u8],
    exceptions: &mut Vec<u8>,
    row_exceptions: &mut Vec<u32>,
) -> Result<(), IoError> {
    let rows = src.len() / (2 * cols);
    let packed_row = dst.len() / rows.max(1);
    let per = rows.div_ceil(pool.threads().max(1)).max(1);
    let parts: Vec<Mutex<(&[u8], &mut [u8])>> = src
        .chunks(per * 2 * cols)
        .zip(dst.chunks_mut(per * packed_row))
        .map(Mutex::new)
        .collect();
    let packed = pool
        .map(parts.len(), |i| {
            let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            let (src, dst) = &mut *part;
            let (mut exceptions, mut starts) = (Vec::new(), Vec::with_capacity(per));
            mxfp4_kernels::pack_rows_into(src, cols, dst, &mut exceptions, &mut starts);
            (exceptions, starts)
        })
        .map_err(|e| IoError::Pool(e.to_string()))?;
    for (more, starts) in packed {
        let before = u32::try_from(exceptions.len() / mxfp4_kernels::packed::EXCEPTION_BYTES)
            .expect("under 2^32 exception blocks");
        row_exceptions.extend(starts.iter().map(|s| s + before));
        exceptions.extend_from_slice(&more);
    }
    Ok(())
}

/// Requantises whole rows of `cols` values stored as `dtype` (`src`, little-endian BF16, F16
/// or F32) to `format`, the rows split over `pool`'s workers: Q8_0 blocks into `blocks`
/// (`scales` empty), or MXFP4 codes into `blocks` and E8M0 scales into `scales`. Each block
/// depends on its 32 values alone, so the split cannot change a byte.
pub(crate) fn quantise_on(
    pool: &Pool,
    src: &[u8],
    dtype: Dtype,
    cols: usize,
    format: QuantFormat,
    blocks: &mut [u8],
    scales: &mut [u8],
) -> Result<(), IoError> {
    let elem = dtype.bitsize() / 8;
    let rows = src.len() / (elem * cols);
    let per = rows.div_ceil(pool.threads().max(1)).max(1);
    let (block_row, scale_row) = match format {
        QuantFormat::Q8_0 => (format.bytes(1, cols), 0),
        QuantFormat::MxFp4 => (cols / 2, cols / 32),
    };
    let scale_parts: Vec<&mut [u8]> = match scale_row {
        0 => (0..rows.div_ceil(per)).map(|_| &mut [][..]).collect(),
        n => scales.chunks_mut(per * n).collect(),
    };
    let parts: Vec<Mutex<(&[u8], &mut [u8], &mut [u8])>> = src
        .chunks(per * elem * cols)
        .zip(blocks.chunks_mut(per * block_row))
        .zip(scale_parts)
        .map(|((s, b), sc)| Mutex::new((s, b, sc)))
        .collect();
    pool.map(parts.len(), |i| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        let (src, blocks, scales) = &mut *part;
        let mut values = [0.0f32; 32];
        for (k, group) in src.chunks_exact(32 * elem).enumerate() {
            for (v, bytes) in values.iter_mut().zip(group.chunks_exact(elem)) {
                *v = match dtype {
                    Dtype::BF16 => bf16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
                    Dtype::F16 => f16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
                    _ => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
                };
            }
            match format {
                QuantFormat::Q8_0 => {
                    blocks[k * Q8_0_BLOCK_BYTES..(k + 1) * Q8_0_BLOCK_BYTES]
                        .copy_from_slice(&quantize_q8_0(&values));
                }
                QuantFormat::MxFp4 => {
                    let (codes, scale) = quantize_group(&values);
                    blocks[k * 16..(k + 1) * 16].copy_from_slice(&codes);
                    scales[k] = scale;
                }
            }
        }
    })
    .map_err(|e| IoError::Pool(e.to_string()))?;
    Ok(())
}

/// The reader of `path` among `readers`, opened (with `O_DIRECT`) if it is not there yet.
pub(crate) fn reader(
    readers: &mut Vec<Arc<ShardReader>>,
    path: &std::path::Path,
) -> Result<Arc<ShardReader>, IoError> {
    if let Some(reader) = readers.iter().find(|r| r.path == path) {
        return Ok(Arc::clone(reader));
    }
    let reader =
        Arc::new(ShardReader::open(path, true).map_err(|e| checkpoint_io(path.to_owned(), e))?);
    readers.push(Arc::clone(&reader));
    Ok(reader)
}
