//! Reading one expert from its shard: owned 4 KiB-aligned buffers, `pread` with `O_DIRECT`
//! where the filesystem takes it, buffered reads (the pages dropped after) where it does not.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment of buffers, file offsets and lengths for `O_DIRECT` (the page size; a multiple
/// of every block size Linux filesystems use here).
pub const IO_ALIGN: usize = 4096;

/// Buffers this large or larger are mapped directly, 2 MiB-aligned and advised for
/// transparent huge pages: a fresh 17.5 MB expert then faults in 9 huge pages instead of 4480
/// small ones while the read lands (PERFORMANCE.md, expert-store phase).
const HUGE: usize = 2 << 20;

/// An owned, zero-initialised, `IO_ALIGN`-aligned byte buffer. Immutable once filled, so it is
/// shared between threads behind an `Arc`.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// For a mapped buffer: the mapping's start and length (what `munmap` takes).
    mapping: Option<(NonNull<u8>, usize)>,
}

// SAFETY: the buffer is plain bytes owned by this value; shared access is read-only and the
// single writer (the loading thread) holds `&mut` until it hands the buffer out.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: `&AlignedBuf` only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (at least one page is allocated so the pointer is always real).
    pub fn zeroed(len: usize) -> Self {
        if len >= HUGE
            && let Some(buf) = Self::mapped(len)
        {
            return buf;
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least IO_ALIGN) and a power-of-two align.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            mapping: None,
        }
    }

    /// An anonymous mapping with a 2 MiB-aligned start inside it, advised for huge pages;
    /// `None` if the kernel refuses the mapping (the caller falls back to the allocator).
    fn mapped(len: usize) -> Option<Self> {
        let size = len.next_multiple_of(HUGE) + HUGE;
        // SAFETY: a fresh private anonymous mapping; we own it until munmap in Drop.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = NonNull::new(raw.cast::<u8>())?;
        let skip = (base.as_ptr() as usize).next_multiple_of(HUGE) - base.as_ptr() as usize;
        // SAFETY: skip < HUGE, and size >= len + HUGE, so [skip, skip + len) is inside.
        let ptr = unsafe { base.add(skip) };
        // SAFETY: advice on our own mapping; a refusal only means small pages.
        unsafe {
            libc::madvise(
                ptr.as_ptr().cast(),
                len.next_multiple_of(HUGE),
                libc::MADV_HUGEPAGE,
            )
        };
        Some(Self {
            ptr,
            len,
            mapping: Some((base, size)),
        })
    }

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1).next_multiple_of(IO_ALIGN), IO_ALIGN)
            .expect("a buffer size below isize::MAX")
    }

    /// Locks the buffer's pages in RAM (`mlock`); the error is the OS's.
    pub fn lock(&self) -> std::io::Result<()> {
        // SAFETY: the range lies inside this allocation, which outlives the call.
        let rc = unsafe {
            libc::mlock(
                self.ptr.as_ptr().cast(),
                self.len.next_multiple_of(IO_ALIGN),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised (zeroed, then read into) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.mapping {
            // SAFETY: the mapping made in `mapped`, unmapped once.
            Some((base, size)) => unsafe {
                libc::munmap(base.as_ptr().cast(), size);
            },
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            None => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) },
        }
    }
}

/// One shard opened for expert reads.
#[derive(Debug)]
pub struct ShardReader {
    /// The shard.
    pub path: PathBuf,
    file: File,
    /// Opened with `O_DIRECT`, and no read has refused it yet.
    direct: AtomicBool,
    /// A buffered handle for the fallback (also the only one when `O_DIRECT` was refused).
    buffered: File,
}

impl ShardReader {
    /// Opens `path`, with `O_DIRECT` when `direct` is asked for and the filesystem takes it.
    pub fn open(path: &Path, direct: bool) -> std::io::Result<Self> {
        let buffered = File::open(path)?;
        let direct_file = if direct {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        Ok(Self {
            path: path.to_owned(),
            direct: AtomicBool::new(direct_file.is_some()),
            file: direct_file.unwrap_or(buffered.try_clone()?),
            buffered,
        })
    }

    /// Whether reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// Reads one range of this file from `offset` into `dst` (whole `IO_ALIGN` blocks), with
    /// `O_DIRECT` while the file takes it; returns the bytes read.
    fn read_span(&self, dst: &mut [u8], start: usize) -> std::io::Result<usize> {
        let got = if self.is_direct() {
            match read_full(&self.file, dst, start) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // The filesystem opened the file with O_DIRECT but refuses the read:
                    // buffered from now on (the caller says so once).
                    self.direct.store(false, Ordering::Relaxed);
                    read_full(&self.buffered, dst, start)?
                }
                result => result?,
            }
        } else {
            read_full(&self.buffered, dst, start)?
        };
        if !self.is_direct() {
            // The expert now lives in our buffer: drop the page-cache copy of what we read
            // (advice only: a refusal changes nothing we rely on).
            let _ = drop_page_cache(&self.buffered, start as u64, dst.len() as u64);
        }
        Ok(got)
    }
}

