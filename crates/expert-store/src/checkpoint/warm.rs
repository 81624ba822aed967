//! Warming the mapping: a run whose weights all fit in memory reads them through the file
//! mapping, and without this its first decode steps would fault in, from disk, every page a
//! step touches for the first time (a routed expert only when first chosen). `warm` reads the
//! tensors a decode uses into the page cache and maps them at startup instead.

use super::Checkpoint;

/// `MADV_POPULATE_READ` (Linux 5.14): fault in and map a range's pages, reading them from the
/// file; the call returns when they are resident. Not in the `libc` crate's list yet; the value
/// is the kernel's ABI.
#[cfg(target_os = "linux")]
const MADV_POPULATE_READ: libc::c_int = 22;

/// What [`Checkpoint::warm`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmed {
    /// Bytes of the tensors asked for (each range rounded out to pages).
    pub bytes: u64,
    /// Whether the pages are resident and mapped when `warm` returns (`MADV_POPULATE_READ`);
    /// `false`: the kernel only started reading them ahead (`MADV_WILLNEED`, older kernels).
    pub populated: bool,
}

impl Checkpoint {
    /// Reads the mapped tensors that `keep` selects (by stored name) into the page cache and
    /// maps them, shard by shard in file order, adjacent tensors in one call. Advice only: a
    /// refusal leaves the pages to be faulted in on first use, as without it. A copy made by
    /// [`Checkpoint::make_resident`] is not the mapping and is not touched.
    pub fn warm(&self, keep: impl Fn(&str) -> bool) -> Warmed {
        let page = page_size();
        let mut ranges: Vec<(usize, usize, usize)> = self
            .tensors
            .iter()
            .filter(|(name, _)| keep(name))
            .map(|(_, e)| {
                let start = e.start / page * page;
                let end = e
                    .end
                    .next_multiple_of(page)
                    .min(self.shards[e.shard].map.len());
                (e.shard, start, end)
            })
            .filter(|&(_, start, end)| start < end)
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(usize, usize, usize)> = Vec::new();
        for (shard, start, end) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == shard && start <= last.2 => last.2 = last.2.max(end),
                _ => merged.push((shard, start, end)),
            }
        }
        let mut warmed = Warmed {
            bytes: 0,
            populated: true,
        };
        for (shard, start, end) in merged {
            let map = &self.shards[shard].map;
            warmed.bytes += (end - start) as u64;
            warmed.populated &= advise(&map[start..end]);
        }
        warmed
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Populates `range` (page-aligned, inside a mapping): `true` where the kernel did, else starts
/// a read-ahead and says `false`.
#[cfg(target_os = "linux")]
fn advise(range: &[u8]) -> bool {
    let ptr = range.as_ptr().cast_mut().cast::<libc::c_void>();
    // SAFETY: `range` is a page-aligned part of a live read-only file mapping owned by the
    // checkpoint; both advices only read pages in and never change the mapping's contents.
    let populated = unsafe { libc::madvise(ptr, range.len(), MADV_POPULATE_READ) } == 0;
    if !populated {
        // SAFETY: as above.
        unsafe { libc::madvise(ptr, range.len(), libc::MADV_WILLNEED) };
    }
    populated
}

#[cfg(not(target_os = "linux"))]
fn advise(_range: &[u8]) -> bool {
    false
}
