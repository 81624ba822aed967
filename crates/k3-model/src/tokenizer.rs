//! The K3 tokenizer (docs/MODEL.md §10.1): tiktoken's rank-based byte-pair encoding over
//! `tiktoken.model`, the Kimi pre-tokenizer regex, and the special tokens of
//! `tokenizer_config.json`, recognised only where the caller allows them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use expert_store::file::{ReadFileError, read_regular_text};

/// The Kimi pre-tokenizer split pattern, alternatives in order (docs/MODEL.md §10.1; the `(?!\S)`
/// lookahead is why this is `fancy_regex`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Text is encoded in pieces of at most this many characters (as Kimi's tokenizer does).
const MAX_CHARS: usize = 400_000;
/// ... and runs of whitespace or of non-whitespace longer than this are cut.
const MAX_RUN: usize = 25_000;

/// The most bytes `tiktoken.model` may hold. The release's 163,840 ranks take about 2 MB
/// (base64 token, space, rank: a dozen bytes a line); this leaves room for a vocabulary many
/// times larger, and a file that is no vocabulary is not read whole.
pub const MAX_TIKTOKEN_BYTES: u64 = 64 << 20;

/// The most bytes `tokenizer_config.json` may hold: the release's is tens of KB (special
/// tokens and a chat template), so 16 MiB is generous.
pub const MAX_TOKENIZER_CONFIG_BYTES: u64 = 16 << 20;