/// A failed [`read_pieces`]: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct PieceError {
    /// The file of the piece that failed.
    pub path: PathBuf,
    /// What the system said.
    pub source: std::io::Error,
}

/// Reads `pieces` (each a file and a byte range of it; an expert's tensors may lie in several
/// shards) into one new buffer, each piece starting at an `IO_ALIGN` boundary of it, in the
/// order given (the caller passes file order); returns the buffer and where each piece's first
/// byte landed. One `pread` per piece (more only if the kernel returns less than asked).
///
/// `place(buffer, starts)` runs on the new buffer before any read touches it, with where
/// each piece's first byte will land: the caller binds pages to NUMA nodes there, so the
/// read's page faults allocate them on the right node.
///
/// `reuse` is a buffer of an expert no longer needed: taken when large enough, so the read
/// lands in pages already faulted in (a fresh buffer costs a page fault and a zeroed page per
/// 4 KiB during the read).
pub fn read_pieces(
    pieces: &[(&ShardReader, Range<usize>)],
    reuse: Option<AlignedBuf>,
    place: impl FnOnce(&mut [u8], &[usize]),
) -> Result<(AlignedBuf, Vec<usize>), PieceError> {
    let spans: Vec<(usize, usize)> = pieces.iter().map(|(_, r)| aligned_span(r)).collect();
    let total: usize = spans.iter().map(|&(_, len)| len).sum();
    let mut buf = match reuse {
        Some(buf) if buf.len() >= total => buf,
        _ => AlignedBuf::zeroed(total),
    };
    let mut starts = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for ((_, piece), &(start, len)) in pieces.iter().zip(&spans) {
        starts.push(at + (piece.start - start));
        at += len;
    }
    place(&mut buf, &starts);
    let mut at = 0;
    for ((reader, piece), &(start, len)) in pieces.iter().zip(&spans) {
        let fail = |source| PieceError {
            path: reader.path.clone(),
            source,
        };
        let needed = piece.end - start;
        let got = reader
            .read_span(&mut buf[at..at + len], start)
            .map_err(fail)?;
        if got < needed {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "short read: {got} of {needed} bytes at offset {start} (the file ends early)"
                ),
            )));
        }
        at += len;
    }
    Ok((buf, starts))
}

/// The `IO_ALIGN`-aligned span `(start, len)` that covers `range`.
pub fn aligned_span(range: &Range<usize>) -> (usize, usize) {
    let start = range.start / IO_ALIGN * IO_ALIGN;
    (start, range.end.next_multiple_of(IO_ALIGN) - start)
}

