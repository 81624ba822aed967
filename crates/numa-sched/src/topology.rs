//! The machine's NUMA domains and their CPUs: read from `/sys/devices/system/node` (no node
//! directory means one node), or a synthetic split of the CPUs into N domains so multi-domain
//! code paths run on a one-node machine.

use std::path::Path;

/// One domain: the CPUs its workers may run on and, for a real node, its node id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    /// Index in [`Topology::domains`].
    pub index: usize,
    /// The kernel's NUMA node (`None` for a synthetic domain: memory cannot be bound to it).
    pub node: Option<usize>,
    /// Logical CPU ids, ascending; hyperthread siblings removed unless asked for.
    pub cpus: Vec<usize>,
    /// The node's memory (`MemTotal` of its meminfo), when known.
    pub memory_bytes: Option<u64>,
}

/// Where the domains came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologySource {
    /// `/sys/devices/system/node`.
    Sysfs,
    /// No node directory: the whole machine as one domain.
    SingleNode,
    /// `Topology::fake(n)`: the CPUs split into `n` synthetic domains.
    Fake(usize),
    /// Every CPU of the machine's nodes as one domain (NUMA not asked for).
    Merged,
}

/// The domains work is placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The domains, by index ([`Domain::index`]).
    pub domains: Vec<Domain>,
    /// Where they came from.
    pub source: TopologySource,
    /// Hyperthread siblings that were dropped (CPU ids).
    pub skipped_siblings: Vec<usize>,
}

/// How to read the machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TopologyOptions {
    /// Keep hyperthread siblings (default: one logical CPU per physical core).
    pub hyperthreads: bool,
}

impl Topology {
    /// The real topology: NUMA nodes from sysfs, each with the CPUs this process may run on.
    /// Nodes without such CPUs (memory-only nodes, or CPUs outside the affinity mask) are
    /// left out; with no node directory the machine is one domain.
    pub fn detect(options: TopologyOptions) -> Self {
        Self::from_sysfs(Path::new("/sys/devices/system"), &allowed_cpus(), options)
    }

    /// The CPUs this process may run on, split into `domains` synthetic domains of
    /// contiguous CPUs (sizes differ by at most one). With more domains than CPUs, CPUs are
    /// shared round-robin so every domain has one.
    pub fn fake(domains: usize, options: TopologyOptions) -> Self {
        let real = Self::detect(options);
        let mut cpus: Vec<usize> = real.domains.iter().flat_map(|d| d.cpus.clone()).collect();
        cpus.sort_unstable();
        Self::split(&cpus, domains.max(1), real.skipped_siblings)
    }

    /// `cpus` split into `n` synthetic domains (see [`Topology::fake`]).
    pub fn split(cpus: &[usize], n: usize, skipped_siblings: Vec<usize>) -> Self {
        let n = n.max(1);
        let cpus = if cpus.is_empty() { &[0][..] } else { cpus };
        let domains = (0..n)
            .map(|d| {
                let part: Vec<usize> = if n <= cpus.len() {
                    cpus[d * cpus.len() / n..(d + 1) * cpus.len() / n].to_vec()
                } else {
                    vec![cpus[d % cpus.len()]]
                };
                Domain {
                    index: d,
                    node: None,
                    cpus: part,
                    memory_bytes: None,
                }
            })
            .collect();
        Self {
            domains,
            source: TopologySource::Fake(n),
            skipped_siblings,
        }
    }

    /// Reads `root/node/node*/cpulist` and `root/cpu/cpu*/topology/thread_siblings_list`.
    pub fn from_sysfs(root: &Path, allowed: &[usize], options: TopologyOptions) -> Self {
        let keep = |cpu: &usize| allowed.is_empty() || allowed.contains(cpu);
        let mut skipped = Vec::new();
        let mut physical = |cpus: Vec<usize>| -> Vec<usize> {
            if options.hyperthreads {
                return cpus;
            }
            cpus.into_iter()
                .filter(|&cpu| {
                    let siblings = std::fs::read_to_string(
                        root.join(format!("cpu/cpu{cpu}/topology/thread_siblings_list")),
                    )
                    .ok()
                    .and_then(|s| parse_cpulist(&s))
                    .unwrap_or_default();
                    // The lowest allowed sibling stands for the core.
                    let first = siblings.iter().copied().filter(|c| keep(c)).min();
                    let is_first = first.is_none_or(|f| f == cpu);
                    if !is_first {
                        skipped.push(cpu);
                    }
                    is_first
                })
                .collect()
        };
        let mut nodes: Vec<(usize, Vec<usize>, Option<u64>)> = std::fs::read_dir(root.join("node"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let id: usize = name.strip_prefix("node")?.parse().ok()?;
                let cpus =
                    parse_cpulist(&std::fs::read_to_string(entry.path().join("cpulist")).ok()?)?;
                let memory = std::fs::read_to_string(entry.path().join("meminfo"))
                    .ok()
                    .and_then(|m| node_mem_total(&m));
                Some((id, cpus, memory))
            })
            .collect();
        nodes.sort_by_key(|n| n.0);
        let mut domains = Vec::new();
        for (id, cpus, memory) in nodes {
            let cpus = physical(cpus.into_iter().filter(|c| keep(c)).collect());
            if !cpus.is_empty() {
                domains.push(Domain {
                    index: domains.len(),
                    node: Some(id),
                    cpus,
                    memory_bytes: memory,
                });
            }
        }
        if domains.is_empty() {
            let online = std::fs::read_to_string(root.join("cpu/online"))
                .ok()
                .and_then(|s| parse_cpulist(&s))
                .unwrap_or_else(|| allowed.to_vec());
            let mut cpus = physical(online.into_iter().filter(|c| keep(c)).collect());
            if cpus.is_empty() {
                cpus = vec![0];
            }
            return Self {
                domains: vec![Domain {
                    index: 0,
                    node: None,
                    cpus,
                    memory_bytes: None,
                }],
                source: TopologySource::SingleNode,
                skipped_siblings: skipped,
            };
        }
        Self {
            domains,
            source: TopologySource::Sysfs,
            skipped_siblings: skipped,
        }
    }

