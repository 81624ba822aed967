//! The pack cache file's format: its magic and version, the header, the layout of the bodies,
//! the manifest written and parsed, and the source files it was packed from.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use expert_store::io::IO_ALIGN;
use mxfp4_kernels::packed::EXCEPTION_BYTES;

use crate::io::checksum::Checksum;
use crate::plan::StoredTensor;

use super::types::{PackCacheError, PackedTensor, io};

/// The file's first bytes.
pub(super) const MAGIC: &[u8; 8] = b"K3PACKED";
/// Bumped whenever the layout of the file or of a packed block changes (2: a format per
/// matrix, requantised trunks; 3: the file's length and a checksum in the header, each body's
/// checksum in the manifest).
pub(super) const PACK_CACHE_VERSION: u32 = 3;

/// The header's fields, at the start of the file's first page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) identity: u64,
    /// Where the manifest starts (a 4 KiB boundary past the last body).
    pub(super) manifest_at: u64,
    pub(super) manifest_len: u64,
    pub(super) manifest_sum: u64,
    /// The whole file's length: a file cut short or extended is refused before any of it is
    /// used.
    pub(super) file_len: u64,
}

/// Bytes of the header: magic, version, five fields and its own checksum.
pub(super) const HEADER_BYTES: usize = 8 + 4 + 5 * 8 + 8;

impl Header {
    pub(super) fn to_bytes(self) -> Vec<u8> {
        let mut h = Vec::with_capacity(HEADER_BYTES);
        h.extend_from_slice(MAGIC);
        put_u32(&mut h, PACK_CACHE_VERSION);
        for x in [
            self.identity,
            self.manifest_at,
            self.manifest_len,
            self.manifest_sum,
            self.file_len,
        ] {
            put_u64(&mut h, x);
        }
        let sum = checksum(&h);
        put_u64(&mut h, sum);
        h
    }

    /// The header at the front of `bytes` for a checkpoint of `identity`, or why it is not a
    /// usable one.
    pub(super) fn parse(bytes: &[u8], identity: u64) -> Result<Self, String> {
        let mut r = Reader(bytes);
        if r.take(8) != Some(MAGIC) {
            return Err("it is not a pack cache".into());
        }
        let version = r.u32();
        if version != Some(PACK_CACHE_VERSION) {
            return Err(format!(
                "it is version {version:?}, this build writes {PACK_CACHE_VERSION}"
            ));
        }
        let fields: Option<Vec<u64>> = (0..6).map(|_| r.u64()).collect();
        let Some([id, manifest_at, manifest_len, manifest_sum, file_len, sum]) =
            fields.and_then(|f| <[u64; 6]>::try_from(f).ok())
        else {
            return Err("its header is cut short".into());
        };
        if checksum(&bytes[..HEADER_BYTES - 8]) != sum {
            return Err("its header is damaged".into());
        }
        if id != identity {
            return Err("it is of another checkpoint or trunk format".into());
        }
        Ok(Self {
            identity: id,
            manifest_at,
            manifest_len,
            manifest_sum,
            file_len,
        })
    }

    /// Where the manifest lies (offset, length), if the header places it where a writer
    /// would in a file of `size` bytes: from a 4 KiB boundary past the header page, padded to
    /// the file's end, which is where the header says. Checked before anything is allocated
    /// for it.
    pub(super) fn manifest(&self, size: u64) -> Result<(usize, usize), String> {
        if self.file_len != size {
            return Err(format!(
                "it is {size} bytes, its header says {} (cut short or extended)",
                self.file_len
            ));
        }
        let align = IO_ALIGN as u64;
        let padded = self
            .manifest_len
            .checked_next_multiple_of(align)
            .map(|p| p.max(align));
        let fits = self.manifest_at >= align
            && self.manifest_at.is_multiple_of(align)
            && padded.and_then(|p| p.checked_add(self.manifest_at)) == Some(size);
        match (
            fits,
            usize::try_from(self.manifest_at),
            usize::try_from(self.manifest_len),
        ) {
            (true, Ok(at), Ok(len)) => Ok((at, len)),
            _ => Err(format!(
                "its header places the manifest ({} bytes at {}) outside its {size} bytes",
                self.manifest_len, self.manifest_at
            )),
        }
    }
}

/// A source file as the manifest records it: its name in the checkpoint directory, size and
/// modification time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Source {
    pub(super) name: String,
    pub(super) size: u64,
    pub(super) mtime: (i64, i64),
}

impl Source {
    /// The distinct source files of `want` (each stated once, in first use), and per matrix
    /// the index of its own.
    pub(super) fn of_all(
        want: &[&StoredTensor],
    ) -> Result<(Vec<Self>, Vec<usize>), PackCacheError> {
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

    pub(super) fn of(path: &Path) -> Result<Self, PackCacheError> {
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

/// The body offsets of `want` laid out from the header page, each at a 4 KiB boundary, and
/// the end of the last.
pub(super) fn layout(want: &[&StoredTensor]) -> (Vec<usize>, usize) {
    let mut at = IO_ALIGN;
    let mut bodies = Vec::with_capacity(want.len());
    for t in want {
        bodies.push(at);
        let how = t.pack_as().expect("only packable matrices are cached");
        at += how.body_bytes(t.rows).next_multiple_of(IO_ALIGN);
    }
    (bodies, at)
}

pub(super) fn checksum(bytes: &[u8]) -> u64 {
    let mut sum = Checksum::new();
    sum.update(bytes);
    sum.finish()
}

pub(super) fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}

pub(super) fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

pub(super) fn put_str(v: &mut Vec<u8>, s: &str) {
    put_u32(v, s.len() as u32);
    v.extend_from_slice(s.as_bytes());
}

/// Little-endian fields off the front of a byte slice; `None` past its end.
pub(super) struct Reader<'b>(pub(super) &'b [u8]);

impl<'b> Reader<'b> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'b [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    pub(super) fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }

    pub(super) fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// The manifest's sources and matrices (each with its source index and offset in it); every
/// body within the file's bodies (`IO_ALIGN..bodies_end`).
#[allow(clippy::type_complexity)]
pub(super) fn parse(
    manifest: &[u8],
    bodies_end: usize,
) -> Option<(Vec<Source>, Vec<(PackedTensor, usize, usize)>)> {
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
        let format = r.u32()?;
        let body = r.usize()?;
        let sum = r.u64()?;
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
            || format > 2
            || (format != 0 && blocks != 0)
            || !cols.is_multiple_of(32)
        {
            return None;
        }
        let t = PackedTensor {
            name,
            rows,
            cols,
            format,
            body,
            sum,
            exceptions,
            row_exceptions,
        };
        // Every format takes under 2 bytes a weight: with this bound its size cannot overflow.
        rows.checked_mul(cols)?.checked_mul(2)?;
        if body < IO_ALIGN || body.checked_add(t.body_bytes())? > bodies_end {
            return None;
        }
        tensors.push((t, source, offset));
    }
    r.0.is_empty().then_some((sources, tensors))
}
