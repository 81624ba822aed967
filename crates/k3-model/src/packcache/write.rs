//! A pack cache file written: the matrices read in chunks, packed on the pool and written
//! through the atomic file writer, then the manifest and the header.

use std::path::Path;
use std::sync::Arc;

use expert_store::io::{AlignedBuf, IO_ALIGN, ShardReader};
use mxfp4_kernels::packed::EXCEPTION_BYTES;
use numa_sched::Pool;

use crate::io::atomic::AtomicFile;
use crate::plan::{PackAs, QuantFormat, StoredTensor};

use super::format::{Header, Source, checksum, layout, put_str, put_u32, put_u64};
use super::types::{PackCache, PackCacheError, io};
use crate::io::checksum::Checksum;

impl PackCache {
    /// Writes the cache of `want` to `path` (see the module) and opens it.
    pub fn write(
        path: &Path,
        identity: u64,
        want: &[&StoredTensor],
        pool: &Pool,
        io_cpus: &[usize],
    ) -> Result<Self, PackCacheError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        // A FIFO or a device in the file's place is someone's: left as it is (the rename
        // would replace it), and the caller goes on without the cache.
        if let Ok(Some(kind)) = expert_store::file::kind_at(path) {
            return Err(PackCacheError::Io {
                path: path.to_owned(),
                source: std::io::Error::other(format!("{kind}, not a regular file; left as it is")),
            });
        }
        remove_abandoned(path);
        let (bodies, end) = layout(want);
        // The manifest: about the side bytes plus names; bounded by a 2% share of exceptions.
        let rows: usize = want.iter().map(|t| t.rows).sum();
        let needed = end as u64 + 4 * rows as u64 + (end as u64 / 50) + FREE_SLACK;
        let free = free_bytes(dir).map_err(io(dir))?;
        if free < needed {
            return Err(PackCacheError::Space {
                dir: dir.to_owned(),
                free,
                needed,
            });
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        // A failure drops the file, which removes the temporary one.
        let mut file = AtomicFile::create(path, tmp.clone(), true).map_err(io(&tmp))?;
        let len = write_file(&mut file, identity, want, &bodies, end, pool, io_cpus)?;
        file.commit(len).map_err(io(path))?;
        match Self::open(path, identity, want)? {
            Ok(cache) => Ok(cache),
            Err(why) => Err(PackCacheError::Io {
                path: path.to_owned(),
                source: std::io::Error::other(format!("written, then read back: {why}")),
            }),
        }
    }
}

/// Free space kept on the cache's filesystem beyond the file.
const FREE_SLACK: u64 = 256 << 20;
/// BF16 bytes read (and packed) at a time while writing.
const STAGING: usize = 32 << 20;

