//! The pack cache: the trunk's BF16 matrices packed losslessly (`mxfp4_kernels::packed`: 49
//! bytes per 32 weights instead of 64), written once to a file beside the checkpoint (or in a
//! directory the caller gives where the checkpoint's is read-only), keyed by the checkpoint's
//! identity, so a memory plan's trunk stream reads 0.77x the bytes it would read as stored.
//!
//! The file: a header page (magic, version, the checkpoint identity, where the manifest lies
//! and its checksum); each matrix's body at a 4 KiB boundary, in checkpoint order (rows of a
//! fixed stride, so a row block is one range); then the manifest: the source files' sizes and
//! modification times, and per matrix its name, source, shape, body offset, exception blocks
//! and row index. The exception blocks and row indexes (0.2% of the bodies on k3-wide) are
//! held in memory; the stream reads the bodies with `O_DIRECT`.
//!
//! The file is written under a temporary name with `O_DIRECT` (no page-cache copy against the
//! memory budget) and renamed into place once complete and synced, so a reader sees a whole
//! file or none. A file whose identity, sources (size, modification time) or matrices do not
//! match the checkpoint is stale and is written again. Writing fails cleanly (unwritable
//! directory, too little free space, an I/O error): the caller then streams the matrices as
//! stored.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::io::{AlignedBuf, IO_ALIGN, ShardReader, drop_page_cache, read_full};
use mxfp4_kernels::packed::{EXCEPTION_BYTES, packed_body_bytes};
use numa_sched::Pool;

use crate::model::ModelError;
use crate::model::snapshot::file::Checksum;
use crate::plan::StoredTensor;

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"K3PACKED";
/// Bumped whenever the layout of the file or of a packed block changes.
pub const PACK_CACHE_VERSION: u32 = 1;
/// Free space kept on the cache's filesystem beyond the file.
const FREE_SLACK: u64 = 256 << 20;
/// BF16 bytes read (and packed) at a time while writing.
const STAGING: usize = 32 << 20;

/// One matrix the cache holds.
#[derive(Debug)]
pub struct PackedTensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// Where its body starts in the file (rows of `packed_body_bytes(1, cols)` bytes).
    pub body: usize,
    /// Its exception blocks (BF16, [`EXCEPTION_BYTES`] each), and per row the index of its
    /// first one (`rows + 1` entries).
    pub exceptions: Vec<u8>,
    pub row_exceptions: Vec<u32>,
}

impl PackedTensor {
    /// Bytes held in memory for it: exception blocks and row index.
    fn side_bytes(&self) -> u64 {
        (self.exceptions.len() + 4 * self.row_exceptions.len()) as u64
    }
}

/// An opened pack cache.
#[derive(Debug)]
pub struct PackCache {
    path: PathBuf,
    tensors: Vec<PackedTensor>,
    by_name: HashMap<String, usize>,
}

/// Why a cache could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum PackCacheError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{}: {} free, the pack cache needs {}",
        dir.display(),
        crate::budget::gb(*free),
        crate::budget::gb(*needed)
    )]
    Space {
        dir: PathBuf,
        free: u64,
        needed: u64,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackCacheError + '_ {
    move |source| PackCacheError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where the pack cache is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackCachePlace {
    /// Beside the checkpoint, else in the directory given (k3-serve gives
    /// `$XDG_CACHE_HOME/k3`; the library reads no environment).
    Auto(Option<PathBuf>),
    /// In this directory.
    Dir(PathBuf),
    /// Nowhere: streamed matrices are read as stored.
    Off,
}

impl Default for PackCachePlace {
    fn default() -> Self {
        Self::Auto(None)
    }
}

impl PackCachePlace {
    /// The directories to try, in order, for a checkpoint in `checkpoint_dir` (none: off).
    pub fn dirs(&self, checkpoint_dir: &Path) -> Vec<PathBuf> {
        match self {
            Self::Auto(fallback) => std::iter::once(checkpoint_dir.to_owned())
                .chain(fallback.clone())
                .collect(),
            Self::Dir(dir) => vec![dir.clone()],
            Self::Off => Vec::new(),
        }
    }
}

/// What [`PackCache::open_or_write`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A matching file was there.
    Opened,
    /// The file was written (`why`: none was there, or what made the one there stale), in
    /// `seconds`.
    Written { why: String, seconds: f64 },
}

/// A source file as the manifest records it: its name in the checkpoint directory, size and
/// modification time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    name: String,
    size: u64,
    mtime: (i64, i64),
}