    /// One line for the startup log.
    pub fn describe(&self) -> String {
        let source = match self.source {
            TopologySource::Sysfs => "NUMA nodes from sysfs".to_string(),
            TopologySource::SingleNode => "one node (no NUMA information)".to_string(),
            TopologySource::Fake(n) => format!("{n} synthetic domains (--numa-fake)"),
            TopologySource::Merged => "all CPUs as one domain (no --numa)".to_string(),
        };
        let domains: Vec<String> = self
            .domains
            .iter()
            .map(|d| {
                let node = d.node.map_or(String::new(), |n| format!(" node {n}"));
                let memory = d
                    .memory_bytes
                    .map_or(String::new(), |m| format!(", {:.1} GB", m as f64 / 1e9));
                format!(
                    "d{}{node}: cpus {}{memory}",
                    d.index,
                    format_cpulist(&d.cpus)
                )
            })
            .collect();
        let siblings = if self.skipped_siblings.is_empty() {
            String::new()
        } else {
            format!(
                "; hyperthread siblings skipped: {}",
                format_cpulist(&self.skipped_siblings)
            )
        };
        format!("topology: {source}; {}{siblings}", domains.join("; "))
    }
}

/// The CPUs the process may run on (`sched_getaffinity`), ascending; empty if unknown.
fn allowed_cpus() -> Vec<usize> {
    let mut ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// Parses a kernel CPU list such as `0-3,8,10-11`; `None` when malformed.
pub(crate) fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let text = text.trim();
    if text.is_empty() {
        return Some(Vec::new());
    }
    let mut cpus = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// `0-3,8` from `[0, 1, 2, 3, 8]`.
pub(crate) fn format_cpulist(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// `Node N MemTotal: K kB` from a node's meminfo, in bytes.
fn node_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.contains("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().rev().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse_and_format() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a"), None);
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
    }

    #[test]
    fn fake_splits_cover_the_cpus_and_share_when_short() {
        let t = Topology::split(&[0, 1, 2, 3, 4], 2, vec![]);
        assert_eq!(t.domains[0].cpus, [0, 1]);
        assert_eq!(t.domains[1].cpus, [2, 3, 4]);
        let t = Topology::split(&[0, 1], 3, vec![]);
        let cpus: Vec<Vec<usize>> = t.domains.iter().map(|d| d.cpus.clone()).collect();
        assert_eq!(cpus, [vec![0], vec![1], vec![0]]);
        assert_eq!(t.source, TopologySource::Fake(3));
        assert!(t.describe().contains("3 synthetic domains"));
    }

    /// A two-socket machine written as sysfs files: nodes, their CPUs and memory, and
    /// hyperthread siblings (cpu N and N+4 share a core).
    #[test]
    fn sysfs_nodes_and_siblings() {
        let root = std::env::temp_dir().join(format!("k3-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let write = |rel: &str, text: &str| {
            let path = root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("node/node0/cpulist", "0-1,4-5\n");
        write("node/node0/meminfo", "Node 0 MemTotal:       1000 kB\n");
        write("node/node1/cpulist", "2-3,6-7\n");
        write("node/node1/meminfo", "Node 1 MemTotal:       2000 kB\n");
        write("node/node2/cpulist", "\n"); // memory only
        for cpu in 0..8 {
            let core = cpu % 4;
            write(
                &format!("cpu/cpu{cpu}/topology/thread_siblings_list"),
                &format!("{core},{}\n", core + 4),
            );
        }
        let t = Topology::from_sysfs(&root, &[], TopologyOptions::default());
        assert_eq!(t.source, TopologySource::Sysfs);
        assert_eq!(t.domains.len(), 2);
        assert_eq!(
            (t.domains[0].node, &t.domains[0].cpus[..]),
            (Some(0), &[0, 1][..])
        );
        assert_eq!(
            (t.domains[1].node, &t.domains[1].cpus[..]),
            (Some(1), &[2, 3][..])
        );
        assert_eq!(t.domains[1].memory_bytes, Some(2000 * 1024));
        assert_eq!(t.skipped_siblings, [4, 5, 6, 7]);
        let with_ht = Topology::from_sysfs(&root, &[], TopologyOptions { hyperthreads: true });
        assert_eq!(with_ht.domains[0].cpus, [0, 1, 4, 5]);
        // An affinity mask without node 1's CPUs leaves one domain.
        let masked = Topology::from_sysfs(&root, &[0, 1, 4, 5], TopologyOptions::default());
        assert_eq!(masked.domains.len(), 1);
        // No node directory: one domain from cpu/online.
        std::fs::remove_dir_all(root.join("node")).unwrap();
        write("cpu/online", "0-7\n");
        let single = Topology::from_sysfs(&root, &[], TopologyOptions::default());
        assert_eq!(single.source, TopologySource::SingleNode);
        assert_eq!(single.domains[0].cpus, [0, 1, 2, 3]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
