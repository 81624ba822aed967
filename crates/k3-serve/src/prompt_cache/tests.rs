//! The prompt cache over real snapshots of the `tiny` preset: LRU eviction under a tiny
//! budget, held snapshots surviving eviction pressure, 200 conversations within budget, the
//! longest prefix chosen, spill files read back after a restart and corrupt or foreign ones
//! ignored, a snapshot too large for the disk budget kept in RAM only.

use std::path::PathBuf;
use std::sync::Arc;

use expert_store::Checkpoint;
use k3_model::config::K3Config;
use k3_model::model::snapshot::file::Identity;
use k3_model::model::{Model, Snapshot, fingerprint};
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;

use super::{Namespace, PromptCache, SpillOptions};

/// The namespace of every test but the isolation one.
const NS: Namespace = Namespace([0; 16]);

/// A tiny checkpoint and the snapshots of one session after 1..=`max` tokens (the cache
/// only checks that a snapshot's position is its token count, so conversations reuse them).
struct Fixture {
    _dir: Scratch,
    ckpt: Checkpoint,
    config: K3Config,
    /// `by_len[n]`: the state after `n` tokens (index 0 unused).
    by_len: Vec<Arc<Snapshot>>,
}

const STREAM: [usize; 12] = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26];

fn fixture(tag: &str) -> Fixture {
    let dir = Scratch::new(&format!("prompt-cache-{tag}"));
    let config = generate(dir.path(), &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let by_len = {
        let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
        let mut session = model.session();
        let mut by_len = vec![Arc::new(session.snapshot())];
        for &t in &STREAM {
            model.decode_step(&mut session, t).unwrap();
            by_len.push(Arc::new(session.snapshot()));
        }
        by_len
    };
    Fixture {
        _dir: dir,
        ckpt,
        config,
        by_len,
    }
}

impl Fixture {
    /// The cache's own copy of the state after `tokens.len()` tokens (a shared `Arc` would
    /// count as held by a request).
    fn snap(&self, tokens: &[usize]) -> Arc<Snapshot> {
        Arc::new((*self.by_len[tokens.len()]).clone())
    }

    fn bytes(&self, len: usize) -> usize {
        self.by_len[len].bytes()
    }

    fn identity(&self) -> Identity {
        Identity::of(&self.ckpt, &self.config)
    }

    /// The fingerprint of the logits after restoring `snapshot` and feeding one token.
    fn next_logits(&self, snapshot: &Snapshot) -> u64 {
        let model = Model::new(&self.ckpt, &self.config, Kernels::detect()).unwrap();
        let mut session = model.session();
        model.restore(&mut session, snapshot).unwrap();
        fingerprint(&model.decode_step(&mut session, 7).unwrap())
    }
}

fn found(cache: &mut PromptCache, tokens: &[usize]) -> Option<usize> {
    cache.longest_prefix(NS, tokens).map(|hit| hit.tokens)
}

#[test]
fn eviction_is_least_recently_used_first() {
    let f = fixture("lru");
    let (a, b, c, d) = ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]);
    let mut cache = PromptCache::new(3 * f.bytes(3), None);
    for t in [&a, &b, &c] {
        assert!(cache.insert(NS, t, f.snap(t)));
    }
    assert_eq!(cache.stats().bytes_held, 3 * f.bytes(3) as u64);
    // A is used again: B is now the least recently used.
    assert_eq!(found(&mut cache, &a), Some(3));
    assert!(cache.insert(NS, &d, f.snap(&d)));
    assert_eq!(found(&mut cache, &b), None, "B was evicted");
    for t in [&a, &c, &d] {
        assert_eq!(found(&mut cache, t), Some(3));
    }
    // A, C, D were looked up in that order, then A again: C is the oldest use now.
    assert_eq!(found(&mut cache, &a), Some(3));
    assert!(cache.insert(NS, &b, f.snap(&b)));
    assert_eq!(found(&mut cache, &c), None, "C was evicted");
    let stats = cache.stats();
    assert_eq!(stats.evictions, 2);
    assert_eq!(stats.entries, 3);
    assert_eq!(stats.bytes_held, 3 * f.bytes(3) as u64);
}

