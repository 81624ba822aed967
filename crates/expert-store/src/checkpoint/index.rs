//! `model.safetensors.index.json`: the shard files and which tensor each holds, and the
//! vision-only shards a text-only download may leave out.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::{CheckpointError, Result};
use crate::file::read_regular_text;

/// The most bytes an index may hold. The release's is a few MB (one line per tensor, about a
/// hundred bytes each); this leaves room for a checkpoint of ten times its tensors, and stops
/// a file that is no index from being read whole.
pub(super) const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Prefixes of the vision tower's and projector's tensors in the release (docs/MODEL.md §3.2).
const VISION_PREFIXES: [&str; 2] = ["vision_tower.", "mm_projector."];

/// Whether every tensor the index places in `file` belongs to the vision tower or projector.
pub(super) fn vision_only(weight_map: &BTreeMap<String, String>, file: &str) -> bool {
    let mut names = weight_map.iter().filter(|(_, f)| *f == file).peekable();
    names.peek().is_some()
        && names.all(|(tensor, _)| VISION_PREFIXES.iter().any(|p| tensor.starts_with(p)))
}

/// A parsed index: the shard files in first-mention order, the weight map (tensor -> file),
/// and `metadata.total_size` if given.
pub(super) struct Index {
    pub(super) files: Vec<String>,
    pub(super) weight_map: BTreeMap<String, String>,
    pub(super) total_size: Option<usize>,
}

pub(super) fn read_index(path: &Path) -> Result<Index> {
    let bad = |reason: String| CheckpointError::Index {
        path: path.to_owned(),
        reason,
    };
    let text = read_regular_text(path, MAX_INDEX_BYTES)?;
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