impl Source {
    /// The distinct source files of `want` (each stated once, in first use), and per matrix
    /// the index of its own.
    fn of_all(want: &[&StoredTensor]) -> Result<(Vec<Self>, Vec<usize>), PackCacheError> {
        let mut paths: Vec<&Path> = Vec::new();
        let mut sources = Vec::new();
        let mut source_of = Vec::with_capacity(want.len());
        for t in want {
            let i = match paths.iter().position(|&p| p == t.path) {
                Some(i) => i,
                None => {
                    sources.push(Self::of(&t.path)?);
                    paths.push(&t.path);
                    paths.len() - 1
                }
            };
            source_of.push(i);
        }
        Ok((sources, source_of))
    }

    fn of(path: &Path) -> Result<Self, PackCacheError> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        Ok(Self {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            size: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        })
    }
}

/// The cache file's name for a checkpoint of `identity`
/// (`model::snapshot::checkpoint_identity`).
pub fn file_name(identity: u64) -> String {
    format!("k3-packed-{identity:016x}.bin")
}

/// The body offsets of `want` laid out from the header page, each at a 4 KiB boundary, and
/// the end of the last.
fn layout(want: &[&StoredTensor]) -> (Vec<usize>, usize) {
    let mut at = IO_ALIGN;
    let mut bodies = Vec::with_capacity(want.len());
    for t in want {
        bodies.push(at);
        let cols = t.pack_cols.expect("only packable matrices are cached");
        at += packed_body_bytes(t.rows, cols).next_multiple_of(IO_ALIGN);
    }
    (bodies, at)
}

impl PackCache {
    /// The matrix named `name` (as stored), if the cache holds it.
    pub fn get(&self, name: &str) -> Option<&PackedTensor> {
        self.position(name).map(|i| self.at(i))
    }

    /// The index of the matrix named `name`, if the cache holds it ([`Self::at`]).
    pub fn position(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The matrix at index `i` (of [`Self::position`]).
    pub fn at(&self, i: usize) -> &PackedTensor {
        &self.tensors[i]
    }

    /// The cache file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes held in memory: every matrix's exception blocks and row index.
    pub fn side_bytes(&self) -> u64 {
        self.tensors.iter().map(PackedTensor::side_bytes).sum()
    }

    /// Bytes of the packed bodies on disk, and the BF16 bytes they stand for.
    pub fn body_bytes(&self) -> (u64, u64) {
        self.tensors.iter().fold((0, 0), |(p, b), t| {
            (
                p + packed_body_bytes(t.rows, t.cols) as u64,
                b + (2 * t.rows * t.cols) as u64,
            )
        })
    }

    /// The cache of `want` (a [`crate::plan::WeightSizes::packable`] list of a checkpoint
    /// whose identity is `identity`) in the first of `dirs` that has a matching one or takes a new
    /// one; packing runs on `pool`, the reads on an I/O thread on `io_cpus`. The error of each
    /// directory tried where none works.
    pub fn open_or_write(
        dirs: &[PathBuf],
        identity: u64,
        want: &[&StoredTensor],
        pool: &Pool,
        io_cpus: &[usize],
    ) -> Result<(Self, Outcome), Vec<PackCacheError>> {
        let mut stale = Vec::new();
        for dir in dirs {
            let path = dir.join(file_name(identity));
            match Self::open(&path, identity, want) {
                Ok(Ok(cache)) => return Ok((cache, Outcome::Opened)),
                Ok(Err(why)) => stale.push((path, why)),
                Err(e) => stale.push((path, e.to_string())),
            }
        }
        let mut errors = Vec::new();
        for (path, why) in stale {
            let started = std::time::Instant::now();
            match Self::write(&path, identity, want, pool, io_cpus) {
                Ok(cache) => {
                    let seconds = started.elapsed().as_secs_f64();
                    return Ok((cache, Outcome::Written { why, seconds }));
                }
                Err(e) => errors.push(e),
            }
        }
        Err(errors)
    }

    /// The cache at `path` if it holds `want` for `identity` as the sources now are;
    /// `Ok(Err(why))` where there is none or it is stale.
    pub fn open(
        path: &Path,
        identity: u64,
        want: &[&StoredTensor],
    ) -> Result<Result<Self, String>, PackCacheError> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Err("none was there".into()));
            }
            Err(e) => return Err(io(path)(e)),
        };
        let mut header = [0u8; 64];
        let got = read_full(&file, &mut header, 0).map_err(io(path))?;
        let mut r = Reader(&header[..got]);
        if r.take(8) != Some(MAGIC) {
            return Ok(Err("it is not a pack cache".into()));
        }
        let version = r.u32();
        if version != Some(PACK_CACHE_VERSION) {
            return Ok(Err(format!(
                "it is version {version:?}, this build writes {PACK_CACHE_VERSION}"
            )));
        }
        if r.u64() != Some(identity) {
            return Ok(Err("it is of another checkpoint".into()));
        }
        let (Some(at), Some(len), Some(sum)) = (r.u64(), r.u64(), r.u64()) else {
            return Ok(Err("its header is cut short".into()));
        };
        let mut manifest = vec![0u8; len as usize];
        let got = read_full(&file, &mut manifest, at as usize).map_err(io(path))?;
        let _ = drop_page_cache(&file, 0, 0);
        if got as u64 != len || checksum(&manifest) != sum {
            return Ok(Err("its manifest is damaged".into()));
        }
        let Some((sources, tensors)) = parse(&manifest) else {
            return Ok(Err("its manifest is damaged".into()));
        };
        // Every wanted matrix there, from the same file and place, its source unchanged.
        let (bodies, _) = layout(want);
        let by_name: HashMap<String, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, (t, _, _))| (t.name.clone(), i))
            .collect();
        let (now, now_of) = Source::of_all(want)?;
        for ((w, &body), &own) in want.iter().zip(&bodies).zip(&now_of) {
            let Some(&(ref t, source, offset)) = by_name.get(&w.name).map(|&i| &tensors[i]) else {
                return Ok(Err(format!("it does not hold {}", w.name)));
            };
            let now = &now[own];
            if Some(now) != sources.get(source)
                || offset != w.offset
                || Some(t.cols) != w.pack_cols
                || t.rows != w.rows
                || t.body != body
            {
                return Ok(Err(format!(
                    "{} or its file ({}) changed since it was written",
                    w.name, now.name
                )));
            }
        }
        let tensors: Vec<PackedTensor> = tensors.into_iter().map(|(t, _, _)| t).collect();
        Ok(Ok(Self {
            path: path.to_owned(),
            by_name,
            tensors,
        }))
    }

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
        let written = write_file(&tmp, identity, want, &bodies, end, pool, io_cpus);
        let done = written.and_then(|()| std::fs::rename(&tmp, path).map_err(io(path)));
        if let Err(e) = done {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        match Self::open(path, identity, want)? {
            Ok(cache) => Ok(cache),
            Err(why) => Err(PackCacheError::Io {
                path: path.to_owned(),
                source: std::io::Error::other(format!("written, then read back: {why}")),
            }),
        }
    }
}

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