#[test]
fn held_snapshots_survive_eviction_pressure() {
    let f = fixture("held");
    let (a, b, c, d) = ([1, 2], [3, 4], [5, 6], [7, 8]);
    let mut cache = PromptCache::new(2 * f.bytes(2), None);
    let own = |t: &[usize]| f.snap(t);
    cache.insert(NS, &a, own(&a));
    cache.insert(NS, &b, own(&b));
    let held = cache.longest_prefix(NS, &a).unwrap();
    // B used after A: A is the least recently used, but a request holds it.
    assert_eq!(found(&mut cache, &b), Some(2));
    assert!(cache.insert(NS, &c, own(&c)));
    assert_eq!(found(&mut cache, &b), None, "B went instead of the held A");
    assert_eq!(found(&mut cache, &a), Some(2));
    // Both held: nothing can make room, the insert is refused and the budget kept.
    let held_c = cache.longest_prefix(NS, &c).unwrap();
    assert!(!cache.insert(NS, &d, own(&d)));
    assert_eq!(found(&mut cache, &d), None);
    assert!(cache.stats().bytes_held <= 2 * f.bytes(2) as u64);
    assert_eq!(cache.stats().rejected, 1);
    // Released: room again.
    drop((held, held_c));
    assert!(cache.insert(NS, &d, own(&d)));
    assert_eq!(found(&mut cache, &d), Some(2));
}

#[test]
fn two_hundred_conversations_keep_ram_within_budget() {
    let f = fixture("stream");
    let budget = 5 * f.bytes(STREAM.len());
    let mut cache = PromptCache::new(budget, None);
    let own = |n: usize| Arc::new((*f.by_len[n]).clone());
    let mut peak_entries = 0;
    let mut hits = 0;
    for conversation in 0..200usize {
        // Turn 1: a system-ish opener and the conversation's own tokens; turn 2 extends it.
        let turn1 = vec![conversation + 1000, conversation % 7, 5, 6];
        let mut turn2 = turn1.clone();
        turn2.extend([conversation % 11, 9, 9, 9]);
        assert_eq!(
            found(&mut cache, &turn1),
            None,
            "conversation {conversation} is new"
        );
        cache.insert(NS, &turn1, own(turn1.len()));
        if found(&mut cache, &turn2) == Some(turn1.len()) {
            hits += 1;
        }
        cache.insert(NS, &turn2, own(turn2.len()));
        let stats = cache.stats();
        assert!(stats.bytes_held <= budget as u64, "{stats:?}");
        assert!(stats.entries >= 1);
        peak_entries = peak_entries.max(stats.entries);
    }
    // The previous turn is always the most recent entry, so every turn 2 hits.
    assert_eq!(hits, 200);
    let stats = cache.stats();
    // Every snapshot not in RAM at the end was evicted; several fit at once.
    assert_eq!(stats.evictions, 400 - stats.entries, "{stats:?}");
    assert!(peak_entries >= 5, "{stats:?}");
    assert_eq!(stats.hits, 200);
    assert_eq!(stats.cached_tokens_served, 200 * 4);
}

#[test]
fn the_longest_cached_prefix_is_chosen() {
    let f = fixture("longest");
    let mut cache = PromptCache::new(1 << 30, None);
    let (short, mid, long, other) = (
        vec![1, 2],
        vec![1, 2, 3, 4],
        vec![1, 2, 3, 4, 5, 6],
        vec![9, 9],
    );
    for t in [&short, &mid, &long, &other] {
        cache.insert(NS, t, f.snap(t));
    }
    // `contains` is exact and counts no use.
    assert!(
        cache.contains(NS, &mid) && !cache.contains(NS, &[1, 2, 3]) && !cache.contains(NS, &[])
    );
    assert_eq!(cache.stats().hits + cache.stats().misses, 0);
    assert_eq!(found(&mut cache, &[1, 2, 3, 4, 5, 7]), Some(4));
    assert_eq!(found(&mut cache, &[1, 2, 3]), Some(2));
    assert_eq!(found(&mut cache, &[1, 2, 3, 4, 5, 6, 8]), Some(6));
    assert_eq!(found(&mut cache, &[1, 2, 3, 4, 5, 6]), Some(6));
    assert_eq!(found(&mut cache, &[9, 9, 9]), Some(2));
    assert_eq!(found(&mut cache, &[2, 1]), None);
    assert_eq!(found(&mut cache, &[1]), None);
    let hit = cache.longest_prefix(NS, &[1, 2, 3, 4, 0]).unwrap();
    assert_eq!(hit.snapshot.position(), 4);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (6, 2));
    assert_eq!(stats.cached_tokens_served, 4 + 2 + 6 + 6 + 2 + 4);
    // A snapshot not at its tokens' length is not cached.
    assert!(!cache.insert(NS, &[5, 5, 5], f.snap(&[5, 5])));
    assert_eq!(found(&mut cache, &[5, 5, 5]), None);
}

