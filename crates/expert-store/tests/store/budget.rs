//! The memory budget: `MemAvailable`, and the headroom of the process's memory cgroup (v1 and
//! v2, parents included) parsed from sample file contents.

use std::collections::HashMap;
use std::path::Path;

use expert_store::io::{cgroup_headroom, parse_mem_available};

/// A fake cgroup filesystem: path -> contents.
fn files(entries: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
    let map: HashMap<String, String> = entries
        .iter()
        .map(|(p, c)| ((*p).to_owned(), format!("{c}\n")))
        .collect();
    move |path: &Path| map.get(path.to_str()?).cloned()
}

const V1_MOUNTS: &str = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                         41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
const V1_CGROUPS: &str = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n";

#[test]
fn mem_available_is_read_in_bytes() {
    let meminfo = "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   24206168 kB\n";
    assert_eq!(parse_mem_available(meminfo), Some(24_206_168 * 1024));
    assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
}

#[test]
fn cgroup_v1_limit_minus_usage() {
    let read = files(&[
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
            "3500000000",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes",
            "500000000",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
            "9223372036854771712",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/memory.usage_in_bytes",
            "1",
        ),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712",
        ),
        ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1"),
    ]);
    let budget = cgroup_headroom(V1_CGROUPS, V1_MOUNTS, read).unwrap();
    assert_eq!(budget.bytes, 3_000_000_000);
    assert!(budget.limit, "a cgroup's headroom is a limit");
    assert!(
        budget
            .source
            .contains("cgroup v1 /sys/fs/cgroup/memory/process_api/abc")
            && budget.source.contains("3500000000"),
        "{}",
        budget.source
    );
}

#[test]
fn an_unlimited_child_of_a_limited_parent_gets_the_parents_headroom() {
    let read = files(&[
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
            "9223372036854771712",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes",
            "100",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
            "2000",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/memory.usage_in_bytes",
            "1500",
        ),
    ]);
    let budget = cgroup_headroom(V1_CGROUPS, V1_MOUNTS, read).unwrap();
    assert_eq!(budget.bytes, 500);
    assert!(budget.limit, "a cgroup's headroom is a limit");
    assert!(
        budget.source.ends_with("usage_in_bytes 1500 bytes"),
        "{}",
        budget.source
    );
}

#[test]
fn unlimited_everywhere_is_no_budget() {
    let read = files(&[
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
            "9223372036854771712",
        ),
        (
            "/sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes",
            "100",
        ),
        ("/sys/fs/cgroup/memory.max", "max"),
        ("/sys/fs/cgroup/memory.current", "100"),
    ]);
    assert_eq!(cgroup_headroom(V1_CGROUPS, V1_MOUNTS, &read), None);
    assert_eq!(cgroup_headroom("0::/\n", "", &read), None);
    assert_eq!(cgroup_headroom("garbage\n\n1:cpu:/x\n", "", &read), None);
}

#[test]
fn cgroup_v2_max_minus_current_walking_up() {
    let mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
    let cgroups = "0::/system.slice/k3.service\n";
    let read = files(&[
        ("/sys/fs/cgroup/system.slice/k3.service/memory.max", "max"),
        (
            "/sys/fs/cgroup/system.slice/k3.service/memory.current",
            "1000",
        ),
        ("/sys/fs/cgroup/system.slice/memory.max", "8000000000"),
        ("/sys/fs/cgroup/system.slice/memory.current", "6000000000"),
    ]);
    let budget = cgroup_headroom(cgroups, mounts, &read).unwrap();
    assert_eq!(budget.bytes, 2_000_000_000);
    assert!(
        budget
            .source
            .contains("cgroup v2 /sys/fs/cgroup/system.slice:"),
        "{}",
        budget.source
    );
    // The tighter of two levels wins; usage above the limit is no headroom, not a wrap.
    let read = files(&[
        ("/sys/fs/cgroup/system.slice/k3.service/memory.max", "3000"),
        (
            "/sys/fs/cgroup/system.slice/k3.service/memory.current",
            "4000",
        ),
        ("/sys/fs/cgroup/system.slice/memory.max", "8000000000"),
        ("/sys/fs/cgroup/system.slice/memory.current", "6000000000"),
    ]);
    assert_eq!(cgroup_headroom(cgroups, mounts, &read).unwrap().bytes, 0);
    // No mountinfo: the default mount point; a namespaced mount root is stripped.
    let read = files(&[
        ("/sys/fs/cgroup/k3.service/memory.max", "4096"),
        ("/sys/fs/cgroup/k3.service/memory.current", "96"),
    ]);
    assert_eq!(
        cgroup_headroom("0::/k3.service\n", "", &read)
            .unwrap()
            .bytes,
        4000
    );
    let nested = "30 23 0:26 /docker/xyz /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
    assert_eq!(
        cgroup_headroom("0::/docker/xyz/k3.service\n", nested, &read)
            .unwrap()
            .bytes,
        4000
    );
}
