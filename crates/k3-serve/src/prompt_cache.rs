//! The prompt cache: session snapshots keyed by the exact token prefix they cover, so a
//! request whose prompt extends a cached prefix restores that state and prefills only the
//! rest (bit-identical to a cold prefill; see `k3_model::model::snapshot`).
//!
//! Every entry belongs to a [`Namespace`] (the server's: a tenant, refined by its
//! `cache_salt`), and a lookup only ever finds entries of its own namespace, so what one
//! tenant sent cannot change what another is told (`cached_tokens`, timing).
//!
//! A pure type driven by one thread (`&mut self`): no model, no I/O except the optional spill
//! directory. Entries are found by a hash of each prefix of the query (FNV-1a 64 over the
//! namespace, then the token ids, extended token by token) and confirmed by comparing the
//! stored namespace and tokens. Memory
//! is bounded by a byte budget over the snapshots held in RAM, evicted least recently used
//! first; a snapshot a running request holds (its `Arc` is shared) is never evicted. With a
//! spill directory every inserted snapshot is also written there (checksummed, atomic,
//! `O_DIRECT` where possible), RAM evictions keep the entry on disk, and a new cache over the
//! same directory finds the files again when their checkpoint and engine version match; a
//! corrupt or foreign file is ignored with a warning and never trusted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::file::FileKind;
use k3_model::model::Snapshot;
use k3_model::model::snapshot::file::{self, Identity};

/// Extension of spill files.
const EXTENSION: &str = "k3state";

/// Whose snapshots these are: entries are shared only within one namespace. Opaque bytes to
/// the cache (k3-serve derives them from the API key and `cache_salt` with SHA-256, so a spill
/// file's header never holds a key).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Namespace(pub [u8; 16]);

/// Where snapshots spill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpillOptions {
    /// The directory the files go to.
    pub(crate) dir: PathBuf,
    /// Bytes of files kept (least recently used deleted first).
    pub(crate) budget_bytes: u64,
    /// The engine and checkpoint files must have been written for.
    pub(crate) identity: Identity,
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Lookups that found a cached prefix.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Tokens restored instead of prefilled, over all hits.
    pub cached_tokens_served: u64,
    /// Bytes of snapshots held in RAM.
    pub bytes_held: u64,
    /// Snapshots dropped from RAM to make room (spilled ones stay on disk).
    pub evictions: u64,
    /// Snapshots in RAM.
    pub entries: u64,
    /// Bytes of spill files.
    pub disk_bytes: u64,
    /// Spill files read back on a hit.
    pub disk_loads: u64,
    /// Spill files ignored (corrupt, foreign, unreadable).
    pub ignored_files: u64,
    /// Inserts that did not fit the budget even after evicting everything not held.
    pub rejected: u64,
}

/// A cached prefix found for a prompt: the request holds the snapshot while it restores it
/// (the cache does not evict it meanwhile).
#[derive(Debug, Clone)]
pub(crate) struct Hit {
    /// Tokens the snapshot covers (a prefix of the query).
    pub(crate) tokens: usize,
    /// The session's state at the end of those tokens.
    pub(crate) snapshot: Arc<Snapshot>,
}

/// Snapshots by token prefix, bounded in bytes (see the module docs).
#[derive(Debug)]
pub(crate) struct PromptCache {
    budget_bytes: usize,
    entries: HashMap<u64, Entry>,
    /// Prefix hash → ids of the entries whose tokens have that hash.
    index: HashMap<u64, Vec<u64>>,
    next_id: u64,
    /// Ticks on every use: an entry's `last_use` orders the LRU.
    clock: u64,
    spill: Option<SpillOptions>,
    stats: PromptCacheStats,
}

#[derive(Debug)]
struct Entry {
    namespace: Namespace,
    tokens: Vec<usize>,
    hash: u64,
    /// In RAM.
    snapshot: Option<Arc<Snapshot>>,
    /// On disk: the file and its bytes.
    file: Option<(PathBuf, u64)>,
    last_use: u64,
}

impl PromptCache {
    /// An empty cache holding at most `budget_bytes` of snapshots in RAM (0 holds none),
    /// with `spill`'s directory read back first (created if missing).
    pub(crate) fn new(budget_bytes: usize, spill: Option<SpillOptions>) -> Self {
        let mut cache = Self {
            budget_bytes,
            entries: HashMap::new(),
            index: HashMap::new(),
            next_id: 0,
            clock: 0,
            spill,
            stats: PromptCacheStats::default(),
        };
        if let Some(spill) = cache.spill.clone() {
            cache.scan(&spill);
        }
        cache
    }

    pub(crate) fn stats(&self) -> PromptCacheStats {
        self.stats
    }

