//! A pack cache file opened and checked against the checkpoint, or written where there is none
//! that matches; lookups of the matrices it holds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use expert_store::file::ReadFileError;
use expert_store::io::{drop_page_cache, read_full};
use numa_sched::Pool;

use crate::plan::{HeldPacked, StoredTensor, WeightSizes};

use super::format::{HEADER_BYTES, Header, Source, checksum, layout, parse};
use super::place::{Outcome, file_name};
use super::types::{PackCache, PackCacheError, PackedTensor, io};

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

    /// `sizes` with the matrices this cache holds read from it where streamed, and its side
    /// bytes counted ([`WeightSizes::with_packed`]).
    pub fn sizes_with(&self, sizes: WeightSizes) -> WeightSizes {
        sizes.with_packed(self.path(), self.side_bytes(), |name| {
            self.get(name).map(|t| HeldPacked {
                rows: t.rows,
                cols: t.cols,
                body: t.body,
            })
        })
    }

    /// Bytes held in memory: every matrix's exception blocks and row index.
    pub fn side_bytes(&self) -> u64 {
        self.tensors.iter().map(PackedTensor::side_bytes).sum()
    }

    /// Bytes of the packed (or requantised) bodies on disk, and the BF16 bytes they stand
    /// for.
    pub fn body_bytes(&self) -> (u64, u64) {
        self.tensors.iter().fold((0, 0), |(p, b), t| {
            (p + t.body_bytes() as u64, b + (2 * t.rows * t.cols) as u64)
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
    /// `Ok(Err(why))` where there is none or it is stale: not a regular file, a header or
    /// manifest that is damaged or does not fit the file's length. The bodies are checked
    /// against their checksums as they are first read ([`Self::verify`]), not here: that would
    /// read the whole file once more at every start.
    pub fn open(
        path: &Path,
        identity: u64,
        want: &[&StoredTensor],
    ) -> Result<Result<Self, String>, PackCacheError> {
        // Only a regular file, opened without waiting: a FIFO in its place must not hang the
        // start (its open waits for a writer otherwise).
        let (file, file_len) = match expert_store::file::open_regular(path) {
            Ok(opened) => opened,
            Err(e) if e.is_not_found() => return Ok(Err("none was there".into())),
            Err(ReadFileError::NotRegular { kind, .. }) => {
                return Ok(Err(format!("it is {kind}, not a regular file")));
            }
            Err(ReadFileError::Io { source, .. }) => return Err(io(path)(source)),
            Err(e) => unreachable!("an open reads nothing: {e}"),
        };
        let mut header = [0u8; HEADER_BYTES];
        let got = read_full(&file, &mut header, 0).map_err(io(path))?;
        let header = match Header::parse(&header[..got], identity) {
            Ok(h) => h,
            Err(why) => return Ok(Err(why)),
        };
        // Bounded by the file's size before its buffer is allocated.
        let (at, len) = match header.manifest(file_len) {
            Ok(placed) => placed,
            Err(why) => return Ok(Err(why)),
        };
        let mut manifest = vec![0u8; len];
        let got = read_full(&file, &mut manifest, at).map_err(io(path))?;
        let _ = drop_page_cache(&file, 0, 0);
        if got != len || checksum(&manifest) != header.manifest_sum {
            return Ok(Err("its manifest is damaged".into()));
        }
        let Some((sources, tensors)) = parse(&manifest, at) else {
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
                || w.pack_as().map(|h| (h.cols(), h.code())) != Some((t.cols, t.format))
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
}
