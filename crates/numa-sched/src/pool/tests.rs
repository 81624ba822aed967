//! The pool's tests: task order, placement by domain, install, broadcast, several callers, panics, drop.

use super::*;

fn fake(domains: usize, threads: Threads) -> Pool {
    Pool::with_topology(Topology::split(&[0, 1], domains, Vec::new()), threads).unwrap()
}

#[test]
fn results_come_back_in_task_order() {
    for threads in [1, 2, 3] {
        let pool = Pool::new(threads).unwrap();
        let squares = pool.map(100, |i| i * i).unwrap();
        assert_eq!(squares, (0..100).map(|i| i * i).collect::<Vec<_>>());
    }
    assert!(matches!(Pool::new(0), Err(Error::NoThreads)));
}

#[test]
fn workers_are_named_by_domain_and_index() {
    let pool = Pool::new(2).unwrap();
    let names = pool
        .map(8, |_| std::thread::current().name().map(str::to_owned))
        .unwrap();
    assert!(
        names
            .iter()
            .all(|n| n.as_deref().is_some_and(|n| n.starts_with("k3-d0-w"))),
        "{names:?}"
    );
}

#[test]
fn tasks_run_on_the_domain_they_are_tagged_with() {
    for domains in [2, 3, 4] {
        for threads in [
            Threads::Total(2),
            Threads::PerDomain(1),
            Threads::PerDomain(2),
        ] {
            let pool = fake(domains, threads);
            let tag = |i: usize| (i * 7) % domains;
            let ran = pool
                .map_on(40, tag, |i| {
                    (i, std::thread::current().name().map(str::to_owned))
                })
                .unwrap();
            for (i, (j, name)) in ran.into_iter().enumerate() {
                assert_eq!(i, j);
                let name = name.unwrap_or_default();
                if pool.threads() > 1 {
                    assert!(
                        name.starts_with(&format!("k3-d{}-w", tag(i))),
                        "task {i} on {name}, {domains} domains, {threads:?}"
                    );
                }
            }
            // Blocks of tasks per domain for `map`.
            assert_eq!(pool.block_domain(0, 40), 0);
            assert_eq!(pool.block_domain(39, 40), domains - 1);
        }
    }
    let pool = fake(2, Threads::Total(2));
    assert!(matches!(
        pool.map_on(3, |_| 5, |i| i),
        Err(Error::NoDomain { domain: 5, .. })
    ));
}

#[test]
fn thread_counts_split_over_domains() {
    assert_eq!(Threads::Total(2).split(2), [1, 1]);
    assert_eq!(Threads::Total(5).split(2), [2, 3]);
    assert_eq!(Threads::Total(2).split(4), [1, 1, 1, 1]);
    assert_eq!(Threads::PerDomain(3).split(2), [3, 3]);
    assert_eq!(fake(3, Threads::Total(2)).threads(), 3);
}

#[test]
fn install_runs_on_a_worker_and_map_inside_keeps_task_order() {
    let pool = Pool::new(2).unwrap();
    let (name, squares) = pool.install(|| {
        (
            std::thread::current().name().map(str::to_owned),
            pool.map(50, |i| i * i).unwrap(),
        )
    });
    assert!(
        name.as_deref().is_some_and(|n| n.starts_with("k3-d0-w")),
        "{name:?}"
    );
    assert_eq!(squares, (0..50).map(|i| i * i).collect::<Vec<_>>());
    // One thread: the caller runs it.
    let one = Pool::new(1).unwrap();
    assert_eq!(one.install(|| one.map(3, |i| i + 1).unwrap()), [1, 2, 3]);
    // Several domains, from inside domain 0.
    let multi = fake(3, Threads::PerDomain(1));
    let got = multi.install(|| multi.map(30, |i| i + 1).unwrap());
    assert_eq!(got, (1..=30).collect::<Vec<_>>());
    // Inside install the other domains spin on their mailboxes: tasks still run on the
    // domain they are tagged with, call after call, and a panic is still an error.
    multi.install(|| {
        for round in 0..200 {
            let names = multi
                .map_on(
                    9,
                    |i| (i + round) % 3,
                    |_| std::thread::current().name().map(str::to_owned),
                )
                .unwrap();
            for (i, name) in names.iter().enumerate() {
                let want = format!("k3-d{}-w", (i + round) % 3);
                assert!(
                    name.as_deref().is_some_and(|n| n.starts_with(&want)),
                    "{name:?}"
                );
            }
        }
        let err = multi.map_on(4, |i| i % 3, |i| assert!(i != 2, "task 2 failed"));
        assert!(matches!(err, Err(Error::TaskPanicked { task: 2, .. })));
    });
    assert_eq!(multi.map(3, |i| i).unwrap(), [0, 1, 2]);
}