    /// Whether a snapshot after exactly `tokens` is cached for `namespace` (in RAM or on
    /// disk); no use is counted.
    pub(crate) fn contains(&self, namespace: Namespace, tokens: &[usize]) -> bool {
        self.find(namespace, tokens).is_some()
    }

    /// The entry for exactly `tokens` in `namespace`.
    fn find(&self, namespace: Namespace, tokens: &[usize]) -> Option<u64> {
        let ids = self.index.get(&PrefixHash::of(namespace, tokens))?;
        ids.iter().copied().find(|id| {
            let e = &self.entries[id];
            e.namespace == namespace && e.tokens == tokens
        })
    }

    /// The snapshot cached for `namespace` covering the longest prefix of `tokens` (all of
    /// `tokens` at most: a caller that needs the logits of the prompt's last token passes the
    /// prompt without it). A spilled entry is read back (and kept in RAM if it fits); one
    /// whose file fails its checks is dropped with a warning and the next shorter prefix is
    /// tried. Entries of other namespaces are never found.
    pub(crate) fn longest_prefix(&mut self, namespace: Namespace, tokens: &[usize]) -> Option<Hit> {
        let mut candidates = Vec::new();
        let mut hash = PrefixHash::new(namespace);
        for (i, &t) in tokens.iter().enumerate() {
            hash.push(t);
            if let Some(ids) = self.index.get(&hash.0) {
                let prefix = &tokens[..=i];
                candidates.extend(ids.iter().filter(|id| {
                    let e = &self.entries[id];
                    e.namespace == namespace && e.tokens == prefix
                }));
            }
        }
        // Longest first (a later prefix is longer).
        for &id in candidates.iter().rev() {
            if let Some(snapshot) = self.snapshot_of(id) {
                let tokens = self.entries[&id].tokens.len();
                self.clock += 1;
                self.entries.get_mut(&id).expect("a live entry").last_use = self.clock;
                self.stats.hits += 1;
                self.stats.cached_tokens_served += tokens as u64;
                return Some(Hit { tokens, snapshot });
            }
        }
        self.stats.misses += 1;
        None
    }

    /// Caches `snapshot` as the state after `tokens` for `namespace` (its position must be
    /// `tokens.len()`, else nothing is stored). Returns whether it is held in RAM: false when
    /// it could not fit the budget even after evicting every snapshot no request holds (it may
    /// still have been spilled). Inserting tokens already cached refreshes that entry.
    pub(crate) fn insert(
        &mut self,
        namespace: Namespace,
        tokens: &[usize],
        snapshot: Arc<Snapshot>,
    ) -> bool {
        if snapshot.position() != tokens.len() || tokens.is_empty() {
            log::warn!(
                "prompt cache: a snapshot at position {} offered for {} tokens: not cached",
                snapshot.position(),
                tokens.len()
            );
            return false;
        }
        self.clock += 1;
        let hash = PrefixHash::of(namespace, tokens);
        let id = match self.find(namespace, tokens) {
            Some(id) => id,
            None => {
                let id = self.next_id;
                self.next_id += 1;
                self.entries.insert(
                    id,
                    Entry {
                        namespace,
                        tokens: tokens.to_vec(),
                        hash,
                        snapshot: None,
                        file: None,
                        last_use: self.clock,
                    },
                );
                self.index.entry(hash).or_default().push(id);
                id
            }
        };
        self.entries.get_mut(&id).expect("a live entry").last_use = self.clock;
        if self.entries[&id].file.is_none() {
            self.spill_entry(id, &snapshot);
        }
        let held = self.keep_in_memory(id, snapshot);
        if !held && self.entries[&id].file.is_none() {
            self.remove(id);
        }
        held
    }

    /// Puts `snapshot` in RAM as entry `id`'s, evicting others as needed; false if it does
    /// not fit.
    fn keep_in_memory(&mut self, id: u64, snapshot: Arc<Snapshot>) -> bool {
        if self.entries[&id].snapshot.is_some() {
            return true;
        }
        let bytes = snapshot.bytes();
        if !self.make_room(bytes, id) {
            self.stats.rejected += 1;
            return false;
        }
        self.entries.get_mut(&id).expect("a live entry").snapshot = Some(snapshot);
        self.stats.bytes_held += bytes as u64;
        self.stats.entries += 1;
        true
    }

