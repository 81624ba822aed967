//! The cgroup helpers: hierarchies, counters and a memory group run for real where possible.

use super::*;

/// This machine's layout: cgroup v1 with memory, v2 mounted beside it without memory.
const HYBRID_MOUNTS: &str = "\
34 25 0:29 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 34 0:30 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
38 34 0:33 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
44 34 0:39 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
const HYBRID_CGROUPS: &str = "\
4:memory:/process_api/6768
1:cpu:/
0::/
";

fn files(entries: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
    let entries: Vec<(PathBuf, String)> = entries
        .iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
    move |p: &Path| entries.iter().find(|(q, _)| q == p).map(|(_, t)| t.clone())
}

#[test]
fn a_hybrid_machine_uses_v1_when_v2_has_no_memory_controller() {
    let read = files(&[("/sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n")]);
    let h = find_hierarchy(HYBRID_CGROUPS, HYBRID_MOUNTS, read).unwrap();
    assert_eq!(h.version, Version::V1);
    assert_eq!(
        h.parent,
        PathBuf::from("/sys/fs/cgroup/memory/process_api/6768")
    );
}

#[test]
fn unified_v2_with_memory_is_used_below_the_process_own_group() {
    let mounts = "30 24 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
    let cgroups = "0::/user.slice/bench.scope\n";
    let read = files(&[("/sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n")]);
    let h = find_hierarchy(cgroups, mounts, read).unwrap();
    assert_eq!(h.version, Version::V2);
    assert_eq!(
        h.parent,
        PathBuf::from("/sys/fs/cgroup/user.slice/bench.scope")
    );
}

#[test]
fn a_mount_of_a_subtree_is_joined_relative_to_its_root() {
    // A container sees its own group mounted at the hierarchy's mount point.
    let mounts = "30 24 0:26 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
    let cgroups = "5:memory:/docker/abc/inner\n";
    let h = find_hierarchy(cgroups, mounts, files(&[])).unwrap();
    assert_eq!(h.parent, PathBuf::from("/sys/fs/cgroup/memory/inner"));
}

#[test]
fn no_memory_controller_is_an_error_naming_what_was_looked_for() {
    let read = files(&[("/sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n")]);
    let mounts = "44 34 0:39 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
    let e = find_hierarchy("0::/\n", mounts, read).unwrap_err();
    assert!(e.to_string().contains("no memory cgroup controller"), "{e}");
}

#[test]
fn oom_kill_counters_of_both_versions() {
    let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
    let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
    assert_eq!(counter(v1, "oom_kill"), Some(3));
    assert_eq!(counter(v2, "oom_kill"), Some(1));
    assert_eq!(counter(v2, "oom"), Some(2));
    assert_eq!(counter("oom_kill_disable 0\n", "oom_kill"), None);
    let io = "rchar: 900\nwchar: 0\nread_bytes: 4096\nwrite_bytes: 0\n";
    assert_eq!(counter(io, "read_bytes:"), Some(4096));
}

#[test]
fn group_names_are_unique_and_one_path_component() {
    let a = group_name("ours 2/x");
    let b = group_name("ours 2/x");
    assert_ne!(a, b);
    assert!(a.starts_with("k3-ours-2-x-"), "{a}");
    assert!(!a.contains('/') && !a.contains(' '), "{a}");
}

#[test]
fn the_pid_written_to_cgroup_procs_is_the_child_own() {
    // join_group writes decimal digits with no newline: check it on a pipe.
    let mut fds = [0; 2];
    // SAFETY: fds is a live array of two descriptors for pipe to fill.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    join_group(fds[1]).unwrap();
    let mut buf = [0u8; 16];
    // SAFETY: buf is live; fds[0] is the pipe's read end.
    let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: both descriptors are ours and not used again.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    let text = std::str::from_utf8(&buf[..n as usize]).unwrap();
    assert_eq!(text, std::process::id().to_string());
}