/// Removes the temporary files (`<stem>.tmp<pid>`) that writers of `path` killed mid-write left
/// beside it: those whose process is gone.
fn remove_abandoned(path: &Path) {
    let (Some(dir), Some(stem)) = (path.parent(), path.file_stem()) else {
        return;
    };
    let prefix = format!("{}.tmp", stem.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes the whole cache into `file`; returns its length. See [`PackCache::write`].
fn write_file(
    file: &mut AtomicFile,
    identity: u64,
    want: &[&StoredTensor],
    bodies: &[usize],
    end: usize,
    pool: &Pool,
    io_cpus: &[usize],
) -> Result<u64, PackCacheError> {
    let tmp = file.tmp().to_owned();
    let tmp = tmp.as_path();
    let mut readers: Vec<Arc<ShardReader>> = Vec::new();
    let (sources, source_of) = Source::of_all(want)?;
    let mut pieces = Vec::with_capacity(want.len());
    let mut chunks = Vec::new();
    for (i, t) in want.iter().enumerate() {
        let how = t.pack_as().expect("only packable matrices are cached");
        let reader = crate::io::chunks::reader(&mut readers, &t.path)?;
        let row = how.stored_bytes_per_weight() * how.cols();
        let step = (STAGING / row).max(1);
        for first in (0..t.rows).step_by(step) {
            chunks.push((i, first, (first + step).min(t.rows)));
        }
        pieces.push((reader, t.offset, row));
    }
    // A chunk's body, and an MXFP4 matrix's scales (written after its last chunk's codes).
    let largest = want
        .iter()
        .map(|t| {
            let how = t.pack_as().expect("only packable matrices are cached");
            let row = how.stored_bytes_per_weight() * how.cols();
            let chunk = how.body_bytes((STAGING / row.max(1)).max(1).min(t.rows));
            chunk + t.rows * how.cols() / 32
        })
        .max()
        .unwrap_or(0);
    let mut out = AlignedBuf::zeroed(largest + IO_ALIGN);
    let mut carry = 0;
    let mut pos = 0;
    let mut exceptions: Vec<Vec<u8>> = vec![Vec::new(); want.len()];
    let mut row_exceptions: Vec<Vec<u32>> = vec![Vec::new(); want.len()];
    let mut scales = Vec::new();
    // Each body's checksum, over its bytes in file order as they are made.
    let mut sums: Vec<Checksum> = vec![Checksum::new(); want.len()];
    let mut write_error = None;
    crate::io::chunks::read_chunks(pieces, &chunks, io_cpus, |i, first, last, stored| {
        let t = want[i];
        let how = t.pack_as().expect("only packable matrices are cached");
        if first == 0 {
            pos = bodies[i];
            carry = 0;
        }
        let mut n = how.body_bytes(last - first);
        match how {
            PackAs::Packed { cols } => crate::io::chunks::pack_on(
                pool,
                stored,
                cols,
                &mut out[carry..carry + n],
                &mut exceptions[i],
                &mut row_exceptions[i],
            )?,
            PackAs::Quant {
                format: QuantFormat::Q8_0,
                cols,
                dtype,
            } => crate::io::chunks::quantise_on(
                pool,
                stored,
                dtype,
                cols,
                QuantFormat::Q8_0,
                &mut out[carry..carry + n],
                &mut [],
            )?,
            // The codes stream as they come; the scales follow the last chunk's codes.
            PackAs::Quant {
                format: QuantFormat::MxFp4,
                cols,
                dtype,
            } => {
                if first == 0 {
                    scales = vec![0u8; t.rows * cols / 32];
                }
                n = (last - first) * cols / 2;
                crate::io::chunks::quantise_on(
                    pool,
                    stored,
                    dtype,
                    cols,
                    QuantFormat::MxFp4,
                    &mut out[carry..carry + n],
                    &mut scales[first * cols / 32..last * cols / 32],
                )?;
                if last == t.rows {
                    out[carry + n..carry + n + scales.len()].copy_from_slice(&scales);
                    n += scales.len();
                }
            }
        }
        sums[i].update(&out[carry..carry + n]);
        let total = carry + n;
        let whole = if last == t.rows {
            out[total..total.next_multiple_of(IO_ALIGN)].fill(0);
            total.next_multiple_of(IO_ALIGN)
        } else {
            total / IO_ALIGN * IO_ALIGN
        };
        if let Err(e) = file.write_at(&out[..whole], pos as u64) {
            write_error = Some(e);
            return Err(PackCacheError::Pool("the pack cache's write failed".into()));
        }
        pos += whole;
        out.copy_within(whole..total.max(whole), 0);
        carry = total.saturating_sub(whole);
        Ok(())
    })
    .map_err(|e| match write_error.take() {
        Some(source) => PackCacheError::Io {
            path: tmp.to_owned(),
            source,
        },
        None => e,
    })?;
    // The manifest after the last body, then the header.
    let mut m = Vec::new();
    put_u32(&mut m, sources.len() as u32);
    for s in &sources {
        put_str(&mut m, &s.name);
        put_u64(&mut m, s.size);
        put_u64(&mut m, s.mtime.0 as u64);
        put_u64(&mut m, s.mtime.1 as u64);
    }
    put_u32(&mut m, want.len() as u32);
    for (i, t) in want.iter().enumerate() {
        let how = t.pack_as().expect("only packable matrices are cached");
        let blocks = exceptions[i].len() / EXCEPTION_BYTES;
        // A requantised matrix has no exception blocks: its index is all zeros.
        if !matches!(how, PackAs::Packed { .. }) {
            row_exceptions[i] = vec![0; t.rows];
        }
        row_exceptions[i].push(u32::try_from(blocks).expect("under 2^32 exception blocks"));
        put_str(&mut m, &t.name);
        put_u32(&mut m, source_of[i] as u32);
        put_u64(&mut m, t.offset as u64);
        put_u64(&mut m, t.rows as u64);
        put_u64(&mut m, how.cols() as u64);
        put_u32(&mut m, how.code());
        put_u64(&mut m, bodies[i] as u64);
        put_u64(&mut m, sums[i].finish());
        put_u64(&mut m, blocks as u64);
        m.extend_from_slice(&exceptions[i]);
        for &r in &row_exceptions[i] {
            put_u32(&mut m, r);
        }
    }
    let page = |bytes: usize| bytes.next_multiple_of(IO_ALIGN).max(IO_ALIGN);
    let header = Header {
        identity,
        manifest_at: end as u64,
        manifest_len: m.len() as u64,
        manifest_sum: checksum(&m),
        file_len: (end + page(m.len())) as u64,
    }
    .to_bytes();
    let mut len = 0;
    for (at, bytes) in [(end, &m), (0, &header)] {
        let mut padded = AlignedBuf::zeroed(page(bytes.len()));
        padded[..bytes.len()].copy_from_slice(bytes);
        file.write_at(&padded, at as u64).map_err(io(tmp))?;
        len = len.max(at as u64 + padded.len() as u64);
    }
    Ok(len)
}

/// Free bytes on the filesystem of `dir` for an unprivileged writer.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `statvfs` is plain old data; all zeroes is a valid value of it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a live out-struct.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
