//! Warming a mapped checkpoint: the selected tensors' pages are resident afterwards, counted
//! once each (adjacent tensors merged, ranges rounded out to pages), and nothing else is asked.

use expert_store::Checkpoint;
use k3_testkit::Scratch;

use crate::checkpoint::write_checkpoint;

/// Pages of `bytes` that are resident (`mincore`), and how many pages it spans.
fn resident_pages(bytes: &[u8]) -> (usize, usize) {
    let page = 4096;
    let start = bytes.as_ptr() as usize / page * page;
    let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
    let pages = (end - start) / page;
    let mut vec = vec![0u8; pages];
    // SAFETY: [start, end) covers `bytes`, a live mapping of the checkpoint; mincore only
    // writes one byte per page into `vec`, which holds `pages` bytes.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    (vec.iter().filter(|&&v| v & 1 == 1).count(), pages)
}

#[test]
fn warming_maps_the_selected_tensors_and_counts_their_pages_once() {
    let dir = Scratch::new("store-warm");
    write_checkpoint(dir.path(), "");
    // Off the page cache where the kernel lets us, so the warm has something to read.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let file = std::fs::File::open(entry.unwrap().path()).unwrap();
        file.sync_all().unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; no memory is involved.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let chosen = |name: &str| name.contains("experts.3.");
    let names: Vec<String> = ckpt
        .tensor_names()
        .filter(|n| chosen(n))
        .map(str::to_owned)
        .collect();
    assert_eq!(names.len(), 6, "{names:?}");
    let warmed = ckpt.warm(chosen);
    assert!(
        warmed.populated,
        "MADV_POPULATE_READ refused on Linux {warmed:?}"
    );
    // Expert 3's six tensors are adjacent in the file: one range, rounded out to pages.
    let (lo, hi) = names.iter().fold((usize::MAX, 0), |(lo, hi), n| {
        let t = ckpt.tensor(n).unwrap();
        (lo.min(t.offset), hi.max(t.offset + t.bytes.len()))
    });
    let span = (hi.next_multiple_of(4096) - lo / 4096 * 4096) as u64;
    assert_eq!(warmed.bytes, span);
    for n in &names {
        let (resident, pages) = resident_pages(ckpt.tensor(n).unwrap().bytes);
        assert_eq!(resident, pages, "{n}");
    }
    assert_eq!(ckpt.warm(|_| false).bytes, 0);
}