/// The hierarchy, or why the real-cgroup tests skip.
fn real_hierarchy() -> Option<Hierarchy> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: creating memory cgroups needs root");
        return None;
    }
    match Hierarchy::detect() {
        Ok(h) => Some(h),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

const MB: u64 = 1 << 20;

#[test]
#[ignore = "makes memory cgroups: root only (cargo test -p xtask cgroup -- --ignored)"]
fn a_command_runs_inside_its_group_and_the_group_goes_away() {
    let Some(h) = real_hierarchy() else { return };
    let group = MemoryGroup::create(&h, &group_name("test"), 64 * MB).unwrap();
    let dir = group.dir().to_owned();
    assert_eq!(group.limit().unwrap(), 64 * MB);
    let out = group
        .run(
            Command::new("dd").args(["if=/dev/zero", "of=/dev/null", "bs=16M", "count=1"]),
            None,
        )
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!out.oom_killed());
    // dd's 16 MiB buffer was charged here, and stayed under the limit.
    assert!(
        out.peak >= 16 * MB && out.peak <= 64 * MB,
        "peak {}",
        out.peak
    );
    let inside = group
        .run(Command::new("cat").arg("/proc/self/cgroup"), None)
        .unwrap();
    let name = dir.file_name().unwrap().to_str().unwrap();
    assert!(inside.stdout.contains(name), "{}", inside.stdout);
    drop(group);
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
#[ignore = "makes memory cgroups: root only (cargo test -p xtask cgroup -- --ignored)"]
fn an_allocation_over_the_limit_is_oom_killed() {
    let Some(h) = real_hierarchy() else { return };
    let group = MemoryGroup::create(&h, &group_name("test"), 64 * MB).unwrap();
    let out = group
        .run(
            Command::new("dd").args(["if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"]),
            None,
        )
        .unwrap();
    assert!(out.oom_killed(), "{out:?}");
    assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{out:?}");
}

#[test]
#[ignore = "makes memory cgroups: root only (cargo test -p xtask cgroup -- --ignored)"]
fn bytes_read_from_disk_are_counted_and_cache_hits_are_not() {
    let Some(h) = real_hierarchy() else { return };
    // Beside the test binary: on disk (a tmpfs /tmp would read nothing from storage).
    let exe = std::env::current_exe().unwrap();
    let path = exe.with_file_name(format!("{}.readtest", group_name("file")));
    fs::write(&path, vec![7u8; 32 * MB as usize]).unwrap();
    fs::File::open(&path).unwrap().sync_all().unwrap();
    // `sh -c SCRIPT` with the file as $0; the mark is the line "mark".
    let read_it = |script: &str| {
        let group = MemoryGroup::create(&h, &group_name("test"), 256 * MB).unwrap();
        let mut sh = Command::new("sh");
        sh.args(["-c", script]).arg(&path);
        let mark = Mark {
            stderr: false,
            text: "mark",
        };
        group.run(&mut sh, Some(mark)).unwrap()
    };
    let cold = || {
        expert_store::io::drop_page_cache(&fs::File::open(&path).unwrap(), 0, 0).unwrap();
    };
    let dd = "dd if=\"$0\" of=/dev/null bs=1M 2>/dev/null";
    cold();
    let before_mark = read_it(&format!("{dd}; echo mark; sleep 0.2"));
    let warm = read_it(&format!("{dd}; echo mark"));
    cold();
    let after_mark = read_it(&format!("echo mark; sleep 0.2; {dd}"));
    fs::remove_file(&path).unwrap();
    assert!(before_mark.status.success(), "{before_mark:?}");
    // Readahead may read a little past what dd asked for, never less than the file; the
    // shell and dd themselves are in the page cache after the first run.
    let (total, at) = (
        before_mark.read_bytes,
        before_mark.read_bytes_at_mark.unwrap(),
    );
    assert!(total >= 32 * MB, "cold read {total} bytes");
    assert!(
        at >= 32 * MB && total - at < MB,
        "{at} of {total} bytes before the mark"
    );
    assert!(warm.read_bytes < MB, "warm read {} bytes", warm.read_bytes);
    let (total, at) = (
        after_mark.read_bytes,
        after_mark.read_bytes_at_mark.unwrap(),
    );
    assert!(
        at < MB && total - at >= 32 * MB,
        "{at} of {total} bytes before the mark"
    );
}
