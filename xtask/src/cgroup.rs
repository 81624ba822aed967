//! Memory cgroups for the benches: a fresh child group with a memory limit (cgroup v2's
//! `memory.max` or v1's `memory.limit_in_bytes`, whichever hierarchy has the memory
//! controller), a command run inside it from its first instruction, and what the group saw:
//! its peak memory, whether the OOM killer fired, and the bytes the command read from disk.
//! The group is removed when its [`MemoryGroup`] is dropped, on error too.

use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Which cgroup interface holds the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    V1,
    V2,
}

impl Version {
    /// The hard limit.
    fn limit_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.limit_in_bytes",
            Version::V2 => "memory.max",
        }
    }

    /// Memory plus swap (v1) or swap alone (v2): set so that the budget cannot spill to swap.
    fn swap_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.memsw.limit_in_bytes",
            Version::V2 => "memory.swap.max",
        }
    }

    /// The most memory the group has used since it was made.
    fn peak_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        }
    }

    /// The file with the `oom_kill N` counter.
    fn events_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.oom_control",
            Version::V2 => "memory.events",
        }
    }
}

/// Where memory groups are made: the memory hierarchy and this process's own group in it
/// (children of it, so any limit above this process still applies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hierarchy {
    pub(crate) version: Version,
    pub(crate) parent: PathBuf,
}

impl Hierarchy {
    /// This machine's memory hierarchy, from `/proc/self/cgroup` and `/proc/self/mountinfo`.
    pub(crate) fn detect() -> Result<Self> {
        let read = |p: &Path| fs::read_to_string(p).ok();
        let cgroups = read(Path::new("/proc/self/cgroup")).context("reading /proc/self/cgroup")?;
        let mounts =
            read(Path::new("/proc/self/mountinfo")).context("reading /proc/self/mountinfo")?;
        find_hierarchy(&cgroups, &mounts, read)
    }
}

/// The memory hierarchy from the text of `/proc/self/cgroup` and `/proc/self/mountinfo`;
/// `read` returns a file's contents. cgroup v2 counts only where its root's
/// `cgroup.controllers` lists `memory` (a hybrid machine mounts v2 beside v1 with the memory
/// controller on v1); otherwise the v1 hierarchy mounted with the `memory` option.
pub(crate) fn find_hierarchy(
    cgroups: &str,
    mountinfo: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Result<Hierarchy> {
    // (mount point, mounted root) of the first mount that fits.
    let mount = |fits: &dyn Fn(&str, &str) -> bool| {
        mountinfo.lines().find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let options = right.get(2).copied().unwrap_or("");
            let (root, point) = (*left.get(3)?, *left.get(4)?);
            fits(right.first()?, options).then(|| (PathBuf::from(point), root))
        })
    };
    // The line of `/proc/self/cgroup` that fits, as this process's path in that hierarchy.
    let own = |fits: &dyn Fn(&str, &str) -> bool| {
        cgroups.lines().find_map(|line| {
            let mut f = line.splitn(3, ':');
            let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            fits(id, controllers).then_some(path)
        })
    };
    let join = |(mount, root): (PathBuf, &str), path: &str| {
        let relative = path
            .strip_prefix(root.trim_end_matches('/'))
            .unwrap_or(path);
        mount.join(relative.trim_start_matches('/'))
    };
    if let Some(v2) = mount(&|fstype, _| fstype == "cgroup2")
        && read(&v2.0.join("cgroup.controllers"))
            .is_some_and(|c| c.split_whitespace().any(|c| c == "memory"))
        && let Some(path) = own(&|id, controllers| id == "0" && controllers.is_empty())
    {
        return Ok(Hierarchy {
            version: Version::V2,
            parent: join(v2, path),
        });
    }
    let has_memory = |list: &str| list.split(',').any(|c| c == "memory");
    match (
        mount(&|fstype, options| fstype == "cgroup" && has_memory(options)),
        own(&|_, controllers| has_memory(controllers)),
    ) {
        (Some(v1), Some(path)) => Ok(Hierarchy {
            version: Version::V1,
            parent: join(v1, path),
        }),
        _ => bail!(
            "no memory cgroup controller: no cgroup2 mount whose cgroup.controllers lists \
             memory, and no cgroup v1 mount with the memory option in /proc/self/mountinfo"
        ),
    }
}