/// Errors loading a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file is not a regular file (a FIFO, a device, ...), is over its cap, or cannot be
    /// read.
    #[error(transparent)]
    Read(#[from] ReadFileError),
    /// A file cannot be read, or is wrong as a whole (`tokenizer_config.json` not JSON or
    /// without `added_tokens_decoder`, two tokens of `tiktoken.model` sharing a rank).
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A line of `tiktoken.model` is not `base64 rank`, or repeats a token.
    #[error("{path}: line {line}: {reason}")]
    Line {
        /// The file.
        path: PathBuf,
        /// The line, 1-based.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// A loaded tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    ranks: HashMap<Vec<u8>, u32>,
    decoder: HashMap<u32, Vec<u8>>,
    specials: HashMap<String, u32>,
    special_names: HashMap<u32, String>,
    /// Special-token strings, longest first (so a longer one wins where two start together).
    special_order: Vec<String>,
    pattern: fancy_regex::Regex,
    /// The most bytes one token stands for (an ordinary token's bytes or a special's name).
    max_token_bytes: usize,
    /// Whether every single byte is a token, so that no input byte is ever dropped.
    byte_level: bool,
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a checkpoint directory; a
    /// FIFO, a device or a file over its cap ([`MAX_TIKTOKEN_BYTES`],
    /// [`MAX_TOKENIZER_CONFIG_BYTES`]) in their place is refused without reading it.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let model = dir.join("tiktoken.model");
        let config = dir.join("tokenizer_config.json");
        let config_text = read_regular_text(&config, MAX_TOKENIZER_CONFIG_BYTES)?;
        let specials = parse_specials(&config, &config_text)?;
        Self::new(
            &model,
            &read_regular_text(&model, MAX_TIKTOKEN_BYTES)?,
            specials,
        )
    }

    /// From the text of a `tiktoken.model` (`path` names it in errors) and special tokens.
    pub fn new(
        path: &Path,
        model: &str,
        specials: HashMap<String, u32>,
    ) -> Result<Self, TokenizerError> {
        let mut ranks = HashMap::new();
        for (i, line) in model.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |reason: String| TokenizerError::Line {
                path: path.to_owned(),
                line: i + 1,
                reason,
            };
            let (token, rank) = line
                .split_once(' ')
                .ok_or_else(|| bad("expected `base64 rank`".into()))?;
            let bytes = base64_decode(token).ok_or_else(|| bad(format!("bad base64 {token:?}")))?;
            let rank: u32 = rank
                .trim()
                .parse()
                .map_err(|_| bad(format!("bad rank {rank:?}")))?;
            if ranks.insert(bytes, rank).is_some() {
                return Err(bad("a token listed twice".into()));
            }
        }
        let decoder: HashMap<u32, Vec<u8>> = ranks.iter().map(|(b, &r)| (r, b.clone())).collect();
        let refuse = |reason: String| {
            Err(TokenizerError::File {
                path: path.to_owned(),
                reason,
            })
        };
        if decoder.len() != ranks.len() {
            return refuse("two tokens share a rank".into());
        }
        // An empty file loaded, and every prompt's text then encoded to nothing: the model
        // answered a prompt it never saw.
        if ranks.is_empty() {
            return refuse("no tokens: the file lists no `base64 rank` line".into());
        }
        // A special token's id that is also a text token's rank decodes two ways.
        let mut shared: Vec<(&String, u32)> = specials
            .iter()
            .filter(|&(_, id)| decoder.contains_key(id))
            .map(|(name, &id)| (name, id))
            .collect();
        shared.sort_unstable_by_key(|&(_, id)| id);
        if let Some(&(name, id)) = shared.first() {
            return refuse(format!(
                "the special token {name} (tokenizer_config.json) has id {id}, which is also a \
                 text token's rank here"
            ));
        }
        let mut special_order: Vec<String> = specials.keys().cloned().collect();
        special_order.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        let max_token_bytes = ranks
            .keys()
            .map(Vec::len)
            .chain(special_order.first().map(String::len))
            .max()
            .unwrap_or(0);
        let byte_level = (0..=255u8).all(|b| ranks.contains_key(&[b][..]));
        Ok(Self {
            max_token_bytes,
            byte_level,
            special_names: specials.iter().map(|(s, &id)| (id, s.clone())).collect(),
            ranks,
            decoder,
            specials,
            special_order,
            pattern: fancy_regex::Regex::new(KIMI_PATTERN).expect("the Kimi pattern compiles"),
        })
    }

    /// The id of a special token, e.g. `<|end_of_msg|>`.
    pub fn special(&self, name: &str) -> Option<u32> {
        self.specials.get(name).copied()
    }

    /// Encodes `text`. With `allow_special`, special-token strings in it become their ids;
    /// otherwise they are ordinary text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if !allow_special || self.specials.is_empty() {
            self.encode_ordinary(text, &mut out);
            return out;
        }
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special in `rest` (longest at equal starts).
            let found = self
                .special_order
                .iter()
                .filter_map(|s| rest.find(s.as_str()).map(|at| (at, s)))
                .min_by_key(|&(at, s)| (at, std::cmp::Reverse(s.len())));
            match found {
                Some((at, special)) => {
                    self.encode_ordinary(&rest[..at], &mut out);
                    out.push(self.specials[special]);
                    rest = &rest[at + special.len()..];
                }
                None => {
                    self.encode_ordinary(rest, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// A lower bound on the number of tokens any text of `bytes` bytes encodes to, cheap
    /// enough to refuse an over-long prompt before tokenizing it: every byte of the text
    /// belongs to exactly one token and no token stands for more than the longest token's
    /// bytes. (0 for a vocabulary without every single byte, which may drop bytes.)
    pub fn min_tokens(&self, bytes: usize) -> usize {
        if self.byte_level && self.max_token_bytes > 0 {
            bytes.div_ceil(self.max_token_bytes)
        } else {
            0
        }
    }

    /// Decodes ids to bytes (special tokens to their names); unknown ids are skipped.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for id in ids {
            if let Some(bytes) = self.decoder.get(id) {
                out.extend_from_slice(bytes);
            } else if let Some(name) = self.special_names.get(id) {
                out.extend_from_slice(name.as_bytes());
            }
        }
        out
    }

    /// Decodes ids to text (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        for piece in split_long(text) {
            for m in self.pattern.find_iter(piece) {
                // The pattern has no construct that can fail at run time on valid UTF-8 (its
                // one lookahead is a single character).
                let Ok(m) = m else { continue };
                let bytes = m.as_str().as_bytes();
                match self.ranks.get(bytes) {
                    Some(&rank) => out.push(rank),
                    None => byte_pair_encode(bytes, &self.ranks, out),
                }
            }
        }
    }
}