#[test]
fn a_zero_budget_holds_nothing() {
    let f = fixture("zero");
    let mut cache = PromptCache::new(0, None);
    assert!(!cache.insert(NS, &[1, 2], f.snap(&[1, 2])));
    assert_eq!(found(&mut cache, &[1, 2, 3]), None);
    assert_eq!(cache.stats().bytes_held, 0);
}

#[test]
fn spilled_snapshots_survive_a_restart_and_bad_files_are_ignored() {
    let f = fixture("spill");
    let dir = Scratch::new("prompt-cache-spill-dir");
    let spill = SpillOptions {
        dir: dir.path().join("cache"),
        budget_bytes: 1 << 30,
        identity: f.identity(),
    };
    let (a, b) = ([1, 2, 3], [4, 5, 6, 7, 8]);
    let expected_a = f.next_logits(&f.snap(&a));
    {
        // RAM for one snapshot: A leaves RAM when B comes, but stays on disk.
        let mut cache = PromptCache::new(f.bytes(5), Some(spill.clone()));
        assert!(cache.insert(NS, &a, f.snap(&a)));
        assert!(cache.insert(NS, &b, f.snap(&b)));
        assert_eq!(cache.stats().evictions, 1);
        let hit = cache.longest_prefix(NS, &[1, 2, 3, 9]).unwrap();
        assert_eq!(hit.tokens, 3);
        assert_eq!(cache.stats().disk_loads, 1);
        assert_eq!(f.next_logits(&hit.snapshot), expected_a);
    }
    let files = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&spill.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    assert_eq!(files().len(), 2, "{:?}", files());
    // A restart: both found again, read back on a hit with the same bits.
    let mut cache = PromptCache::new(1 << 30, Some(spill.clone()));
    assert_eq!(cache.stats().entries, 0);
    assert!(cache.stats().disk_bytes > 0);
    let hit = cache.longest_prefix(NS, &[1, 2, 3, 0]).unwrap();
    assert_eq!(hit.tokens, 3);
    assert_eq!(f.next_logits(&hit.snapshot), expected_a);
    assert_eq!(found(&mut cache, &[4, 5, 6, 7, 8, 1]), Some(5));
    drop(cache);
    // A flipped payload byte in B's file: the header still reads, the hit does not trust it.
    let b_file = files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-5.k3state"))
        .unwrap();
    let mut bytes = std::fs::read(&b_file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&b_file, &bytes).unwrap();
    let mut cache = PromptCache::new(1 << 30, Some(spill.clone()));
    assert_eq!(found(&mut cache, &[4, 5, 6, 7, 8, 1]), None);
    assert_eq!(cache.stats().ignored_files, 1);
    assert_eq!(found(&mut cache, &[1, 2, 3]), Some(3), "A is still good");
    // A cache for another checkpoint ignores every file.
    let foreign = SpillOptions {
        identity: Identity {
            checkpoint: f.identity().checkpoint ^ 1,
            ..f.identity()
        },
        ..spill.clone()
    };
    let mut cache = PromptCache::new(1 << 30, Some(foreign));
    assert_eq!(cache.stats().ignored_files, 2);
    assert_eq!(found(&mut cache, &[1, 2, 3]), None);
    // A garbage file with the extension is ignored too.
    std::fs::write(spill.dir.join("junk.k3state"), b"not a snapshot").unwrap();
    let cache = PromptCache::new(1 << 30, Some(spill));
    assert_eq!(cache.stats().ignored_files, 1);
}

#[test]
fn spill_files_stay_within_their_budget() {
    let f = fixture("disk-budget");
    let dir = Scratch::new("prompt-cache-disk-budget-dir");
    // Room on disk for about two 3-token files.
    let probe = {
        let mut cache = PromptCache::new(
            0,
            Some(SpillOptions {
                dir: dir.path().join("probe"),
                budget_bytes: 1 << 30,
                identity: f.identity(),
            }),
        );
        cache.insert(NS, &[1, 2, 3], f.snap(&[1, 2, 3]));
        cache.stats().disk_bytes
    };
    let spill = SpillOptions {
        dir: dir.path().join("cache"),
        budget_bytes: 2 * probe + probe / 2,
        identity: f.identity(),
    };
    let mut cache = PromptCache::new(0, Some(spill.clone()));
    for first in 0..5 {
        cache.insert(NS, &[first, 2, 3], f.snap(&[1, 2, 3]));
        assert!(cache.stats().disk_bytes <= spill.budget_bytes);
    }
    assert_eq!(std::fs::read_dir(&spill.dir).unwrap().count(), 2);
    // The two newest remain.
    assert_eq!(found(&mut cache, &[4, 2, 3]), Some(3));
    assert_eq!(found(&mut cache, &[3, 2, 3]), Some(3));
    assert_eq!(found(&mut cache, &[2, 2, 3]), None);
}

