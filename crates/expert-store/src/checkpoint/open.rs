//! Opening a checkpoint directory (the index, each shard mapped once and its header parsed
//! once) and looking its tensors up by name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;

use super::error::{CheckpointError, Result};
use super::index::{read_index, vision_only};
use super::storage::{Entry, Resident, Shard, TensorRef};
use crate::file::open_regular;

/// Name prefix of text tensors in the release (absent in some repacks).
pub const TEXT_PREFIX: &str = "language_model.";

/// A mapped checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub(super) dir: PathBuf,
    pub(super) shards: Vec<Shard>,
    pub(super) tensors: HashMap<String, Entry>,
    pub(super) resident: Option<Resident>,
    /// `TEXT_PREFIX` if the checkpoint's text tensors carry it, else empty.
    pub(super) prefix: &'static str,
    /// Index files absent because they hold only vision tensors.
    pub(super) skipped: Vec<String>,
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
            // A FIFO or a device in a shard's place is refused by kind, never opened in a
            // way that waits, and never mapped.
            let handle = match open_regular(&path) {
                Ok((handle, _)) => handle,
                // A text-only download may leave out the shards that hold nothing but the
                // vision tower and projector: their tensors are never read.
                Err(e)
                    if e.is_not_found()
                        && weight_map.as_ref().is_some_and(|m| vision_only(m, file)) =>
                {
                    skipped.push(file.clone());
                    continue;
                }
                Err(e) => return Err(e.into()),
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

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of tensors in all files.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the files hold no tensor at all.
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
}