/// Kimi's chunking: at most `MAX_CHARS` characters per piece, and runs of whitespace or of
/// non-whitespace longer than `MAX_RUN` cut (Python's `str.isspace`, which `char::is_whitespace`
/// matches for every character the split regexes treat as space).
fn split_long(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut chars = 0;
    let mut run = 0;
    let mut run_space = None;
    for (i, c) in text.char_indices() {
        let space = c.is_whitespace();
        if run_space == Some(space) {
            run += 1;
        } else {
            run = 1;
            run_space = Some(space);
        }
        if chars == MAX_CHARS || run > MAX_RUN {
            pieces.push(&text[start..i]);
            start = i;
            chars = 0;
            run = 1;
        }
        chars += 1;
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// tiktoken's merge: start from single bytes and repeatedly merge the adjacent pair whose
/// concatenation has the lowest rank (the leftmost on ties) until no pair is a token.
///
/// The same merges as tiktoken's quadratic loop, in O(n log n) for a piece of n bytes: the
/// candidate pairs sit in a min-heap keyed by (rank, start byte) — start bytes increase along
/// the piece, so that is "leftmost on ties" — and the parts form a linked list. A heap entry
/// made stale by a neighbour's merge is recognised by the end it recorded and skipped. So a
/// long piece (a megabyte of "erer...") costs no more per byte than a short one.
fn byte_pair_encode(piece: &[u8], ranks: &HashMap<Vec<u8>, u32>, out: &mut Vec<u32>) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    const NONE: usize = usize::MAX;
    let n = piece.len();
    if n == 0 {
        return;
    }
    // Part i starts at byte i while alive; end[i] is its end, prev[i] its left neighbour.
    let mut end: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    let rank = |start: usize, stop: usize| ranks.get(&piece[start..stop]).copied();
    // (rank, left part's start, the right part's end when pushed).
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
    for i in 0..n.saturating_sub(1) {
        if let Some(r) = rank(i, i + 2) {
            heap.push(Reverse((r, i, i + 2)));
        }
    }
    while let Some(Reverse((_, left, pair_end))) = heap.pop() {
        // Stale unless the left part is alive and still followed by the same right part.
        if !alive[left] || end[left] >= n || end[end[left]] != pair_end {
            continue;
        }
        let right = end[left];
        alive[right] = false;
        end[left] = pair_end;
        if pair_end < n {
            prev[pair_end] = left;
            if let Some(r) = rank(left, end[pair_end]) {
                heap.push(Reverse((r, left, end[pair_end])));
            }
        }
        let before = prev[left];
        if before != NONE
            && let Some(r) = rank(before, pair_end)
        {
            heap.push(Reverse((r, before, pair_end)));
        }
    }
    let mut start = 0;
    while start < n {
        // Every single byte is a token in a byte-level vocabulary; a vocabulary without it
        // cannot encode this piece, and the byte is dropped rather than invented.
        if let Some(r) = rank(start, end[start]) {
            out.push(r);
        }
        start = end[start];
    }
}

/// `added_tokens_decoder` of `tokenizer_config.json`: `{"163584": {"content": "[BOS]", ...}}`.
fn parse_specials(path: &Path, text: &str) -> Result<HashMap<String, u32>, TokenizerError> {
    let fail = |reason: String| TokenizerError::File {
        path: path.to_owned(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| fail(format!("not JSON: {e}")))?;
    let added = json["added_tokens_decoder"]
        .as_object()
        .ok_or_else(|| fail("no added_tokens_decoder object".into()))?;
    added
        .iter()
        .map(|(id, token)| {
            let id: u32 = id
                .parse()
                .map_err(|_| fail(format!("token id {id:?} is not a number")))?;
            let content = token["content"]
                .as_str()
                .ok_or_else(|| fail(format!("token {id} has no content")))?;
            Ok((content.to_owned(), id))
        })
        .collect()
}

/// Standard base64 (with padding) to bytes; `None` when malformed.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = text.trim().as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for quad in bytes.chunks(4) {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = n << 6 | value(c)?;
        }
        n <<= 6 * pad as u32;
        let group = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&group[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use k3_testkit::Rng;

    use super::*;

    /// A FIFO or a link to `/dev/zero` in place of either file: refused at once, naming the
    /// file and what it is, never read.
    #[test]
    fn a_fifo_or_a_device_in_place_of_a_file_is_refused_at_once() {
        for file in ["tiktoken.model", "tokenizer_config.json"] {
            for special in ["fifo", "/dev/zero"] {
                let dir = k3_testkit::Scratch::new("tokenizer-specials");
                let tokenizer_config = r#"{"added_tokens_decoder": {}}"#;
                std::fs::write(dir.path().join("tokenizer_config.json"), tokenizer_config).unwrap();
                std::fs::write(dir.path().join("tiktoken.model"), "YQ== 0\n").unwrap();
                let path = dir.path().join(file);
                let kind = k3_testkit::replace_with_special(&path, special);
                let case = format!("{file} as {special}");
                let from = dir.path().to_owned();
                let loaded =
                    k3_testkit::promptly(&case, std::time::Duration::from_secs(5), move || {
                        Tokenizer::from_dir(&from).map(|_| ())
                    });
                let e = loaded.expect_err(&case);
                assert!(matches!(e, TokenizerError::Read(_)), "{case}: {e:?}");
                assert_eq!(
                    e.to_string(),
                    format!("{} is {kind}, not a regular file", path.display())
                );
            }
        }
    }

    /// An empty `tiktoken.model` is refused (it used to load, and every prompt's text then
    /// encoded to nothing), and so is a special token whose id is a text token's rank.
    #[test]
    fn an_empty_vocabulary_or_a_special_id_on_a_rank_is_refused() {
        let path = Path::new("tiktoken.model");
        let specials: HashMap<String, u32> = [("<|end_of_msg|>".to_owned(), 2)].into();
        for empty in ["", "\n\n"] {
            let err = Tokenizer::new(path, empty, specials.clone()).unwrap_err();
            assert!(err.to_string().contains("no tokens"), "{err}");
        }
        // "YQ==" is "a", "Yg==" "b": ranks 0 and 1; the special at 2 is clear of them.
        assert!(Tokenizer::new(path, "YQ== 0\nYg== 1\n", specials.clone()).is_ok());
        let err = Tokenizer::new(path, "YQ== 0\nYg== 2\n", specials).unwrap_err();
        assert!(
            err.to_string().contains("<|end_of_msg|>") && err.to_string().contains("id 2"),
            "{err}"
        );
    }

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(base64_decode("AA==").unwrap(), [0]);
        assert_eq!(base64_decode("IGE=").unwrap(), b" a");
        assert_eq!(base64_decode("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode("a"), None);
        assert_eq!(base64_decode("a$=="), None);
    }

    #[test]
    fn long_runs_are_cut_like_kimi() {
        let text = format!("ab{}cd", " ".repeat(MAX_RUN + 5));
        let pieces = split_long(&text);
        assert_eq!(pieces.concat(), text);
        assert!(pieces.len() >= 2);
        assert_eq!(split_long("short text"), ["short text"]);
    }

    #[test]
    fn merges_take_the_lowest_rank_first() {
        let encode = |pairs: &[(&[u8], u32)]| {
            let mut ranks: HashMap<Vec<u8>, u32> = [(&b"a"[..], 0), (b"b", 1), (b"c", 2)]
                .iter()
                .map(|(t, r)| (t.to_vec(), *r))
                .collect();
            ranks.extend(pairs.iter().map(|(t, r)| (t.to_vec(), *r)));
            let mut out = Vec::new();
            byte_pair_encode(b"abc", &ranks, &mut out);
            out
        };
        assert_eq!(encode(&[(b"ab", 3), (b"bc", 4)]), [3, 2]); // ab first
        assert_eq!(encode(&[(b"ab", 4), (b"bc", 3)]), [0, 3]); // bc first
        assert_eq!(encode(&[(b"ab", 4), (b"bc", 3), (b"abc", 5)]), [5]); // then a+bc
        assert_eq!(encode(&[]), [0, 1, 2]);
    }

    /// The heap merge against tiktoken's quadratic loop (kept here as the oracle) on random
    /// pieces over a small alphabet with a vocabulary of random merges, so ties, stale heap
    /// entries and chains of merges all occur.
    #[test]
    fn the_heap_merge_equals_the_quadratic_loop() {
        fn quadratic(piece: &[u8], ranks: &HashMap<Vec<u8>, u32>) -> Vec<u32> {
            let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
            loop {
                let best = (0..parts.len().saturating_sub(1))
                    .filter_map(|i| {
                        let joined = [parts[i].clone(), parts[i + 1].clone()].concat();
                        ranks.get(&joined).map(|&r| (r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let right = parts.remove(i + 1);
                parts[i].extend(right);
            }
            parts.iter().filter_map(|p| ranks.get(p).copied()).collect()
        }
        let mut rng = Rng::new(0x1234_5678_9abc_def0);
        for case in 0..200 {
            let mut ranks: HashMap<Vec<u8>, u32> =
                (b'a'..=b'd').map(|b| (vec![b], u32::from(b))).collect();
            // Random multi-byte tokens, some with equal-rank-free but overlapping forms.
            for r in 0..40u32 {
                let len = 2 + rng.below(4);
                let token: Vec<u8> = (0..len).map(|_| b'a' + rng.below(4) as u8).collect();
                ranks.entry(token).or_insert(1000 + r);
            }
            let len = rng.below(60);
            let piece: Vec<u8> = (0..len).map(|_| b'a' + rng.below(4) as u8).collect();
            let mut got = Vec::new();
            byte_pair_encode(&piece, &ranks, &mut got);
            assert_eq!(got, quadratic(&piece, &ranks), "case {case}: {piece:?}");
        }
    }
}
