//! Making the resident copy: tensors read every token copied out of the file mappings into
//! one anonymous buffer advised for huge pages.

use super::error::{CheckpointError, Result};
use super::open::Checkpoint;
use super::storage::Resident;

/// Alignment of each resident tensor's first byte (a cache line, as the kernels' loads like).
const RESIDENT_ALIGN: usize = 64;

impl Checkpoint {
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
}
