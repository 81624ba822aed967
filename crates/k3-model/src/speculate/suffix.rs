//! Drafting from earlier requests' outputs: [`SuffixCache`] keeps finished outputs per tenant
//! namespace, indexed by their n-grams, and evicts the least recently used to stay within a
//! byte budget.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use super::ngram::{Draft, MAX_N, MIN_N, ngram_hash, suffix_hashes};

/// Bytes accounted per index entry (one n-gram of one document). The entry's slot in its
/// n-gram's map is 32 bytes (the 8-byte hash and a 24-byte `Vec`), about 38 at the map's
/// 7/8 load with its control byte; the entry itself is a 16-byte posting in that `Vec`'s heap
/// block, with the allocator's header. A document of L tokens has at most 3L entries at the
/// defaults, so about 196 bytes per token are accounted where a document repeats nothing.
pub const ENTRY_BYTES: usize = 64;

/// Documents an n-gram keeps entries for, per namespace: a common n-gram ("\n\n", "```") may
/// occur in every document, and a draft must not scan them all. When a new document's entry
/// makes more, the least recently used document's goes; that document still drafts from its
/// rarer n-grams.
const MAX_POSTINGS: usize = 8;

/// Bytes accounted per token of a document.
const TOKEN_BYTES: usize = size_of::<u32>();

/// Finished outputs of earlier requests, per namespace `K` (the engine's prompt-cache
/// namespace: a lookup sees only its own namespace's documents, so nothing one tenant
/// generated drafts for another), within a byte budget.
#[derive(Debug)]
pub struct SuffixCache<K> {
    budget_bytes: usize,
    min_n: usize,
    max_n: usize,
    /// Accounted bytes of the documents held: tokens and index entries.
    bytes: usize,
    /// Ticks on every insert and hit; gives documents their ids and recency stamps.
    clock: u64,
    documents: HashMap<u64, Document<K>>,
    /// Document ids by last use, oldest first.
    by_use: BTreeMap<u64, u64>,
    namespaces: HashMap<K, Namespace>,
}

/// One stored output.
#[derive(Debug)]
struct Document<K> {
    namespace: K,
    tokens: Vec<u32>,
    last_use: u64,
    /// Index entries pointing at it.
    entries: usize,
}

/// One namespace's index.
#[derive(Debug)]
struct Namespace {
    /// `postings[n - min_n]`: an n-gram's hash to the documents holding it, each with the end
    /// of its last occurrence there that some token follows.
    postings: Vec<HashMap<u64, Vec<Posting>>>,
    documents: usize,
}

#[derive(Debug, Clone, Copy)]
struct Posting {
    document: u64,
    end: usize,
}

impl<K: Hash + Eq + Clone> SuffixCache<K> {
    /// An empty cache of at most `budget_bytes` accounted bytes, matching [`MAX_N`] down to
    /// [`MIN_N`] tokens. A budget of 0 stores nothing.
    pub fn new(budget_bytes: usize) -> Self {
        Self::with_ngram(budget_bytes, MIN_N, MAX_N)
    }

    /// As [`SuffixCache::new`], matching `max_n` down to `min_n` tokens.
    ///
    /// # Panics
    /// If `min_n` is 0 or greater than `max_n`.
    pub fn with_ngram(budget_bytes: usize, min_n: usize, max_n: usize) -> Self {
        assert!(
            min_n >= 1 && min_n <= max_n,
            "n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n {min_n} and max_n {max_n}"
        );
        Self {
            budget_bytes,
            min_n,
            max_n,
            bytes: 0,
            clock: 0,
            documents: HashMap::new(),
            by_use: BTreeMap::new(),
            namespaces: HashMap::new(),
        }
    }

    /// Accounted bytes held: 4 per token plus [`ENTRY_BYTES`] per index entry.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Documents held, over all namespaces.
    pub fn documents(&self) -> usize {
        self.documents.len()
    }