/// Advises the kernel to drop `len` bytes of `file` from `offset` out of the page cache
/// (`POSIX_FADV_DONTNEED`; `len` 0 means to the end of the file).
pub fn drop_page_cache(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: plain syscall on an open descriptor; it only advises.
    let rc = unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(file),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    match rc {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

/// Reads into `dst` from `offset` until it is full or the file ends; returns the bytes read.
pub fn read_full(file: &File, dst: &mut [u8], offset: usize) -> std::io::Result<usize> {
    let mut done = 0;
    while done < dst.len() {
        match file.read_at(&mut dst[done..], (offset + done) as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The memory the kernel says is available now (`MemAvailable` in `/proc/meminfo`), for the
/// caller that wants a cache capacity checked against it; `None` where it cannot be read.
/// Containers: see [`memory_budget`], which also honours the process's cgroup limit.
pub fn memory_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// How much memory this process may still allocate, and what says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes the process may still allocate.
    pub bytes: u64,
    /// Where the number came from (`MemAvailable in /proc/meminfo`, or the cgroup's files
    /// with its limit and usage), for messages.
    pub source: String,
    /// Whether the number is a limit the process runs under (a cgroup's, or one its user
    /// gave) rather than the host's free memory: under a limit, memory left unused is not
    /// anyone else's, so a plan may fill it (`k3-model`'s `Plan::resident_everything`).
    pub limit: bool,
}

/// The source of a [`memory_budget`] that no cgroup limits (the host's free memory).
pub(crate) const MEM_AVAILABLE: &str = "MemAvailable in /proc/meminfo";

/// The memory this process may still allocate: the smallest of `MemAvailable` and, for its
/// memory cgroup (v1 or v2) and every parent, the limit minus the usage. `None` where neither
/// can be read.
pub fn memory_budget() -> Option<MemoryBudget> {
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    let available = read(Path::new("/proc/meminfo"))
        .and_then(|t| parse_mem_available(&t))
        .map(|bytes| MemoryBudget {
            bytes,
            source: MEM_AVAILABLE.into(),
            limit: false,
        });
    let cgroup = match (
        read(Path::new("/proc/self/cgroup")),
        read(Path::new("/proc/self/mountinfo")),
    ) {
        (Some(cgroups), mountinfo) => {
            cgroup_headroom(&cgroups, mountinfo.as_deref().unwrap_or(""), read)
        }
        (None, _) => None,
    };
    [available, cgroup]
        .into_iter()
        .flatten()
        .min_by_key(|b| b.bytes)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Limits at or above this are "no limit" (cgroup v1 writes `PAGE_COUNTER_MAX` pages,
/// 9223372036854771712 bytes, for an unlimited group).
const UNLIMITED: u64 = 1 << 62;

/// The least headroom (limit minus usage) of the memory cgroups this process is in and their
/// parents, from the text of `/proc/self/cgroup` and `/proc/self/mountinfo`; `read` returns a
/// cgroup file's contents (`None`: absent). cgroup v2: `0::/path`, `memory.max` (`max`: no
/// limit) minus `memory.current`; v1: the line whose controllers include `memory`,
/// `memory.limit_in_bytes` minus `memory.usage_in_bytes`. Each hierarchy's files are found
/// under its mount point in `mountinfo` (default `/sys/fs/cgroup` for v2,
/// `/sys/fs/cgroup/memory` for v1). A child may be unlimited while a parent is limited, so
/// every level up to the mount's root is read. `None`: no limit anywhere.
pub fn cgroup_headroom(
    cgroups: &str,
    mountinfo: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<MemoryBudget> {
    let mut best: Option<MemoryBudget> = None;
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (version, files) = if id == "0" && controllers.is_empty() {
            (2, ["memory.max", "memory.current"])
        } else if controllers.split(',').any(|c| c == "memory") {
            (1, ["memory.limit_in_bytes", "memory.usage_in_bytes"])
        } else {
            continue;
        };
        let (mount, root) = cgroup_mount(mountinfo, version).unwrap_or_else(|| {
            let default = if version == 2 {
                "/sys/fs/cgroup"
            } else {
                "/sys/fs/cgroup/memory"
            };
            (PathBuf::from(default), "/".to_owned())
        });
        // The path is relative to the hierarchy's root; the mount may show a subtree of it.
        let relative = path
            .strip_prefix(root.trim_end_matches('/'))
            .unwrap_or(path)
            .trim_start_matches('/');
        let mut dir = mount.join(relative);
        loop {
            let number = |file: &str| -> Option<u64> {
                let text = read(&dir.join(file))?;
                match text.trim() {
                    "max" => Some(u64::MAX),
                    n => n.parse().ok(),
                }
            };
            if let (Some(limit), Some(usage)) = (number(files[0]), number(files[1]))
                && limit < UNLIMITED
            {
                let headroom = limit.saturating_sub(usage);
                if best.as_ref().is_none_or(|b| headroom < b.bytes) {
                    best = Some(MemoryBudget {
                        bytes: headroom,
                        source: format!(
                            "cgroup v{version} {}: {} {limit} bytes, {} {usage} bytes",
                            dir.display(),
                            files[0],
                            files[1]
                        ),
                        limit: true,
                    });
                }
            }
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    best
}

/// The mount point and mounted root of the cgroup hierarchy of `version` (1: the one with the
/// `memory` controller), from `/proc/self/mountinfo`.
fn cgroup_mount(mountinfo: &str, version: u8) -> Option<(PathBuf, String)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (root, mount) = (*left.get(3)?, *left.get(4)?);
        let fstype = *right.first()?;
        let options = right.get(2).copied().unwrap_or("");
        let fits = match version {
            2 => fstype == "cgroup2",
            _ => fstype == "cgroup" && options.split(',').any(|o| o == "memory"),
        };
        fits.then(|| (PathBuf::from(mount), root.to_owned()))
    })
}

/// `RLIMIT_MEMLOCK` (soft limit, bytes), to name it when `mlock` fails.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (rc == 0).then_some(limit.rlim_cur)
}