#[test]
fn a_panicking_task_is_an_error_and_the_pool_survives() {
    for pool in [Pool::new(2).unwrap(), fake(2, Threads::Total(2))] {
        let err = pool
            .map(4, |i| if i == 2 { panic!("task 2 failed") } else { i })
            .unwrap_err();
        assert!(
            matches!(&err, Error::TaskPanicked { task: 2, message, .. } if message == "task 2 failed"),
            "{err}"
        );
        assert_eq!(pool.map(3, |i| i + 1).unwrap(), [1, 2, 3]);
    }
}

/// Two threads drive one pool at once, with and without `install`, over several domains
/// (where `install` makes the other domains' workers take posted lists from a mailbox
/// each): every call returns its own results, and none waits forever.
#[test]
fn several_threads_may_drive_one_pool() {
    let pool = Arc::new(fake(3, Threads::PerDomain(1)));
    let (done, finished) = std::sync::mpsc::channel();
    for caller in 0..2usize {
        let (pool, done) = (Arc::clone(&pool), done.clone());
        // A test's own callers: they stand for two engine threads sharing the pool.
        std::thread::spawn(move || {
            for round in 0..300 {
                let want: Vec<usize> = (0..9).map(|i| i * 1000 + caller + round).collect();
                let task = |i: usize| i * 1000 + caller + round;
                let tag = |i: usize| (i + round) % 3;
                let got = if round % 2 == 0 {
                    pool.install(|| pool.map_on(9, tag, task).unwrap())
                } else {
                    pool.map_on(9, tag, task).unwrap()
                };
                assert_eq!(got, want, "caller {caller}, round {round}");
            }
            done.send(caller).unwrap();
        });
    }
    for _ in 0..2 {
        // Generous: the rounds take milliseconds; a missed post would wait forever.
        finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("both callers finish: a caller failed or the pool deadlocked");
    }
}

#[test]
fn broadcast_runs_once_on_every_worker() {
    for (pool, domains) in [
        (Pool::new(2).unwrap(), 1),
        (fake(2, Threads::PerDomain(2)), 2),
        (fake(3, Threads::Total(3)), 3),
    ] {
        let seen: Vec<Mutex<Vec<String>>> = (0..pool.threads())
            .map(|_| Mutex::new(Vec::new()))
            .collect();
        pool.broadcast(|w| {
            let name = std::thread::current().name().unwrap_or_default().to_owned();
            seen[w].lock().unwrap().push(name);
        });
        let names: Vec<String> = seen
            .into_iter()
            .map(|s| {
                let mut runs = s.into_inner().unwrap();
                assert_eq!(runs.len(), 1, "worker ran {runs:?}");
                runs.pop().unwrap()
            })
            .collect();
        // Worker indices count domain 0's workers first: each is its own pinned worker.
        let mut want = Vec::new();
        for d in 0..domains {
            want.extend((0..pool.domain_threads(d)).map(|i| format!("k3-d{d}-w{i}")));
        }
        let mut sorted = names.clone();
        sorted.sort();
        want.sort();
        assert_eq!(sorted, want);
        for (w, name) in names.iter().enumerate() {
            let d = (0..domains)
                .find(|&d| name.starts_with(&format!("k3-d{d}-")))
                .unwrap();
            let first: usize = (0..d).map(|e| pool.domain_threads(e)).sum();
            assert!(
                w >= first && w < first + pool.domain_threads(d),
                "{w} ran on {name}"
            );
        }
    }
}

#[test]
fn dropping_a_pool_joins_its_workers() {
    let pool = fake(2, Threads::PerDomain(2));
    let live = Arc::clone(&pool.live);
    assert_eq!(pool.map(8, |i| i).unwrap().len(), 8);
    drop(pool);
    assert_eq!(*live.count.lock().unwrap(), 0);
}
