//! The store's I/O threads run on the CPUs its config names (an engine's domain 0).

use expert_store::{Checkpoint, ExpertStore, StoreConfig};
use k3_testkit::Scratch;

use crate::checkpoint::{layout, write_checkpoint};

/// `Cpus_allowed_list` of a task's `status` file: `"0-3,8"` style.
fn allowed(status: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
}

/// `allowed` of every live thread of this process named `k3-io-*`.
fn io_thread_cpus() -> Vec<String> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if comm.starts_with("k3-io-")
            && let Some(cpus) = allowed(&status)
        {
            out.push(cpus);
        }
    }
    out
}

#[test]
fn io_threads_run_on_the_cpus_the_config_names() {
    let Ok(me) = std::fs::read_to_string("/proc/self/status") else {
        eprintln!("no /proc/self/status: thread placement is not observable here; skipped");
        return;
    };
    let mine = allowed(&me).expect("Cpus_allowed_list");
    let cpus = core_ids(&mine);
    if cpus.len() < 2 {
        eprintln!("one CPU allowed ({mine}): a placed thread looks like an unplaced one; skipped");
        return;
    }
    let last = *cpus.last().unwrap();
    let dir = Scratch::new("store-io-cpus");
    write_checkpoint(dir.path(), "language_model.");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let store = ExpertStore::open(
        &ckpt,
        layout(),
        StoreConfig {
            io_threads: 2,
            io_cpus: vec![last],
            ..StoreConfig::default()
        },
    )
    .unwrap();
    // Threads of other tests in this binary are unplaced (they inherit `mine`, two CPUs or
    // more), so only this store's threads can show the one CPU; they place themselves as they
    // start, so wait for both.
    let want = last.to_string();
    let start = std::time::Instant::now();
    loop {
        let placed = io_thread_cpus().iter().filter(|c| **c == want).count();
        if placed >= 2 {
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{placed} of 2 I/O threads on CPU {want}: {:?}",
            io_thread_cpus()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(store);
}

/// The CPU ids of a `Cpus_allowed_list` value.
fn core_ids(list: &str) -> Vec<usize> {
    list.split(',')
        .filter(|r| !r.is_empty())
        .flat_map(|r| match r.split_once('-') {
            Some((a, b)) => a.parse().unwrap()..=b.parse().unwrap(),
            None => r.parse().unwrap()..=r.parse().unwrap(),
        })
        .collect()
}
