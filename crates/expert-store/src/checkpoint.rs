//! A checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Each file is mapped once and its header parsed once; tensors
//! are looked up by name (the release's `language_model.` prefix is probed) and handed out as
//! borrowed bytes or as the kernels' validated views. Formats are read from the headers, not
//! implied by names: a linear weight may be BF16, F16, F32 or MXFP4 ([`Checkpoint::linear`]),
//! a float vector F32, BF16 or F16 ([`Checkpoint::f32_values`]).
//!
//! Hard failures with clear words: a truncated shard, overlapping or out-of-order data ranges
//! (the `safetensors` crate checks that a header's ranges tile the file exactly), a tensor the
//! index names but its shard lacks, or a shape/dtype a view cannot take is an error naming the
//! file and the tensor. Nothing here panics on file contents.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mxfp4_kernels::codes::f16_to_f32;
use mxfp4_kernels::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix, WeightMatrix};
pub use safetensors::Dtype;
use safetensors::SafeTensors;

/// Name prefix of text tensors in the release (absent in some repacks).
pub const TEXT_PREFIX: &str = "language_model.";

/// What is wrong with a checkpoint, naming the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { path: PathBuf },
    #[error("{path}: bad index: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("{path}: bad safetensors header or data layout: {reason}")]
    Header { path: PathBuf, reason: String },
    #[error("{path}: tensor {tensor} is listed in the index but not in this file")]
    NotInShard { path: PathBuf, tensor: String },
    #[error("tensor {tensor} is stored twice: in {first} and {second}")]
    Duplicate {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("tensor {tensor} is missing")]
    Missing { tensor: String },
    #[error("{path}: tensor {tensor}: expected {expected}, found {found}")]
    Mismatch {
        path: PathBuf,
        tensor: String,
        expected: String,
        found: String,
    },
    #[error("{path}: tensor {tensor}: {source}")]
    View {
        path: PathBuf,
        tensor: String,
        source: mxfp4_kernels::Error,
    },
}

type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// One mapped file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// Where a tensor lives: its shard, dtype, shape and absolute byte range in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A tensor found in a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// The name as stored (with the prefix, if the checkpoint has one).
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// Absolute byte range in the file.
    pub offset: usize,
    pub bytes: &'a [u8],
}

/// Where a routed expert's six tensors (`w1`/`w2`/`w3` × `weight_packed`/`weight_scale`) lie.
/// They may be split over several shards (a re-sharded checkpoint): [`Self::pieces`] are the
/// runs of tensors stored back to back in one file, one read each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLocation {
    /// The file of the first piece (in file order: shard order, then offset).
    pub path: PathBuf,
    /// First byte of the lowest of the tensors in `path`.
    pub offset: usize,
    /// From `offset` to the end of the highest of the tensors in `path`.
    pub len: usize,
    /// The six tensors are back to back in one file (one read fetches exactly them).
    pub contiguous: bool,
    /// Each tensor's absolute byte range in its file ([`Self::tensor_path`]), in
    /// [`EXPERT_TENSORS`] order.
    pub tensors: [std::ops::Range<usize>; 6],
    /// The runs of tensors back to back in one file, in file order; every tensor lies in one.
    pub pieces: Vec<ExpertPiece>,
    /// Each tensor's piece (an index into `pieces`), in [`EXPERT_TENSORS`] order.
    pub tensor_piece: [usize; 6],
}

/// A run of an expert's tensors stored back to back in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPiece {
    pub path: PathBuf,
    /// Absolute byte range in the file.
    pub range: std::ops::Range<usize>,
}

impl ExpertLocation {
    /// The file holding tensor `i` (in [`EXPERT_TENSORS`] order).
    pub fn tensor_path(&self, i: usize) -> &Path {
        &self.pieces[self.tensor_piece[i]].path
    }

    /// Whether the six tensors lie in more than one file.
    pub fn spans_shards(&self) -> bool {
        self.pieces.iter().any(|p| p.path != self.path)
    }
}

/// The six tensors of a routed expert, in the order [`ExpertLocation::tensors`] keeps them:
/// gate (`w1`), up (`w3`) and down (`w2`), each packed codes then scales.
pub const EXPERT_TENSORS: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
];

/// The formats a linear weight may be stored in, as error messages name them.
pub const LINEAR_FORMATS: &str = "BF16, F16 or F32 (or MXFP4 weight_packed + weight_scale)";

/// The formats a float vector (norm, bias, conv taps, `A_log`) may be stored in.
pub const VECTOR_FORMATS: &str = "F32, BF16 or F16";