#[test]
fn a_snapshot_larger_than_the_disk_budget_is_kept_in_ram_only() {
    let f = fixture("disk-too-small");
    let dir = Scratch::new("prompt-cache-disk-too-small-dir");
    let spill = SpillOptions {
        dir: dir.path().join("cache"),
        // Less than one snapshot's file.
        budget_bytes: f.bytes(3) as u64 / 2,
        identity: f.identity(),
    };
    let mut cache = PromptCache::new(1 << 30, Some(spill.clone()));
    assert!(
        cache.insert(NS, &[1, 2, 3], f.snap(&[1, 2, 3])),
        "it fits the RAM"
    );
    assert_eq!(found(&mut cache, &[1, 2, 3, 4]), Some(3));
    let stats = cache.stats();
    assert_eq!((stats.disk_bytes, stats.entries), (0, 1), "{stats:?}");
    assert_eq!(std::fs::read_dir(&spill.dir).unwrap().count(), 0);
    // A budget of the state's bytes: the file (with its header) comes out larger, and is
    // deleted again, the entry kept in RAM.
    let exact = SpillOptions {
        budget_bytes: f.bytes(3) as u64,
        ..spill.clone()
    };
    let mut cache = PromptCache::new(1 << 30, Some(exact));
    assert!(cache.insert(NS, &[1, 2, 3], f.snap(&[1, 2, 3])));
    assert_eq!(found(&mut cache, &[1, 2, 3, 4]), Some(3));
    assert_eq!(cache.stats().disk_bytes, 0);
    assert_eq!(std::fs::read_dir(&spill.dir).unwrap().count(), 0);
    // Neither RAM nor disk: not cached, and nothing left behind.
    let mut cache = PromptCache::new(f.bytes(3) / 2, Some(spill.clone()));
    assert!(!cache.insert(NS, &[4, 5, 6], f.snap(&[4, 5, 6])));
    assert_eq!(found(&mut cache, &[4, 5, 6, 7]), None);
    assert_eq!(std::fs::read_dir(&spill.dir).unwrap().count(), 0);
}

/// Entries are found only from their own namespace, in RAM and after a restart from the spill
/// directory: the same tokens cached by one tenant are a miss for another, and each tenant's
/// own entry is found (issue 31: `cached_tokens` must not tell one tenant another's prompt).
#[test]
fn namespaces_never_share_entries() {
    let f = fixture("namespaces");
    let dir = Scratch::new("prompt-cache-namespaces-dir");
    let spill = SpillOptions {
        dir: dir.path().join("cache"),
        budget_bytes: 1 << 30,
        identity: f.identity(),
    };
    let (alice, bob) = (Namespace([1; 16]), Namespace([2; 16]));
    let secret = [3, 14, 15, 92, 65];
    {
        let mut cache = PromptCache::new(1 << 30, Some(spill.clone()));
        assert!(cache.insert(alice, &secret, f.snap(&secret)));
        assert!(cache.contains(alice, &secret));
        assert!(!cache.contains(bob, &secret) && !cache.contains(NS, &secret));
        assert!(
            cache
                .longest_prefix(bob, &[3, 14, 15, 92, 65, 35])
                .is_none()
        );
        assert_eq!(
            cache
                .longest_prefix(alice, &[3, 14, 15, 92, 65, 35])
                .map(|h| h.tokens),
            Some(5)
        );
        // Bob caches the same tokens: a second entry, his own.
        assert!(cache.insert(bob, &secret, f.snap(&secret)));
        assert_eq!(cache.stats().entries, 2);
    }
    // After a restart the files come back into their namespaces.
    let mut cache = PromptCache::new(1 << 30, Some(spill));
    assert_eq!(cache.stats().ignored_files, 0);
    assert!(cache.longest_prefix(NS, &[3, 14, 15, 92, 65, 35]).is_none());
    for namespace in [alice, bob] {
        let hit = cache
            .longest_prefix(namespace, &[3, 14, 15, 92, 65, 35])
            .expect("its own entry");
        assert_eq!(hit.tokens, 5);
    }
    assert_eq!(cache.stats().disk_loads, 2);
}