    /// Evicts least recently used snapshots no request holds (never `keep`) until `bytes`
    /// more fit the budget; false if they cannot.
    fn make_room(&mut self, bytes: usize, keep: u64) -> bool {
        if bytes > self.budget_bytes {
            return false;
        }
        let mut victims: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|&(&id, e)| {
                id != keep
                    && e.snapshot
                        .as_ref()
                        .is_some_and(|s| Arc::strong_count(s) == 1)
            })
            .map(|(&id, e)| (e.last_use, id))
            .collect();
        let evictable: u64 = victims
            .iter()
            .map(|(_, id)| self.entries[id].snapshot.as_ref().map_or(0, |s| s.bytes()) as u64)
            .sum();
        let needed =
            (self.stats.bytes_held + bytes as u64).saturating_sub(self.budget_bytes as u64);
        if needed > evictable {
            return false;
        }
        victims.sort_unstable();
        for (_, id) in victims {
            if self.stats.bytes_held + bytes as u64 <= self.budget_bytes as u64 {
                break;
            }
            self.evict(id);
        }
        true
    }

    /// Drops entry `id`'s snapshot from RAM (the entry stays if it is on disk).
    fn evict(&mut self, id: u64) {
        let entry = self.entries.get_mut(&id).expect("a live entry");
        if let Some(s) = entry.snapshot.take() {
            self.stats.bytes_held -= s.bytes() as u64;
            self.stats.entries -= 1;
            self.stats.evictions += 1;
        }
        if entry.file.is_none() {
            self.remove(id);
        }
    }

    /// Forgets entry `id` (its file stays unless the caller deletes it).
    fn remove(&mut self, id: u64) {
        let Some(entry) = self.entries.remove(&id) else {
            return;
        };
        if let Some(s) = entry.snapshot {
            self.stats.bytes_held -= s.bytes() as u64;
            self.stats.entries -= 1;
        }
        if let Some((_, bytes)) = entry.file {
            self.stats.disk_bytes -= bytes;
        }
        if let Some(ids) = self.index.get_mut(&entry.hash) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.index.remove(&entry.hash);
            }
        }
    }

    /// Entry `id`'s snapshot: from RAM, else read back from its file (a failed read drops the
    /// entry with a warning).
    fn snapshot_of(&mut self, id: u64) -> Option<Arc<Snapshot>> {
        let entry = &self.entries[&id];
        if let Some(s) = &entry.snapshot {
            return Some(Arc::clone(s));
        }
        let (path, _) = entry.file.clone()?;
        let identity = &self.spill.as_ref()?.identity;
        let loaded = file::load(&path, identity).and_then(|(header, snapshot)| {
            let same = header
                .tokens
                .iter()
                .map(|&t| t as usize)
                .eq(entry.tokens.iter().copied());
            if !same {
                Err(file::FileError::Header {
                    reason: "its tokens are not the entry's".into(),
                })
            } else if header.namespace != entry.namespace.0 {
                Err(file::FileError::Header {
                    reason: "its namespace is not the entry's".into(),
                })
            } else {
                Ok(snapshot)
            }
        });
        match loaded {
            Ok(snapshot) => {
                self.stats.disk_loads += 1;
                let snapshot = Arc::new(snapshot);
                self.keep_in_memory(id, Arc::clone(&snapshot));
                Some(snapshot)
            }
            Err(e) => {
                log::warn!("prompt cache: ignoring {}: {e}", path.display());
                self.stats.ignored_files += 1;
                self.remove(id);
                None
            }
        }
    }

    /// Writes entry `id`'s snapshot to the spill directory, then deletes least recently used
    /// files beyond the disk budget. A snapshot whose file cannot fit the disk budget is not
    /// written (nor kept if its file comes out larger than the estimate); entry `id` itself is
    /// never forgotten here (the caller decides whether it stays in RAM).
    fn spill_entry(&mut self, id: u64, snapshot: &Snapshot) {
        let Some(spill) = &self.spill else { return };
        if snapshot.bytes() as u64 > spill.budget_bytes {
            log::debug!(
                "prompt cache: a snapshot of {} bytes is not spilled: over the disk budget of {} \
                 bytes",
                snapshot.bytes(),
                spill.budget_bytes
            );
            return;
        }
        let entry = &self.entries[&id];
        let name = format!("{:016x}-{}.{EXTENSION}", entry.hash, entry.tokens.len());
        let path = spill.dir.join(name);
        match file::save_in(
            &path,
            &spill.identity,
            entry.namespace.0,
            &entry.tokens,
            snapshot,
        ) {
            Ok(report) => {
                if let Some(reason) = &report.fallback {
                    log::debug!(
                        "prompt cache: {} written buffered: {reason}",
                        path.display()
                    );
                }
                self.stats.disk_bytes += report.bytes;
                self.entries.get_mut(&id).expect("a live entry").file = Some((path, report.bytes));
            }
            Err(e) => {
                log::warn!("prompt cache: could not spill to {}: {e}", path.display());
                return;
            }
        }
        let budget = spill.budget_bytes;
        let mut files: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.file.is_some())
            .map(|(&id, e)| (e.last_use, id))
            .collect();
        files.sort_unstable();
        for (_, victim) in files {
            if self.stats.disk_bytes <= budget {
                break;
            }
            let entry = self.entries.get_mut(&victim).expect("a live entry");
            let (path, bytes) = entry.file.take().expect("filtered on a file");
            let _ = std::fs::remove_file(&path);
            self.stats.disk_bytes -= bytes;
            if entry.snapshot.is_none() && victim != id {
                self.remove(victim);
            }
        }
    }

    /// Registers the spill directory's files whose headers are intact and were written for
    /// this identity (their payload is checked when a hit reads it). The directory is created
    /// if missing, but not its parents (a mistyped path is not built). Only regular files are
    /// read: anything else named like a spill file (a FIFO, socket, device, directory, link)
    /// is skipped with a warning, never opened in a way that could wait.
    fn scan(&mut self, spill: &SpillOptions) {
        let dir = spill.dir.display();
        match std::fs::create_dir(&spill.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                log::warn!("prompt cache: spill directory {dir}: {e}");
                return;
            }
        }
        let listing = match std::fs::read_dir(&spill.dir) {
            Ok(listing) => listing,
            Err(e) => {
                log::warn!("prompt cache: spill directory {dir}: {e}");
                return;
            }
        };
        let mut found = Vec::new();
        for entry in listing.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|x| x != EXTENSION) {
                continue;
            }
            // The entry's own type, links not followed (the directory listing's, else
            // `lstat`); the open checks again, for an entry swapped since.
            let kind = entry.file_type().map(FileKind::of);
            if let Ok(Some(kind)) = kind {
                log::warn!(
                    "prompt cache: ignoring {}: {kind}, not a regular file",
                    path.display()
                );
                self.stats.ignored_files += 1;
                continue;
            }
            match self.accept(&path, &spill.identity) {
                Ok(spilled) => found.push((path, spilled)),
                Err(e) => {
                    log::warn!("prompt cache: ignoring {}: {e}", path.display());
                    self.stats.ignored_files += 1;
                }
            }
        }
        // Oldest first, so the LRU order continues the files' ages.
        found.sort_by_key(|(_, f)| f.modified);
        for (
            path,
            SpillFile {
                namespace,
                tokens,
                bytes,
                ..
            },
        ) in found
        {
            self.clock += 1;
            let hash = PrefixHash::of(namespace, &tokens);
            let id = self.next_id;
            self.next_id += 1;
            self.entries.insert(
                id,
                Entry {
                    namespace,
                    tokens,
                    hash,
                    snapshot: None,
                    file: Some((path, bytes)),
                    last_use: self.clock,
                },
            );
            self.index.entry(hash).or_default().push(id);
            self.stats.disk_bytes += bytes;
        }
    }

    /// A spill file's namespace and tokens, size and age, if its header is whole and matches
    /// `identity`.
    fn accept(&self, path: &Path, identity: &Identity) -> Result<SpillFile, String> {
        let header = file::read_header(path).map_err(|e| e.to_string())?;
        if header.identity != *identity {
            return Err(format!(
                "written for {:?} checkpoint {:016x}, this is {:?} checkpoint {:016x}",
                header.identity.engine,
                header.identity.checkpoint,
                identity.engine,
                identity.checkpoint
            ));
        }
        if header.tokens.is_empty() {
            return Err("it covers no tokens".into());
        }
        // The link itself if one replaced the file since (never followed).
        let modified = std::fs::symlink_metadata(path)
            .and_then(|m| m.modified())
            .map_err(|e| e.to_string())?;
        let tokens = header.tokens.iter().map(|&t| t as usize).collect();
        Ok(SpillFile {
            namespace: Namespace(header.namespace),
            tokens,
            bytes: header.file_bytes,
            modified,
        })
    }
}

/// What a spill file found at startup holds, by its header.
#[derive(Debug)]
struct SpillFile {
    namespace: Namespace,
    tokens: Vec<usize>,
    bytes: u64,
    modified: std::time::SystemTime,
}

/// FNV-1a 64 over the namespace's bytes, then the token ids' little-endian u32 bytes, one
/// token at a time.
#[derive(Debug, Clone, Copy)]
struct PrefixHash(u64);

impl PrefixHash {
    fn new(namespace: Namespace) -> Self {
        let mut h = Self(0xcbf2_9ce4_8422_2325);
        namespace.0.iter().for_each(|&b| h.byte(b));
        h
    }

    fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }

    fn push(&mut self, token: usize) {
        for b in (token as u32).to_le_bytes() {
            self.byte(b);
        }
    }

    fn of(namespace: Namespace, tokens: &[usize]) -> u64 {
        let mut h = Self::new(namespace);
        tokens.iter().for_each(|&t| h.push(t));
        h.0
    }
}

#[cfg(test)]
mod tests;
