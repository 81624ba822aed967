//! The tokenizer against PyPI `tiktoken` 0.14.0 (frozen by `cargo xtask oracle-tiktoken`): the
//! same ids for every case, with special tokens allowed and not, and decode round trips.

use k3_model::tokenizer::{KIMI_PATTERN, Tokenizer};

use crate::frozen::{data_dir, read_frozen};

const COMMAND: &str = "cargo xtask oracle-tiktoken";

#[test]
fn encodes_like_tiktoken_on_the_frozen_vector() {
    let model = read_frozen("tiktoken", "tiktoken.model", COMMAND);
    read_frozen("tiktoken", "tokenizer_config.json", COMMAND);
    let vector: serde_json::Value =
        serde_json::from_slice(&read_frozen("tiktoken", "vector.json", COMMAND)).unwrap();
    assert_eq!(
        vector["pattern"], KIMI_PATTERN,
        "the oracle's split pattern (from docs/MODEL.md §10.1) differs from ours"
    );
    let digest: String = <sha2::Sha256 as sha2::Digest>::digest(&model)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(vector["vocab_sha256"], digest.as_str());
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let cases = vector["cases"].as_array().unwrap();
    assert!(cases.len() >= 600, "{} cases", cases.len());
    let mut with_specials = 0;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let allow = case["allow_special"].as_bool().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tokenizer.encode(text, allow);
        assert_eq!(
            got,
            want,
            "{:?} (specials {})",
            text.chars().take(80).collect::<String>(),
            if allow { "allowed" } else { "as text" }
        );
        assert_eq!(tokenizer.decode(&got), text, "round trip of {text:?}");
        if allow && want.iter().any(|&id| id >= 163_584) {
            with_specials += 1;
        }
    }
    assert!(
        with_specials > 20,
        "only {with_specials} cases hit a special token"
    );
    let end = tokenizer.special("<|end_of_msg|>");
    assert_eq!(end, Some(163_586));
    // Not allowed, a special's text is ordinary text: no special id comes out.
    assert!(
        tokenizer
            .encode("<|end_of_msg|>", false)
            .iter()
            .all(|&id| id < 163_584)
    );
    assert_eq!(tokenizer.encode("<|end_of_msg|>", true), [163_586]);
}

#[test]
fn bad_vocabulary_files_are_named() {
    let path = std::path::Path::new("vocab/tiktoken.model");
    let err = Tokenizer::new(path, "QQ== 0\n%%% 1\n", Default::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("tiktoken.model") && text.contains("line 2"),
        "{text}"
    );
    let dup = Tokenizer::new(path, "QQ== 0\nQQ== 1\n", Default::default()).unwrap_err();
    assert!(dup.to_string().contains("twice"), "{dup}");
}

/// A long single piece ("erer…", one regex match; Kimi's chunking cuts such runs only every
/// 25,000 characters) encodes in time near-linear in its length: one 24 kB piece may take at
/// most 8× the time of sixteen 1.5 kB pieces of the same text (~1.2× measured), where
/// tiktoken's quadratic merge loop takes ~16×. The two are timed interleaved, fastest of 15,
/// so load on the machine touches both alike. And 3.9 MB of it (about the body limit) is
/// encoded in seconds, not the minute the quadratic loop took.
#[test]
fn a_long_piece_encodes_in_near_linear_time() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let once = |text: &str| {
        let start = std::time::Instant::now();
        let ids = tokenizer.encode(text, false);
        let elapsed = start.elapsed().as_secs_f64();
        assert_eq!(tokenizer.decode(&ids), text);
        assert!(ids.len() >= tokenizer.min_tokens(text.len()));
        elapsed
    };
    let one_piece = "er".repeat(12_000);
    let pieces = format!("{} ", "er".repeat(750)).repeat(16);
    let (mut long, mut short) = (f64::MAX, f64::MAX);
    for _ in 0..15 {
        long = long.min(once(&one_piece));
        short = short.min(once(&pieces));
    }
    assert!(
        long < 8.0 * short.max(1e-5),
        "one 24 kB piece took {long:.5} s, sixteen 1.5 kB pieces {short:.5} s: worse than linear"
    );
    let text = "er".repeat(1_950_000);
    let start = std::time::Instant::now();
    let ids = tokenizer.encode(&text, false);
    let elapsed = start.elapsed().as_secs_f64();
    assert!(!ids.is_empty());
    eprintln!("3.9 MB of \"erer\" in {elapsed:.3} s");
    assert!(elapsed < 5.0, "3.9 MB of \"erer\" took {elapsed:.1} s");
}

/// The byte-length bound is a true lower bound on the token count.
#[test]
fn min_tokens_never_exceeds_the_count() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    for text in [
        "",
        "a",
        "hello world",
        "   ",
        "ererererer",
        "日本語のテキスト",
        "<|im_end|>x",
    ] {
        for allow in [false, true] {
            let n = tokenizer.encode(text, allow).len();
            assert!(tokenizer.min_tokens(text.len()) <= n, "{text:?}");
        }
    }
    assert!(tokenizer.min_tokens(3_900_000) > 3_900_000 / 1024);
}
