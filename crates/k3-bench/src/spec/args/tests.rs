//! The speculative-decoding bench's command line: its flag table, parsing, and
//! docs/BENCHMARKS.md naming every flag.

use k3_model::speculate::DEFAULT_MAX_DRAFT;

use super::*;

fn parsed(args: &[&str]) -> Result<Option<Args>, UsageError> {
    parse(&spec_flags(), args.iter().map(|a| a.to_string()))
}

/// docs/BENCHMARKS.md, where the bench is told, names every flag it accepts, and the table is
/// consistent.
#[test]
fn the_benchmarks_page_names_every_flag() {
    let page = include_str!("../../../../../docs/BENCHMARKS.md");
    let missing = k3_cli::flags_not_named_in(page, &spec_flags());
    assert!(
        missing.is_empty(),
        "docs/BENCHMARKS.md does not name {missing:?}"
    );
    assert_eq!(k3_cli::table_problems(&spec_flags()), Vec::<String>::new());
}

#[test]
fn the_defaults_are_what_the_help_says() {
    let args = parsed(&["--model", "/m"]).unwrap().unwrap();
    assert_eq!(args.model, PathBuf::from("/m"));
    assert_eq!(
        (args.tokens, args.reps, args.max_pass, args.pairs, args.seed),
        (64, 5, 16, 2, 0)
    );
    assert_eq!(args.rates, [0.0, 0.3, 0.5, 0.7, 0.9]);
    assert_eq!(args.max_draft, DEFAULT_MAX_DRAFT, "the engine's default");
    assert_eq!(args.bandwidth, 400e9);
    assert_eq!(args.engine.pool.threads, Some(2), "two threads unless told");
    let help = k3_cli::render_help(&spec_flags(), BINARY, "0.1.0");
    assert!(help.contains("--threads N") && help.contains("[default: 2]"));
    assert!(parsed(&["--help"]).unwrap().is_none());
}

#[test]
fn the_flags_keep_their_meaning_and_bad_values_are_named() {
    let args = parsed(&[
        "-m",
        "/m",
        "--tokens",
        "32",
        "--reps",
        "3",
        "--max-pass",
        "9",
        "--pairs",
        "2",
        "--rates",
        "0.5, 1",
        "--max-draft",
        "4",
        "--seed",
        "7",
        "--bandwidth-gbps",
        "250.5",
        "--threads",
        "1",
        "--resident-trunk",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        (
            args.tokens,
            args.reps,
            args.max_pass,
            args.pairs,
            args.max_draft
        ),
        (32, 3, 9, 2, 4)
    );
    assert_eq!((args.rates.as_slice(), args.seed), (&[0.5, 1.0][..], 7));
    assert_eq!(args.bandwidth, 250.5e9);
    assert_eq!(args.engine.pool.threads, Some(1));
    assert!(args.engine.resident_trunk);

    let error = |args: &[&str]| parsed(args).unwrap_err().to_string();
    assert!(error(&[]).contains("--model"));
    assert!(error(&["-m", "/m", "--rates", "0.5,1.5"]).starts_with("--rates must be"));
    assert!(error(&["-m", "/m", "--rates", "x"]).starts_with("--rates must be"));
    assert!(error(&["-m", "/m", "--tokens", "1"]).contains("at least 2 tokens"));
    assert!(error(&["-m", "/m", "--max-pass", "65"]).contains("at most 64"));
    assert!(error(&["-m", "/m", "--bandwidth-gbps", "0"]).contains("--bandwidth-gbps"));
}