/// Writes the whole cache file at `tmp`; see [`PackCache::write`].
fn write_file(
    tmp: &Path,
    identity: u64,
    want: &[&StoredTensor],
    bodies: &[usize],
    end: usize,
    pool: &Pool,
    io_cpus: &[usize],
) -> Result<(), PackCacheError> {
    let direct = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(tmp);
    let file = match direct {
        Ok(f) => f,
        // A filesystem without O_DIRECT (tmpfs): buffered, the pages dropped after.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .map_err(io(tmp))?,
        Err(e) => return Err(io(tmp)(e)),
    };
    let mut readers: Vec<Arc<ShardReader>> = Vec::new();
    let (sources, source_of) = Source::of_all(want)?;
    let mut pieces = Vec::with_capacity(want.len());
    let mut chunks = Vec::new();
    for (i, t) in want.iter().enumerate() {
        let cols = t.pack_cols.expect("only packable matrices are cached");
        let reader = crate::model::trunk_reader(&mut readers, &t.path)?;
        let row = 2 * cols;
        let step = (STAGING / row).max(1);
        for first in (0..t.rows).step_by(step) {
            chunks.push((i, first, (first + step).min(t.rows)));
        }
        pieces.push((reader, t.offset, row));
    }
    let largest = want
        .iter()
        .map(|t| {
            let cols = t.pack_cols.unwrap_or(0);
            packed_body_bytes((STAGING / (2 * cols).max(1)).max(1).min(t.rows), cols)
        })
        .max()
        .unwrap_or(0);
    let mut out = AlignedBuf::zeroed(largest + IO_ALIGN);
    let mut carry = 0;
    let mut pos = 0;
    let mut exceptions: Vec<Vec<u8>> = vec![Vec::new(); want.len()];
    let mut row_exceptions: Vec<Vec<u32>> = vec![Vec::new(); want.len()];
    let mut write_error = None;
    crate::model::trunk_read_chunks(pieces, &chunks, io_cpus, |i, first, last, bf16| {
        let t = want[i];
        let cols = t.pack_cols.expect("only packable matrices are cached");
        if first == 0 {
            pos = bodies[i];
            carry = 0;
        }
        let n = packed_body_bytes(last - first, cols);
        crate::model::trunk_pack_on(
            pool,
            bf16,
            cols,
            &mut out[carry..carry + n],
            &mut exceptions[i],
            &mut row_exceptions[i],
        )?;
        let total = carry + n;
        let whole = if last == t.rows {
            out[total..total.next_multiple_of(IO_ALIGN)].fill(0);
            total.next_multiple_of(IO_ALIGN)
        } else {
            total / IO_ALIGN * IO_ALIGN
        };
        if let Err(e) = file.write_all_at(&out[..whole], pos as u64) {
            write_error = Some(e);
            return Err(ModelError::Pool("the pack cache's write failed".into()));
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
        None => e.into(),
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
        let blocks = exceptions[i].len() / EXCEPTION_BYTES;
        row_exceptions[i].push(u32::try_from(blocks).expect("under 2^32 exception blocks"));
        put_str(&mut m, &t.name);
        put_u32(&mut m, source_of[i] as u32);
        put_u64(&mut m, t.offset as u64);
        put_u64(&mut m, t.rows as u64);
        put_u64(&mut m, t.pack_cols.unwrap_or(0) as u64);
        put_u64(&mut m, bodies[i] as u64);
        put_u64(&mut m, blocks as u64);
        m.extend_from_slice(&exceptions[i]);
        for &r in &row_exceptions[i] {
            put_u32(&mut m, r);
        }
    }
    let mut header = Vec::with_capacity(64);
    header.extend_from_slice(MAGIC);
    put_u32(&mut header, PACK_CACHE_VERSION);
    put_u64(&mut header, identity);
    put_u64(&mut header, end as u64);
    put_u64(&mut header, m.len() as u64);
    put_u64(&mut header, checksum(&m));
    for (at, bytes) in [(end, &m), (0, &header)] {
        let mut page = AlignedBuf::zeroed(bytes.len().next_multiple_of(IO_ALIGN).max(IO_ALIGN));
        page[..bytes.len()].copy_from_slice(bytes);
        file.write_all_at(&page, at as u64).map_err(io(tmp))?;
    }
    file.sync_all().map_err(io(tmp))?;
    let _ = drop_page_cache(&file, 0, 0);
    Ok(())
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

fn checksum(bytes: &[u8]) -> u64 {
    let mut sum = Checksum::new();
    sum.update(bytes);
    sum.finish()
}

fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}

fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

fn put_str(v: &mut Vec<u8>, s: &str) {
    put_u32(v, s.len() as u32);
    v.extend_from_slice(s.as_bytes());
}

/// Little-endian fields off the front of a byte slice; `None` past its end.
struct Reader<'b>(&'b [u8]);

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize) -> Option<&'b [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }

    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// The manifest's sources and matrices (each with its source index and offset in it).