/// A name no other group has: `k3-{tag}-{pid}-{nanoseconds}-{sequence}`.
pub(crate) fn group_name(tag: &str) -> String {
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tag: String = tag
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!(
        "k3-{tag}-{}-{nanos:x}-{}",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    )
}

/// The `key N` counter of a flat-keyed cgroup file (`memory.events`, v1's `memory.oom_control`).
pub(crate) fn counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// What one command did inside its group.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) status: ExitStatus,
    pub(crate) wall: Duration,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    /// The group's peak memory (the command's pages and the page cache it brought in).
    pub(crate) peak: u64,
    /// Times the OOM killer fired in the group.
    pub(crate) oom_kills: u64,
    /// Bytes the command (and any child it waited for) made the kernel read from storage:
    /// `read_bytes` of `/proc/PID/io`, as `wait4`'s `ru_inblock` (512-byte units) gives it
    /// at exit. Page-cache hits are not counted.
    pub(crate) read_bytes: u64,
    /// `read_bytes` when the [`Mark`]'s line first appeared (`None`: no mark, or it never
    /// did): what was read before it (loading, warm-up) and, subtracted, after it.
    pub(crate) read_bytes_at_mark: Option<u64>,
}

/// A line to watch for in the command's output (the first line containing `text`, on stderr
/// or stdout): when it appears, the command's `read_bytes` so far is noted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark<'a> {
    pub(crate) stderr: bool,
    pub(crate) text: &'a str,
}

/// `read_bytes` of `/proc/PID/io` (bytes this process has made the kernel read from storage).
fn proc_read_bytes(pid: u32) -> Option<u64> {
    counter(
        &fs::read_to_string(format!("/proc/{pid}/io")).ok()?,
        "read_bytes:",
    )
}

impl Outcome {
    pub(crate) fn oom_killed(&self) -> bool {
        self.oom_kills > 0
    }
}

/// A child memory cgroup with a limit, removed (after its processes are gone) on drop.
#[derive(Debug)]
pub(crate) struct MemoryGroup {
    dir: PathBuf,
    version: Version,
}

impl MemoryGroup {
    /// Makes the group `name` under `hierarchy` with a hard limit of `limit` bytes and no swap.
    pub(crate) fn create(hierarchy: &Hierarchy, name: &str, limit: u64) -> Result<Self> {
        let version = hierarchy.version;
        if version == Version::V2 {
            // A v2 child has the memory files only if its parent hands the controller down.
            let control = hierarchy.parent.join("cgroup.subtree_control");
            let on = fs::read_to_string(&control)
                .is_ok_and(|t| t.split_whitespace().any(|c| c == "memory"));
            if !on {
                fs::write(&control, "+memory").with_context(|| {
                    format!(
                        "enabling the memory controller in {} (a v2 group holding processes \
                         cannot; run from a delegated group with none)",
                        control.display()
                    )
                })?;
            }
        }
        let dir = hierarchy.parent.join(name);
        fs::create_dir(&dir)
            .with_context(|| format!("creating memory cgroup {}", dir.display()))?;
        let group = MemoryGroup { dir, version };
        group.write(version.limit_file(), &limit.to_string())?;
        if group.dir.join(version.swap_file()).exists() {
            // v1's memory+swap limit may not be below the memory limit: the same value means
            // no swap; v2 limits swap alone.
            let swap = match version {
                Version::V1 => limit.to_string(),
                Version::V2 => "0".to_string(),
            };
            group.write(version.swap_file(), &swap)?;
        }
        Ok(group)
    }