/// How a linear weight is stored ([`Checkpoint::linear_format`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinearStorage {
    /// `name` itself, of this dtype (BF16, F16 or F32).
    Float(Dtype),
    /// `{base}.weight_packed` + `{base}.weight_scale`, MXFP4.
    MxFp4(String),
}

/// Tensors copied out of the file mappings into anonymous memory advised for huge pages.
#[derive(Debug)]
struct Resident {
    map: Mmap,
    /// Stored name -> byte range in `map`.
    ranges: HashMap<String, std::ops::Range<usize>>,
}

/// Alignment of each resident tensor's first byte (a cache line, as the kernels' loads like).
const RESIDENT_ALIGN: usize = 64;

/// A mapped checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
    resident: Option<Resident>,
    /// `TEXT_PREFIX` if the checkpoint's text tensors carry it, else empty.
    prefix: &'static str,
    /// Index files absent because they hold only vision tensors.
    skipped: Vec<String>,
}

impl Checkpoint {
    /// Opens `dir`: maps `model.safetensors`, or every shard the index names, and parses each
    /// header once. Files the index does not name are not opened.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (files, weight_map, total_size) = if index_path.exists() {
            let index = read_index(&index_path)?;
            (index.files, Some(index.weight_map), index.total_size)
        } else if single.exists() {
            (vec!["model.safetensors".to_owned()], None, None)
        } else {
            return Err(CheckpointError::NoWeights {
                path: dir.to_owned(),
            });
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        let mut data_bytes = 0usize;
        let mut skipped = Vec::new();
        for file in &files {
            let path = dir.join(file);
            let handle = match File::open(&path) {
                Ok(handle) => handle,
                // A text-only download may leave out the shards that hold nothing but the
                // vision tower and projector: their tensors are never read.
                Err(e)
                    if e.kind() == std::io::ErrorKind::NotFound
                        && weight_map.as_ref().is_some_and(|m| vision_only(m, file)) =>
                {
                    skipped.push(file.clone());
                    continue;
                }
                Err(source) => {
                    return Err(CheckpointError::Io {
                        path: path.clone(),
                        source,
                    });
                }
            };
            // SAFETY: the mapping is read-only and lives as long as `self`. The contract we
            // rely on — nobody truncates or rewrites a checkpoint while it is being served —
            // is the same every mmap-based loader makes; a truncation would fault, not lie.
            let map = unsafe { Mmap::map(&handle) }.map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&map).map_err(|e| CheckpointError::Header {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            let data_start = 8 + header_len;
            let shard = shards.len();
            for (name, info) in metadata.tensors() {
                let entry = Entry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0,
                    end: data_start + info.data_offsets.1,
                };
                data_bytes += entry.end - entry.start;
                if let Some(previous) = tensors.insert(name.clone(), entry) {
                    return Err(CheckpointError::Duplicate {
                        tensor: name,
                        first: shards
                            .get(previous.shard)
                            .map_or_else(|| path.clone(), |s: &Shard| s.path.clone()),
                        second: path.clone(),
                    });
                }
            }
            shards.push(Shard { path, map });
        }
        if let Some(weight_map) = &weight_map {
            for (tensor, file) in weight_map {
                if skipped.contains(file) {
                    continue;
                }
                let listed = shards
                    .iter()
                    .position(|s: &Shard| s.path == dir.join(file))
                    .expect("every index file not skipped was mapped");
                match tensors.get(tensor) {
                    Some(entry) if entry.shard == listed => {}
                    _ => {
                        return Err(CheckpointError::NotInShard {
                            path: dir.join(file),
                            tensor: tensor.clone(),
                        });
                    }
                }
            }
        }
        // The total counts the absent vision shards too, so it is checked only when every
        // shard is here.
        if let Some(total) = total_size
            && skipped.is_empty()
            && total != data_bytes
        {
            return Err(CheckpointError::Index {
                path: index_path,
                reason: format!(
                    "metadata.total_size is {total} but the shards hold {data_bytes} bytes of tensors"
                ),
            });
        }
        let prefix = if tensors.keys().any(|k| k.starts_with(TEXT_PREFIX)) {
            TEXT_PREFIX
        } else {
            ""
        };
        if !skipped.is_empty() {
            log::info!(
                "{}: {} shard(s) holding only vision tensors are absent and not needed: {}",
                dir.display(),
                skipped.len(),
                skipped.join(", ")
            );
        }
        Ok(Self {
            dir: dir.to_owned(),
            shards,
            tensors,
            resident: None,
            prefix,
            skipped,
        })
    }

    /// Shards the index names that are absent because they hold only vision tensors.
    pub fn skipped_shards(&self) -> &[String] {
        &self.skipped
    }

    /// Copies every tensor whose stored name passes `keep` into one anonymous buffer advised
    /// for transparent huge pages; [`Checkpoint::tensor`] then hands out those copies (with the
    /// same file `offset`). Streaming a weight from the 4 KiB pages of the file mapping costs
    /// about 10% of read bandwidth at 2 threads against huge pages (PERFORMANCE.md, phase 3),
    /// so weights read every token (the trunk) belong here. Replaces any earlier copy; returns
    /// the size of the copy (the tensors in file order, each from a 64-byte boundary). The file pages stay in the page cache until the kernel evicts them.
    pub fn make_resident(&mut self, keep: impl Fn(&str) -> bool) -> Result<usize> {
        self.make_resident_placed(keep, |_, _, _| {})
    }

    /// [`Checkpoint::make_resident`], calling `place(name, shape, bytes)` on each tensor's
    /// destination before the copy touches it: the caller binds pages to NUMA nodes there
    /// (e.g. each domain's rows to its node), so the copy's page faults allocate them there.
    pub fn make_resident_placed(
        &mut self,
        keep: impl Fn(&str) -> bool,
        mut place: impl FnMut(&str, &[usize], &mut [u8]),
    ) -> Result<usize> {
        let mut names: Vec<&String> = self.tensors.keys().filter(|k| keep(k)).collect();
        // File order: one sequential pass over each shard.
        names.sort_by_key(|k| (self.tensors[*k].shard, self.tensors[*k].start));
        let mut placed = Vec::with_capacity(names.len());
        let mut len: usize = 0;
        for name in names {
            let entry = &self.tensors[name];
            let start = len.next_multiple_of(RESIDENT_ALIGN);
            len = start + (entry.end - entry.start);
            placed.push((name.clone(), start..len));
        }
        self.resident = None;
        let anon_error = |source| CheckpointError::Io {
            path: self.dir.clone(),
            source,
        };
        let mut map = memmap2::MmapMut::map_anon(len.max(1)).map_err(anon_error)?;
        // Advice only: where THP is off the copy still works, on 4 KiB pages.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        for (name, range) in &placed {
            let entry = &self.tensors[name];
            place(name, &entry.shape, &mut map[range.clone()]);
            map[range.clone()]
                .copy_from_slice(&self.shards[entry.shard].map[entry.start..entry.end]);
        }
        let map = map.make_read_only().map_err(anon_error)?;
        self.resident = Some(Resident {
            map,
            ranges: placed.into_iter().collect(),
        });
        Ok(len)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of tensors in all files.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Every tensor's stored name (with the prefix, if the checkpoint has one), in no order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.end - e.start).sum()
    }

    /// Looks up a text tensor by its name relative to the text model (`model.norm.weight`),
    /// probing the release's `language_model.` prefix.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let stored = format!("{}{name}", self.prefix);
        let (key, entry) = self
            .tensors
            .get_key_value(&stored)
            .or_else(|| self.tensors.get_key_value(name))?;
        let shard = &self.shards[entry.shard];
        let bytes = match &self.resident {
            Some(resident) => match resident.ranges.get(key) {
                Some(range) => &resident.map[range.clone()],
                None => &shard.map[entry.start..entry.end],
            },
            None => &shard.map[entry.start..entry.end],
        };
        Some(TensorRef {
            name: key,
            path: &shard.path,
            dtype: entry.dtype,
            shape: &entry.shape,
            offset: entry.start,
            bytes,
        })
    }

    /// Like [`Checkpoint::tensor`], with a `Missing` error.
    pub fn require(&self, name: &str) -> Result<TensorRef<'_>> {
        self.tensor(name).ok_or_else(|| CheckpointError::Missing {
            tensor: format!("{}{name}", self.prefix),
        })
    }

    /// A BF16 matrix `[rows, cols]`.
    pub fn bf16_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Bf16Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::BF16, &[rows, cols])?;
        Bf16Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// An F16 matrix `[rows, cols]`.
    pub fn f16_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<F16Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::F16, &[rows, cols])?;
        F16Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// An F32 matrix `[rows, cols]`.
    pub fn f32_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<F32Matrix<'_>> {
        let t = self.require(name)?;
        expect(&t, Dtype::F32, &[rows, cols])?;
        F32Matrix::new(t.bytes, rows, cols).map_err(|source| view_error(&t, source))
    }

    /// A linear layer's weight `[rows, cols]` in whatever format the checkpoint stores it:
    /// `name` (`....weight`) as BF16, F16 or F32, or, where `name` is absent, MXFP4 as
    /// `{base}.weight_packed` + `{base}.weight_scale` (compressed-tensors, as the routed
    /// experts; `base` is `name` without `.weight`). Errors name the tensor, the formats
    /// accepted and what was found.
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix<'_>> {
        match self.linear_format(name)? {
            LinearStorage::Float(Dtype::BF16) => self.bf16_matrix(name, rows, cols).map(Into::into),
            LinearStorage::Float(Dtype::F16) => self.f16_matrix(name, rows, cols).map(Into::into),
            LinearStorage::Float(_) => self.f32_matrix(name, rows, cols).map(Into::into),
            LinearStorage::MxFp4(base) => self.mxfp4_matrix(&base, rows, cols).map(Into::into),
        }
    }

    /// How the linear weight `name` is stored (see [`Checkpoint::linear`]), checking the dtype
    /// but not the shape.
    pub fn linear_format(&self, name: &str) -> Result<LinearStorage> {
        if let Some(t) = self.tensor(name) {
            return match t.dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(LinearStorage::Float(t.dtype)),
                found => Err(CheckpointError::Mismatch {
                    path: t.path.to_owned(),
                    tensor: t.name.to_owned(),
                    expected: format!("{LINEAR_FORMATS} {:?}", t.shape),
                    found: format!("{found:?} {:?}", t.shape),
                }),
            };
        }
        match name.strip_suffix(".weight") {
            Some(base) if self.tensor(&format!("{base}.weight_packed")).is_some() => {
                Ok(LinearStorage::MxFp4(base.to_owned()))
            }
            Some(base) => Err(CheckpointError::Missing {
                tensor: format!(
                    "{p}{name} (or MXFP4 {p}{base}.weight_packed + weight_scale)",
                    p = self.prefix
                ),
            }),
            None => Err(CheckpointError::Missing {
                tensor: format!("{}{name}", self.prefix),
            }),
        }
    }

    /// A floating-point tensor of `shape` as f32, copied out (the mapping gives no alignment
    /// guarantee). The dtype is the header's: F32 as is, BF16 and F16 widened (exactly).
    pub fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.require(name)?;
        let dtype = t.dtype;
        if !matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) || t.shape != shape {
            return Err(CheckpointError::Mismatch {
                path: t.path.to_owned(),
                tensor: t.name.to_owned(),
                expected: format!("{VECTOR_FORMATS} {shape:?}"),
                found: format!("{dtype:?} {:?}", t.shape),
            });
        }
        let halves = || {
            t.bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        };
        Ok(match dtype {
            Dtype::BF16 => halves()
                .map(|h| f32::from_bits(u32::from(h) << 16))
                .collect(),
            Dtype::F16 => halves().map(f16_to_f32).collect(),
            _ => t
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }

    /// An MXFP4 matrix `[rows, cols]` from `{base}.weight_packed` (U8 `[rows, cols/2]`) and
    /// `{base}.weight_scale` (U8 `[rows, cols/32]`); every scale byte is checked (0xFF is NaN).
    pub fn mxfp4_matrix(&self, base: &str, rows: usize, cols: usize) -> Result<MxFp4Matrix<'_>> {
        let packed = self.require(&format!("{base}.weight_packed"))?;
        let scales = self.require(&format!("{base}.weight_scale"))?;
        expect(&packed, Dtype::U8, &[rows, cols / 2])?;
        expect(&scales, Dtype::U8, &[rows, cols / 32])?;
        MxFp4Matrix::new(packed.bytes, scales.bytes, rows, cols)
            .map_err(|source| view_error(&scales, source))
    }

    /// Every routed expert's location, keyed `(layer, expert)`, built from the headers by name
    /// (`model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w2,w3}.{weight_packed,weight_scale}`).
    /// Experts are not stored in id order; this is the only way to find them. An expert's six
    /// tensors may lie in several files (a re-sharded checkpoint); see [`ExpertLocation`].
    pub fn expert_table(&self) -> Result<BTreeMap<(usize, usize), ExpertLocation>> {
        let mut parts: BTreeMap<(usize, usize), Vec<(usize, &Entry)>> = BTreeMap::new();
        for (name, entry) in &self.tensors {
            let relative = name.strip_prefix(self.prefix).unwrap_or(name);
            if let Some((key, part)) = parse_expert_name(relative) {
                parts.entry(key).or_default().push((part, entry));
            }
        }
        let mut table = BTreeMap::new();
        for ((layer, expert), mut entries) in parts {
            entries.sort_by_key(|&(part, _)| part);
            let path = &self.shards[entries[0].1.shard].path;
            let name = format!(
                "{}model.layers.{layer}.block_sparse_moe.experts.{expert}",
                self.prefix
            );
            if entries.len() != 6 {
                return Err(CheckpointError::Mismatch {
                    path: path.clone(),
                    tensor: name,
                    expected: "6 expert tensors (w1/w2/w3 weight_packed and weight_scale)".into(),
                    found: format!("{} tensors", entries.len()),
                });
            }
            let entries: Vec<&Entry> = entries.into_iter().map(|(_, e)| e).collect();
            // File order; a piece grows while the next tensor starts where it ends.
            let mut order: Vec<usize> = (0..6).collect();
            order.sort_by_key(|&i| (entries[i].shard, entries[i].start));
            let mut runs: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
            let mut tensor_piece = [0usize; 6];
            for i in order {
                let e = entries[i];
                match runs.last_mut() {
                    Some((shard, range)) if *shard == e.shard && range.end == e.start => {
                        range.end = e.end;
                    }
                    _ => runs.push((e.shard, e.start..e.end)),
                }
                tensor_piece[i] = runs.len() - 1;
            }
            let (first_shard, _) = runs[0];
            let in_first = entries.iter().filter(|e| e.shard == first_shard);
            let offset = in_first.clone().map(|e| e.start).min().unwrap_or(0);
            let end = in_first.map(|e| e.end).max().unwrap_or(0);
            table.insert(
                (layer, expert),
                ExpertLocation {
                    path: self.shards[first_shard].path.clone(),
                    offset,
                    len: end - offset,
                    contiguous: runs.len() == 1,
                    tensors: std::array::from_fn(|i| entries[i].start..entries[i].end),
                    pieces: runs
                        .into_iter()
                        .map(|(shard, range)| ExpertPiece {
                            path: self.shards[shard].path.clone(),
                            range,
                        })
                        .collect(),
                    tensor_piece,
                },
            );
        }
        Ok(table)
    }
}