#[allow(clippy::type_complexity)]
fn parse(manifest: &[u8]) -> Option<(Vec<Source>, Vec<(PackedTensor, usize, usize)>)> {
    let mut r = Reader(manifest);
    let n = r.u32()? as usize;
    let mut sources = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        sources.push(Source {
            name: r.string()?,
            size: r.u64()?,
            mtime: (r.u64()? as i64, r.u64()? as i64),
        });
    }
    let n = r.u32()? as usize;
    let mut tensors = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let name = r.string()?;
        let source = r.u32()? as usize;
        let offset = r.usize()?;
        let rows = r.usize()?;
        let cols = r.usize()?;
        let body = r.usize()?;
        let blocks = r.usize()?;
        let exceptions = r.take(blocks.checked_mul(EXCEPTION_BYTES)?)?.to_vec();
        let index = r.take(rows.checked_add(1)?.checked_mul(4)?)?;
        let row_exceptions: Vec<u32> = index
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        // The index must be monotone and end at the block count (the views check it too).
        if row_exceptions.windows(2).any(|w| w[0] > w[1])
            || row_exceptions.last().map(|&l| l as usize) != Some(blocks)
            || source >= sources.len()
        {
            return None;
        }
        tensors.push((
            PackedTensor {
                name,
                rows,
                cols,
                body,
                exceptions,
                row_exceptions,
            },
            source,
            offset,
        ));
    }
    r.0.is_empty().then_some((sources, tensors))
}

#[cfg(test)]
mod tests;