    #[cfg(test)]
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.dir.join(file);
        fs::write(&path, value).with_context(|| format!("writing {value} to {}", path.display()))
    }

    fn read(&self, file: &str) -> Result<String> {
        let path = self.dir.join(file);
        fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    /// The limit the kernel applied (it rounds down to whole pages).
    #[cfg(test)]
    pub(crate) fn limit(&self) -> Result<u64> {
        let text = self.read(self.version.limit_file())?;
        text.trim()
            .parse()
            .with_context(|| format!("limit {:?} is not a byte count", text.trim()))
    }

    pub(crate) fn peak(&self) -> Result<u64> {
        let text = self.read(self.version.peak_file())?;
        text.trim()
            .parse()
            .with_context(|| format!("peak {:?} is not a byte count", text.trim()))
    }

    pub(crate) fn oom_kills(&self) -> Result<u64> {
        let file = self.version.events_file();
        counter(&self.read(file)?, "oom_kill")
            .with_context(|| format!("{file} in {} has no oom_kill counter", self.dir.display()))
    }

    /// Runs `command` inside the group (it joins in `pre_exec`, so everything it allocates
    /// is charged here) with stdin closed and stdout and stderr captured, watching for `mark`.
    pub(crate) fn run(&self, command: &mut Command, mark: Option<Mark<'_>>) -> Result<Outcome> {
        let procs_path = self.dir.join("cgroup.procs");
        // Opened here (std sets O_CLOEXEC): the child only writes to it.
        let procs = OpenOptions::new()
            .write(true)
            .open(&procs_path)
            .with_context(|| format!("opening {}", procs_path.display()))?;
        let fd = procs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only calls getpid and
        // write on a stack buffer (async-signal-safe: no allocation, no locks).
        unsafe { command.pre_exec(move || join_group(fd)) };
        let start = Instant::now();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {command:?} in {}", self.dir.display()))?;
        drop(procs);
        let pid = child.id();
        // Each pipe read line by line; the watched one notes read_bytes at the mark's line.
        let drain = |pipe: Option<Box<dyn Read + Send>>, watch: Option<String>| {
            std::thread::spawn(move || {
                let (mut text, mut at_mark) = (Vec::new(), None);
                if let Some(pipe) = pipe {
                    let mut pipe = BufReader::new(pipe);
                    let mut line = Vec::new();
                    while pipe.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                        if let Some(watch) = &watch
                            && at_mark.is_none()
                            && String::from_utf8_lossy(&line).contains(watch.as_str())
                        {
                            at_mark = proc_read_bytes(pid);
                        }
                        text.append(&mut line);
                    }
                }
                (String::from_utf8_lossy(&text).into_owned(), at_mark)
            })
        };
        let watch = |on_stderr: bool| {
            mark.filter(|m| m.stderr == on_stderr)
                .map(|m| m.text.to_owned())
        };
        let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _), watch(false));
        let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _), watch(true));
        let (status, usage) = wait4(child.id())?;
        let wall = start.elapsed();
        let (stdout, out_mark) = stdout.join().unwrap_or_default();
        let (stderr, err_mark) = stderr.join().unwrap_or_default();
        Ok(Outcome {
            status,
            wall,
            stdout,
            stderr,
            read_bytes_at_mark: out_mark.or(err_mark),
            peak: self.peak()?,
            oom_kills: self.oom_kills()?,
            read_bytes: u64::try_from(usage.ru_inblock).unwrap_or(0) * 512,
        })
    }
}

/// Writes the calling process's pid to the open `cgroup.procs` descriptor `fd` (in the forked
/// child, so no allocation).
fn join_group(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: getpid has no preconditions.
    let mut pid = unsafe { libc::getpid() } as u32;
    let mut digits = [0u8; 10];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    let text = &digits[at..];
    // SAFETY: `text` is a live stack buffer of `text.len()` bytes; fd is open for writing.
    let rc = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Reaps child `pid` with its resource usage (which `Child::wait` does not give).
fn wait4(pid: u32) -> Result<(ExitStatus, libc::rusage)> {
    let mut status = 0;
    // SAFETY: rusage is plain data; all-zero is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: pid is our unreaped child; status and usage are live locals it writes.
        let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
        if rc >= 0 {
            return Ok((ExitStatus::from_raw(status), usage));
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error).with_context(|| format!("waiting for process {pid}"));
        }
    }
}

impl Drop for MemoryGroup {
    fn drop(&mut self) {
        // Whatever the command left behind dies first: a group with processes cannot go.
        for _ in 0..100 {
            let procs = fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<i32> = procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                // SAFETY: plain syscall; the pid is in the group this harness made and filled.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut last = None;
        for _ in 0..100 {
            match fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                // The kernel may still be tearing down the last exited task: retry.
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(e) = last {
            eprintln!(
                "warning: memory cgroup {} not removed: {e}",
                self.dir.display()
            );
        }
    }
}

#[cfg(test)]
mod tests;