    /// Stores one finished request's output in `namespace` as the most recently used
    /// document, then evicts the least recently used ones until the budget holds. Outputs of
    /// at most `min_n` tokens (nothing could follow a match) and ones that alone exceed the
    /// budget are not stored.
    pub fn insert(&mut self, namespace: K, tokens: &[u32]) {
        if tokens.len() <= self.min_n || TOKEN_BYTES * tokens.len() > self.budget_bytes {
            return;
        }
        self.clock += 1;
        let id = self.clock;
        self.documents.insert(
            id,
            Document {
                namespace: namespace.clone(),
                tokens: tokens.to_vec(),
                last_use: id,
                entries: 0,
            },
        );
        self.by_use.insert(id, id);
        self.bytes += TOKEN_BYTES * tokens.len();
        let groups = self.max_n - self.min_n + 1;
        let space = self
            .namespaces
            .entry(namespace)
            .or_insert_with(|| Namespace {
                postings: vec![HashMap::new(); groups],
                documents: 0,
            });
        space.documents += 1;
        let mut entries = 0;
        for n in self.min_n..=self.max_n {
            let map = &mut space.postings[n - self.min_n];
            // Only n-grams some token follows: one at the very end drafts nothing.
            for end in n..tokens.len() {
                let list = map.entry(ngram_hash(&tokens[end - n..end])).or_default();
                // Ours is always last in the list (newest, and removals keep the order), so a
                // repeat within this document moves our entry to its later occurrence.
                if let Some(last) = list.last_mut().filter(|p| p.document == id) {
                    last.end = end;
                    continue;
                }
                list.push(Posting { document: id, end });
                entries += 1;
                if list.len() > MAX_POSTINGS {
                    let oldest = (0..list.len())
                        .min_by_key(|&i| self.documents[&list[i].document].last_use)
                        .expect("a full list is not empty");
                    let dropped = list.remove(oldest).document;
                    if let Some(doc) = self.documents.get_mut(&dropped) {
                        doc.entries -= 1;
                    }
                    self.bytes -= ENTRY_BYTES;
                }
            }
        }
        self.bytes += ENTRY_BYTES * entries;
        let doc = self.documents.get_mut(&id).expect("just inserted");
        doc.entries += entries;
        if TOKEN_BYTES * tokens.len() + ENTRY_BYTES * doc.entries > self.budget_bytes {
            // It would evict everything else and still not fit.
            self.evict(id);
        }
        while self.bytes > self.budget_bytes {
            let Some((_, &oldest)) = self.by_use.first_key_value() else {
                break;
            };
            self.evict(oldest);
        }
    }

    /// Up to `max_draft` tokens that followed the longest suffix of `context` ([`MAX_N`] down
    /// to [`MIN_N`] tokens) in `namespace`'s documents, from the most recently used document
    /// holding it, up to that document's end. A hit makes that document the most recently
    /// used.
    pub fn draft(&mut self, namespace: &K, context: &[u32], max_draft: usize) -> Draft {
        if max_draft == 0 {
            return Draft::default();
        }
        let Some(space) = self.namespaces.get(namespace) else {
            return Draft::default();
        };
        let hashes: Vec<(usize, u64)> = suffix_hashes(context, self.min_n, self.max_n).collect();
        let hit = hashes.iter().rev().find_map(|&(n, hash)| {
            let suffix = &context[context.len() - n..];
            space.postings[n - self.min_n]
                .get(&hash)?
                .iter()
                .filter(|p| {
                    // Only equal tokens count: a 64-bit hash can collide.
                    let tokens = &self.documents[&p.document].tokens;
                    p.end >= n && tokens[p.end - n..p.end] == *suffix
                })
                .max_by_key(|p| self.documents[&p.document].last_use)
                .map(|p| (n, *p))
        });
        let Some((n, posting)) = hit else {
            return Draft::default();
        };
        self.clock += 1;
        let doc = self
            .documents
            .get_mut(&posting.document)
            .expect("postings point at live documents");
        self.by_use.remove(&doc.last_use);
        self.by_use.insert(self.clock, posting.document);
        doc.last_use = self.clock;
        let stop = doc.tokens.len().min(posting.end + max_draft);
        Draft {
            tokens: doc.tokens[posting.end..stop].to_vec(),
            match_len: n,
        }
    }

