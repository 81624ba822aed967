//! Tokenizer files for synthetic checkpoints: `tiktoken.model` (one base64 token and its rank
//! per line) with a small byte-level BPE learned from built-in text, and
//! `tokenizer_config.json` with K3's special-token names in the top 256 ids, at the same
//! offsets as the release (`[BOS]` first, `<|end_of_msg|>` third, `[PAD]` last).

use serde_json::{Value, json};

/// Special slots at the top of the vocabulary (docs/MODEL.md §10.1).
pub const SPECIAL_SLOTS: usize = 256;

/// K3's named special tokens and their offsets from the first special id (163584 in K3).
pub const NAMED_SPECIALS: [(&str, usize); 16] = [
    ("[BOS]", 0),
    ("[EOS]", 1),
    ("<|end_of_msg|>", 2),
    ("<|open|>", 3),
    ("<|close|>", 4),
    ("<|sep|>", 5),
    ("[start_header_id]", 6),
    ("[end_header_id]", 7),
    ("[EOT]", 9),
    ("<|media_begin|>", 18),
    ("<|media_content|>", 19),
    ("<|media_end|>", 20),
    ("<|media_pad|>", 21),
    ("<osagent_mode>", 65),
    ("[UNK]", 254),
    ("[PAD]", 255),
];

/// Text the BPE is learned from: original prose about this project, varied enough to give a
/// few hundred merges (words, spaces, digits, punctuation, some non-ASCII).
const CORPUS: &str = "\
The engine reads every weight once per token, so the speed of a decode step is the speed of \
memory. A kernel that waits on arithmetic while bytes sit idle is a kernel to rewrite. We \
measure each one against a plain sum over a buffer far larger than the cache, in the same run, \
and we write the ratio down. Numbers without their reference mean little on a shared machine.\n\
Experts are small matrices of four-bit codes with one eight-bit scale for every thirty-two \
values. The codes stand for zero, one half, one, one and a half, two, three, four and six, with \
a sign. A scale is a power of two. Their product is exact in single precision, which is why the \
exact tier can promise to differ from the scalar oracle only in the order of its sums.\n\
Routing picks sixteen of eight hundred and ninety-six experts for each layer and token. The \
router's bias steers the choice but never the weights; the weights come from the raw sigmoid \
scores, renormalised, and scaled. Attention alternates between a recurrent delta rule and a \
latent attention over the whole context, three to one, with the last two layers both latent.\n\
Tests come first: 1, 2, 3, 10, 25, 100, 2048, 4096, 65536. Errors name the file, the tensor, \
what was expected and what was found. Nothing panics on a bad file. Logits do not depend on \
how many threads ran, on how the rows were split, or on which experts happened to be cached.\n\
Le moteur lit chaque poids une fois par jeton. Der Speicher bestimmt das Tempo. 記憶體的頻寬決定速度。\n";

/// A byte-level BPE: token byte strings in rank order (the 256 single bytes first).
pub fn learn_bpe(max_tokens: usize) -> Vec<Vec<u8>> {
    let mut vocab: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    // Chunks: a run of letters/digits with its leading space, or a single other character.
    let mut chunks: Vec<(Vec<u32>, usize)> = Vec::new();
    let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut current = String::new();
    let mut flush = |current: &mut String| {
        if !current.is_empty() {
            *counts.entry(std::mem::take(current)).or_default() += 1;
        }
    };
    for c in CORPUS.chars() {
        if c.is_alphanumeric() || c == '\'' {
            current.push(c); // a word, possibly after its leading space
        } else if c == ' ' {
            flush(&mut current);
            current.push(' ');
        } else {
            flush(&mut current);
            current.push(c);
            flush(&mut current);
        }
    }
    flush(&mut current);
    let mut sorted: Vec<(String, usize)> = counts.into_iter().collect();
    sorted.sort();
    for (chunk, count) in sorted {
        chunks.push((chunk.bytes().map(u32::from).collect(), count));
    }
    while vocab.len() < max_tokens {
        let mut pairs: std::collections::BTreeMap<(u32, u32), usize> =
            std::collections::BTreeMap::new();
        for (ids, count) in &chunks {
            for w in ids.windows(2) {
                *pairs.entry((w[0], w[1])).or_default() += count;
            }
        }
        // Most frequent pair; ties to the lowest ranks (BTreeMap order) for determinism.
        let Some((&(a, b), &best)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0)))
        else {
            break;
        };
        if best < 2 {
            break;
        }
        let new = vocab.len() as u32;
        let mut bytes = vocab[a as usize].clone();
        bytes.extend_from_slice(&vocab[b as usize]);
        vocab.push(bytes);
        for (ids, _) in &mut chunks {
            let mut merged = Vec::with_capacity(ids.len());
            let mut i = 0;
            while i < ids.len() {
                if i + 1 < ids.len() && ids[i] == a && ids[i + 1] == b {
                    merged.push(new);
                    i += 2;
                } else {
                    merged.push(ids[i]);
                    i += 1;
                }
            }
            *ids = merged;
        }
    }
    vocab
}

/// `tiktoken.model`: `base64(token) rank` per line, ranks = ids.
pub fn tiktoken_model(vocab: &[Vec<u8>]) -> String {
    vocab
        .iter()
        .enumerate()
        .map(|(rank, token)| format!("{} {rank}\n", base64(token)))
        .collect()
}

/// `tokenizer_config.json` for a vocabulary of `vocab_size` ids (specials at the top).
pub fn tokenizer_config(vocab_size: usize) -> Value {
    let base = vocab_size - SPECIAL_SLOTS;
    let mut added = serde_json::Map::new();
    for k in 0..SPECIAL_SLOTS {
        let name = NAMED_SPECIALS
            .iter()
            .find(|(_, offset)| *offset == k)
            .map_or_else(
                || format!("<|reserved_token_{k}|>"),
                |(name, _)| (*name).to_owned(),
            );
        added.insert(
            (base + k).to_string(),
            json!({ "content": name, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true }),
        );
    }
    json!({
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1_048_576,
        "tokenizer_class": "TikTokenTokenizer",
    })
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want);
        }
    }

    #[test]
    fn bpe_learns_merges_deterministically() {
        let vocab = learn_bpe(768);
        assert!(
            vocab.len() > 256 + 100,
            "only {} tokens learned",
            vocab.len()
        );
        assert_eq!(vocab, learn_bpe(768));
        let mut unique = vocab.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), vocab.len(), "tokens are unique");
        assert!(
            vocab.iter().any(|t| t == b" the"),
            "a frequent word is a token"
        );
    }
}