/// Parses `model.layers.{l}.block_sparse_moe.experts.{e}.w{1,2,3}.weight_{packed,scale}` into
/// `((layer, expert), index in EXPERT_TENSORS)`.
fn parse_expert_name(name: &str) -> Option<((usize, usize), usize)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("block_sparse_moe.experts.")?;
    let (expert, rest) = rest.split_once('.')?;
    let part = EXPERT_TENSORS.iter().position(|t| *t == rest)?;
    Some(((layer.parse().ok()?, expert.parse().ok()?), part))
}

fn expect(t: &TensorRef<'_>, dtype: Dtype, shape: &[usize]) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(CheckpointError::Mismatch {
            path: t.path.to_owned(),
            tensor: t.name.to_owned(),
            expected: format!("{dtype:?} {shape:?}"),
            found: format!("{:?} {:?}", t.dtype, t.shape),
        });
    }
    Ok(())
}

fn view_error(t: &TensorRef<'_>, source: mxfp4_kernels::Error) -> CheckpointError {
    CheckpointError::View {
        path: t.path.to_owned(),
        tensor: t.name.to_owned(),
        source,
    }
}

/// Prefixes of the vision tower's and projector's tensors in the release (K3_SPEC §3.2).
const VISION_PREFIXES: [&str; 2] = ["vision_tower.", "mm_projector."];

/// Whether every tensor the index places in `file` belongs to the vision tower or projector.
fn vision_only(weight_map: &BTreeMap<String, String>, file: &str) -> bool {
    let mut names = weight_map.iter().filter(|(_, f)| *f == file).peekable();
    names.peek().is_some()
        && names.all(|(tensor, _)| {
            VISION_PREFIXES
                .iter()
                .any(|p| tensor.starts_with(p))
        })
}

/// A parsed index: the shard files in first-mention order, the weight map (tensor -> file),
/// and `metadata.total_size` if given.
struct Index {
    files: Vec<String>,
    weight_map: BTreeMap<String, String>,
    total_size: Option<usize>,
}

fn read_index(path: &Path) -> Result<Index> {
    let bad = |reason: String| CheckpointError::Index {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no weight_map object".into()))?;
    let mut files: Vec<String> = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(bad(format!(
                "weight_map[{tensor:?}] = {file:?} is not a plain file name"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_owned());
        }
        weight_map.insert(tensor.clone(), file.to_owned());
    }
    let total = match value.get("metadata").and_then(|m| m.get("total_size")) {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad("metadata.total_size is not a byte count".into()))?,
        ),
    };
    Ok(Index {
        files,
        weight_map,
        total_size: total,
    })
}