    /// Removes a document and every index entry pointing at it (its n-grams recomputed, so
    /// the cost is its length, not the index's size).
    fn evict(&mut self, id: u64) {
        let Some(doc) = self.documents.remove(&id) else {
            return;
        };
        self.by_use.remove(&doc.last_use);
        self.bytes -= TOKEN_BYTES * doc.tokens.len() + ENTRY_BYTES * doc.entries;
        let Entry::Occupied(mut space) = self.namespaces.entry(doc.namespace) else {
            unreachable!("a document's namespace is held while it is");
        };
        space.get_mut().documents -= 1;
        if space.get().documents == 0 {
            space.remove();
            return;
        }
        for n in self.min_n..=self.max_n {
            let map = &mut space.get_mut().postings[n - self.min_n];
            for end in n..doc.tokens.len() {
                if let Entry::Occupied(mut list) = map.entry(ngram_hash(&doc.tokens[end - n..end]))
                {
                    list.get_mut().retain(|p| p.document != id);
                    if list.get().is_empty() {
                        list.remove();
                    }
                }
            }
            // Give back what a burst of documents grew the map to.
            if map.len() * 4 < map.capacity() {
                map.shrink_to_fit();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Index entries over all namespaces.
    fn entries<K>(cache: &SuffixCache<K>) -> usize {
        let postings = cache.namespaces.values().flat_map(|s| &s.postings);
        postings.flat_map(|map| map.values()).map(Vec::len).sum()
    }

    /// Index entries of one document of `len` distinct tokens at the defaults.
    fn distinct_entries(len: usize) -> usize {
        (MIN_N..=MAX_N).map(|n| len - n).sum()
    }

    /// Accounted bytes of one document of `len` distinct tokens at the defaults.
    fn distinct_bytes(len: usize) -> usize {
        TOKEN_BYTES * len + ENTRY_BYTES * distinct_entries(len)
    }

    #[test]
    fn continuation_follows_the_match_up_to_the_document_end() {
        let mut cache = SuffixCache::new(1 << 20);
        cache.insert("a", &[1, 2, 3, 4, 5, 6]);
        let draft = cache.draft(&"a", &[9, 9, 2, 3, 4], 8);
        assert_eq!(draft.tokens, [5, 6]);
        assert_eq!(draft.match_len, 3);
        assert_eq!(cache.draft(&"a", &[9, 1, 2], 1).tokens, [3]);
        // A match only at the document's end has nothing to propose.
        assert_eq!(cache.draft(&"a", &[5, 6], 4), Draft::default());
        assert_eq!(cache.draft(&"a", &[7, 8], 4), Draft::default());
        assert_eq!(cache.draft(&"a", &[2, 3], 0), Draft::default());
    }

    #[test]
    fn namespaces_are_isolated() {
        let mut cache = SuffixCache::new(1 << 20);
        cache.insert("tenant a", &[1, 2, 3, 4]);
        cache.insert("tenant b", &[1, 2, 7, 8]);
        assert_eq!(cache.draft(&"tenant a", &[1, 2], 2).tokens, [3, 4]);
        assert_eq!(cache.draft(&"tenant b", &[1, 2], 2).tokens, [7, 8]);
        assert_eq!(cache.draft(&"tenant c", &[1, 2], 2), Draft::default());
        assert_eq!(cache.draft(&"tenant b", &[2, 3], 2), Draft::default());
    }

    #[test]
    fn most_recently_used_document_wins_and_a_hit_refreshes_it() {
        let mut cache = SuffixCache::new(1 << 20);
        cache.insert(0, &[9, 1, 2, 3]);
        cache.insert(0, &[1, 2, 4]);
        assert_eq!(cache.draft(&0, &[1, 2], 1).tokens, [4]);
        // The longer match is only in the older document; the hit makes it the newest.
        assert_eq!(cache.draft(&0, &[9, 1, 2], 1).tokens, [3]);
        assert_eq!(cache.draft(&0, &[1, 2], 1).tokens, [3]);
        cache.insert(0, &[1, 2, 5]);
        assert_eq!(cache.draft(&0, &[1, 2], 1).tokens, [5]);
    }

    #[test]
    fn lru_eviction_by_bytes_removes_the_document_and_its_entries() {
        let doc = |first: u32| (first..first + 10).collect::<Vec<u32>>();
        let one = distinct_bytes(10);
        // Room for three documents, not four.
        let mut cache = SuffixCache::new(3 * one + one / 2);
        cache.insert((), &doc(0));
        cache.insert((), &doc(100));
        cache.insert((), &doc(200));
        assert_eq!((cache.documents(), cache.bytes()), (3, 3 * one));
        assert_eq!(entries(&cache), 3 * distinct_entries(10));
        // Using the oldest makes the second the least recently used.
        assert_eq!(cache.draft(&(), &[0, 1], 1).tokens, [2]);
        cache.insert((), &doc(300));
        assert_eq!((cache.documents(), cache.bytes()), (3, 3 * one));
        assert_eq!(entries(&cache), 3 * distinct_entries(10));
        assert_eq!(cache.draft(&(), &[100, 101], 1), Draft::default());
        for first in [0, 200, 300] {
            assert_eq!(cache.draft(&(), &[first, first + 1], 1).tokens, [first + 2]);
        }
        // Room for one: the second replaces the first, entries and all.
        let mut cache = SuffixCache::new(one);
        cache.insert((), &doc(0));
        cache.insert((), &doc(100));
        assert_eq!((cache.documents(), cache.bytes()), (1, one));
        assert_eq!(entries(&cache), distinct_entries(10));
        assert_eq!(cache.draft(&(), &[0, 1], 1), Draft::default());
        // The last document of a namespace takes the namespace's index with it.
        let mut cache = SuffixCache::new(one);
        cache.insert("a", &doc(0));
        cache.insert("b", &doc(0));
        assert_eq!(
            (cache.namespaces.len(), entries(&cache)),
            (1, distinct_entries(10))
        );
    }

    #[test]
    fn zero_budget_and_short_or_oversized_outputs_store_nothing() {
        let mut cache = SuffixCache::new(0);
        cache.insert(1, &[1, 2, 3, 4]);
        assert_eq!((cache.documents(), cache.bytes()), (0, 0));
        assert_eq!(cache.draft(&1, &[1, 2], 2), Draft::default());
        let mut cache = SuffixCache::new(distinct_bytes(4));
        cache.insert(1, &[1, 2]);
        cache.insert(1, &[1, 2, 3, 4]);
        assert_eq!(cache.documents(), 1);
        // Too big alone: it neither stays nor flushes what is there.
        cache.insert(1, &[5, 6, 7, 8, 9]);
        assert_eq!((cache.documents(), cache.bytes()), (1, distinct_bytes(4)));
        assert_eq!(cache.draft(&1, &[1, 2], 2).tokens, [3, 4]);
    }

    #[test]
    fn a_common_ngram_keeps_entries_for_the_most_recent_documents_only() {
        let mut cache = SuffixCache::new(1 << 20);
        for k in 0..MAX_POSTINGS as u32 + 3 {
            cache.insert((), &[1, 2, 10 + k, 20 + k]);
        }
        let list = &cache.namespaces[&()].postings[0][&ngram_hash(&[1, 2])];
        assert_eq!(list.len(), MAX_POSTINGS);
        let accounted: usize = cache.documents.values().map(|d| d.entries).sum();
        assert_eq!(accounted, entries(&cache));
        let tokens: usize = cache.documents.values().map(|d| d.tokens.len()).sum();
        assert_eq!(
            cache.bytes(),
            TOKEN_BYTES * tokens + ENTRY_BYTES * accounted
        );
        // The oldest documents still draft from their own n-grams.
        assert_eq!(cache.draft(&(), &[2, 10], 1).tokens, [20]);
    }
}
