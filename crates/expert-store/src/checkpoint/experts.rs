//! The expert table: where each routed expert's tensors lie, found in the headers by the
//! names an [`ExpertLayout`] gives, as runs of bytes one read each.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, Result};
use super::open::Checkpoint;
use super::storage::Entry;
use crate::layout::ExpertLayout;

/// Where a routed expert's tensors (its layout's matrices, each packed codes then scales) lie.
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
    /// The expert's tensors are back to back in one file (one read fetches exactly them).
    pub contiguous: bool,
    /// Each tensor's absolute byte range in its file ([`Self::tensor_path`]), in the layout's
    /// tensor order ([`ExpertLayout::tensor`]).
    pub tensors: Vec<Range<usize>>,
    /// The runs of tensors back to back in one file, in file order; every tensor lies in one.
    pub pieces: Vec<ExpertPiece>,
    /// Each tensor's piece (an index into `pieces`), in the layout's tensor order.
    pub tensor_piece: Vec<usize>,
}

/// A run of an expert's tensors stored back to back in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPiece {
    /// The file.
    pub path: PathBuf,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
}

impl ExpertLocation {
    /// The file holding tensor `i` (in the layout's tensor order).
    pub fn tensor_path(&self, i: usize) -> &Path {
        &self.pieces[self.tensor_piece[i]].path
    }

    /// Whether the expert's tensors lie in more than one file.
    pub fn spans_shards(&self) -> bool {
        self.pieces.iter().any(|p| p.path != self.path)
    }
}

impl Checkpoint {
    /// Every routed expert's location, keyed `(layer, expert)`, built from the headers by the
    /// names `layout` gives (relative to the text model: a `language_model.` prefix is
    /// stripped first). Experts are not stored in id order; this is the only way to find them.
    /// An expert with some but not all of its layout's tensors is an error. An expert's
    /// tensors may lie in several files (a re-sharded checkpoint); see [`ExpertLocation`].
    pub fn expert_table(
        &self,
        layout: &ExpertLayout,
    ) -> Result<BTreeMap<(usize, usize), ExpertLocation>> {
        let count = layout.tensor_count();
        let mut parts: BTreeMap<(usize, usize), Vec<Option<&Entry>>> = BTreeMap::new();
        for (name, entry) in &self.tensors {
            let relative = name.strip_prefix(self.prefix).unwrap_or(name);
            if let Some((key, part)) = layout.parse(relative) {
                let slots = parts.entry(key).or_insert_with(|| vec![None; count]);
                if slots[part].replace(entry).is_some() {
                    return Err(CheckpointError::Mismatch {
                        path: self.shards[entry.shard].path.clone(),
                        tensor: name.clone(),
                        expected: format!("one tensor named {}", layout.tensor(part)),
                        found: "two (with and without the prefix)".into(),
                    });
                }
            }
        }
        let mut table = BTreeMap::new();
        for ((layer, expert), slots) in parts {
            let Some(entries) = slots.iter().copied().collect::<Option<Vec<&Entry>>>() else {
                let found: Vec<&Entry> = slots.iter().flatten().copied().collect();
                let missing: Vec<String> = (0..count)
                    .filter(|&i| slots[i].is_none())
                    .map(|i| layout.tensor(i).name(layer, expert))
                    .collect();
                return Err(CheckpointError::Mismatch {
                    path: self.shards[found[0].shard].path.clone(),
                    tensor: format!("{}{}", self.prefix, layout.tensor(0).name(layer, expert)),
                    expected: format!("{count} expert tensors ({layout})"),
                    found: format!("{} tensors (missing {})", found.len(), missing.join(", ")),
                });
            };
            table.insert((layer, expert), self.locate(&entries));
        }
        Ok(table)
    }

    /// The location of one expert's tensors (`entries`, in layout order).
    fn locate(&self, entries: &[&Entry]) -> ExpertLocation {
        // File order; a piece grows while the next tensor starts where it ends.
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by_key(|&i| (entries[i].shard, entries[i].start));
        let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
        let mut tensor_piece = vec![0usize; entries.len()];
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
        ExpertLocation {
            path: self.shards[first_shard].path.clone(),
            offset,
            len: end - offset,
            contiguous: runs.len() == 1,
            tensors: entries.iter().map(|e| e.start..e.end).collect(),
            pieces: runs
                .into_iter()
                .map(|(shard, range)| ExpertPiece {
                    path: self.shards[shard].path.clone(),
                    range,
                })
                .collect(),
            tensor_piece,
        }
    }
}
