//! Drafting from the sequence's own tokens: [`NgramIndex`] finds the latest earlier
//! occurrence of the sequence's last few tokens and proposes what followed them there.

use std::collections::HashMap;

/// Shortest match that drafts. One token repeats far too often by chance (a comma, "the") for
/// what followed it to predict anything; two already carry context.
pub const MIN_N: usize = 2;

/// Longest match tried. Past four tokens a longer match rarely changes the continuation
/// (the latest 4-gram occurrence is nearly always the latest 8-gram's too) while each extra n
/// costs a map per sequence; llama.cpp's lookup decoding and vLLM's prompt lookup use similar
/// small n (1..4, 3..4).
pub const MAX_N: usize = 4;

/// Proposed continuation: tokens to verify, and how many context tokens matched to find them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Draft {
    /// The drafted tokens, in order; empty when nothing matched.
    pub tokens: Vec<u32>,
    /// Length of the matched suffix (0 when nothing matched).
    pub match_len: usize,
}

/// Index of a sequence's n-grams (n in `min_n..=max_n`), updated a token at a time, that
/// drafts from the latest earlier occurrence of the sequence's longest matching suffix.
///
/// Memory: the tokens plus a map entry (16 bytes, 20 to 40 with the map's slack) per distinct
/// n-gram per n: under 128 bytes per token at the defaults.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    min_n: usize,
    max_n: usize,
    tokens: Vec<u32>,
    /// `latest[n - min_n]`: an n-gram's hash to the end (exclusive) of its latest occurrence
    /// that ends before the sequence does. The n-gram ending at the end is added only when
    /// the next token arrives, so a lookup of the current suffix never finds itself.
    latest: Vec<HashMap<u64, usize>>,
}

impl NgramIndex {
    /// An empty index matching suffixes of `min_n..=max_n` tokens.
    ///
    /// # Panics
    /// If `min_n` is 0 or greater than `max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Self {
        assert!(
            min_n >= 1 && min_n <= max_n,
            "n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n {min_n} and max_n {max_n}"
        );
        Self {
            min_n,
            max_n,
            tokens: Vec::new(),
            latest: vec![HashMap::new(); max_n - min_n + 1],
        }
    }

    /// Appends one token: O(`max_n`).
    pub fn push(&mut self, token: u32) {
        // The suffixes ending at the current end become earlier occurrences now.
        let end = self.tokens.len();
        for (n, hash) in suffix_hashes(&self.tokens, self.min_n, self.max_n) {
            self.latest[n - self.min_n].insert(hash, end);
        }
        self.tokens.push(token);
    }

    /// Appends tokens in order.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &token in tokens {
            self.push(token);
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no token has been pushed.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The sequence so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Up to `max_draft` tokens that followed the latest earlier occurrence of the longest
    /// suffix (of `max_n` down to `min_n` tokens) that occurred before; they may run into the
    /// suffix itself (a period of a repeating pattern drafts the pattern). O(`max_n`) plus the
    /// copy.
    pub fn draft(&self, max_draft: usize) -> Draft {
        if max_draft == 0 {
            return Draft::default();
        }
        let len = self.tokens.len();
        let hashes: Vec<(usize, u64)> =
            suffix_hashes(&self.tokens, self.min_n, self.max_n).collect();
        for &(n, hash) in hashes.iter().rev() {
            let Some(&end) = self.latest[n - self.min_n].get(&hash) else {
                continue;
            };
            // A 64-bit hash can collide: only equal tokens count. (A collision overwrote the
            // true latest occurrence, so this n gives nothing; a shorter one may.)
            if self.tokens[end - n..end] != self.tokens[len - n..] {
                continue;
            }
            let stop = len.min(end + max_draft);
            return Draft {
                tokens: self.tokens[end..stop].to_vec(),
                match_len: n,
            };
        }
        Draft::default()
    }
}

