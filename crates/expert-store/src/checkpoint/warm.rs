//! Warming the mapping: a run whose weights all fit in memory reads them through the file
//! mapping, and without this its first decode steps would fault in, from disk, every page a
//! step touches for the first time (a routed expert only when first chosen). `warm` reads the
//! tensors a decode uses into the page cache and maps them at startup instead.

use super::open::Checkpoint;

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

/// Asks the kernel to read the pages under `bytes` into the page cache now, as one request
/// (`MADV_WILLNEED` on the page-rounded range), and returns at once. For a lookup of a few rows
/// of a mapped table that is mostly not in memory (the embedding under a memory budget): a
/// plain fault there reads the mapping's read-around window, which on this machine took 4-15
/// ms per 14 KB row (PERFORMANCE.md, phase 17), the advice 0.3-0.4 ms. Advice only: on memory
/// that is not a file mapping, or where the kernel refuses, the read faults as it would have.
pub fn read_ahead(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let page = page_size();
    let start = bytes.as_ptr() as usize / page * page;
    let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
    will_need(start, end - start);
}

#[cfg(target_os = "linux")]
fn will_need(start: usize, len: usize) {
    // SAFETY: the range covers whole pages of `bytes`, which a live borrow keeps mapped; the
    // advice only reads pages in and never changes the memory's contents. A range that is not
    // (all) a file mapping only makes the call fail, which is ignored.
    unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_WILLNEED) };
}

#[cfg(not(target_os = "linux"))]
fn will_need(_start: usize, _len: usize) {}

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