/// The hashes of `tokens`' suffixes of `min_n..=max_n` tokens (those it is long enough for),
/// shortest first, each as `(n, hash)`: one pass backwards, each longer suffix's hash
/// extending the shorter one's.
pub(super) fn suffix_hashes(
    tokens: &[u32],
    min_n: usize,
    max_n: usize,
) -> impl Iterator<Item = (usize, u64)> + '_ {
    let mut hash = SEED;
    tokens
        .iter()
        .rev()
        .take(max_n)
        .enumerate()
        .filter_map(move |(i, &token)| {
            hash = mix(hash, token);
            (i + 1 >= min_n).then_some((i + 1, hash))
        })
}

/// The hash [`suffix_hashes`] gives `ngram` as a suffix.
pub(super) fn ngram_hash(ngram: &[u32]) -> u64 {
    ngram
        .iter()
        .rev()
        .fold(SEED, |hash, &token| mix(hash, token))
}

const SEED: u64 = 0x243f_6a88_85a3_08d3;

/// FxHash's step with a final multiply: cheap, and spreads a token into all 64 bits. The maps
/// hash these keys again with their own random keys, so chosen inputs cannot crowd a bucket;
/// at worst they collide here, which the equality check turns into a missed draft.
fn mix(hash: u64, token: u32) -> u64 {
    (hash.rotate_left(5) ^ u64::from(token)).wrapping_mul(0x517c_c1b7_2722_0a95)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(tokens: &[u32]) -> NgramIndex {
        let mut index = NgramIndex::new(MIN_N, MAX_N);
        index.extend(tokens);
        index
    }

    #[test]
    fn repeated_block_drafts_its_continuation() {
        let draft = index(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3]).draft(3);
        assert_eq!(draft.tokens, [4, 5, 6]);
        assert_eq!(draft.match_len, 3);
    }

    #[test]
    fn most_recent_occurrence_wins() {
        let draft = index(&[7, 8, 1, 9, 7, 8, 2, 0, 7, 8]).draft(2);
        assert_eq!(draft.tokens, [2, 0]);
        assert_eq!(draft.match_len, 2);
    }

    #[test]
    fn longest_match_wins_over_a_more_recent_shorter_one() {
        // [5, 7, 8] occurred first (followed by 1); [7, 8] alone more recently (followed by 2).
        let draft = index(&[5, 7, 8, 1, 9, 7, 8, 2, 5, 7, 8]).draft(1);
        assert_eq!(draft.tokens, [1]);
        assert_eq!(draft.match_len, 3);
    }

    #[test]
    fn no_match_drafts_nothing() {
        assert_eq!(index(&[1, 2, 3, 4, 5]).draft(4), Draft::default());
        // A single repeated token is below MIN_N.
        assert_eq!(index(&[1, 2, 3, 2]).draft(4), Draft::default());
        assert_eq!(index(&[]).draft(4), Draft::default());
    }

    #[test]
    fn max_draft_and_the_end_bound_the_draft() {
        let tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2];
        assert_eq!(index(&tokens).draft(2).tokens, [3, 4]);
        assert_eq!(index(&tokens).draft(0), Draft::default());
        // A repeating pattern drafts into the suffix itself, up to the current end.
        let draft = index(&[3, 4, 3, 4, 3, 4]).draft(8);
        assert_eq!(draft.tokens, [3, 4]);
        assert_eq!(draft.match_len, 4);
    }

    #[test]
    fn hashes_of_suffixes_match_those_of_ngrams() {
        let tokens = [9, 1, 4, 1, 5];
        let hashes: Vec<_> = suffix_hashes(&tokens, 2, 4).collect();
        let expected: Vec<_> = (2..=4)
            .map(|n| (n, ngram_hash(&tokens[tokens.len() - n..])))
            .collect();
        assert_eq!(hashes, expected);
        assert_eq!(suffix_hashes(&tokens[..1], 2, 4).count(), 0);
    }
}
