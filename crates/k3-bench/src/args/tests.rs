//! The decode bench's command line: its flag table, parsing, and docs/BENCHMARKS.md naming
//! every flag.

use super::*;

fn parsed(args: &[&str]) -> Result<Option<Args>, UsageError> {
    parse(&bench_flags(), args.iter().map(|a| a.to_string()))
}

/// `--help` lists every flag of the table, each on one line with its default.
#[test]
fn the_help_lists_every_flag() {
    let table = bench_flags();
    let help = k3_cli::render_help(&table, BINARY, "0.1.0");
    let names: Vec<String> = table.iter().map(Flag::long).collect();
    assert_eq!(k3_cli::flags_in_help(&help), names);
    for flag in &table {
        let line = help
            .lines()
            .find(|l| l.starts_with(&format!("  {} ", k3_cli::spelled(flag))))
            .unwrap_or_else(|| panic!("{} in {help}", flag.long()));
        assert!(
            line.contains(&format!("[default: {}]", flag.default)),
            "{line}"
        );
    }
    assert!(help.contains("--threads N") && help.contains("[default: 1]"));
}

/// docs/BENCHMARKS.md, where the bench's flags are told, names every flag the bench accepts,
/// and the table is consistent.
#[test]
fn the_benchmarks_page_names_every_flag() {
    let page = include_str!("../../../../docs/BENCHMARKS.md");
    let missing = k3_cli::flags_not_named_in(page, &bench_flags());
    assert!(
        missing.is_empty(),
        "docs/BENCHMARKS.md does not name {missing:?}"
    );
    assert_eq!(k3_cli::table_problems(&bench_flags()), Vec::<String>::new());
}

/// The flags scripts pass keep their names and meaning; nothing given keeps the defaults.
#[test]
fn the_flags_scripts_pass_keep_their_meaning() {
    let args = parsed(&[
        "--preset",
        "tiny",
        "--steps",
        "8",
        "--threads",
        "2",
        "--prefill",
        "4",
        "--prefill-chunk",
        "4",
        "--logits-out",
        "/tmp/l.f32",
        "--tokens",
        "1, 2,3",
        "--resident-trunk",
        "--profile",
        "--expert-placement",
        "home",
        "--numa-fake",
        "2",
        "--expert-cache",
        "3",
        "--kernel-tier",
        "scalar",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(args.preset, Preset::Tiny);
    assert_eq!(
        (args.steps, args.prefill, args.prefill_chunk),
        (8, Some(4), 4)
    );
    assert_eq!(args.tokens, Some(vec![1, 2, 3]));
    assert_eq!(args.logits_out, Some(PathBuf::from("/tmp/l.f32")));
    assert!(args.profile && args.engine.resident_trunk);
    assert_eq!(args.engine.pool.threads, Some(2));
    assert_eq!(args.engine.pool.fake_domains, Some(2));
    assert_eq!(args.engine.expert_placement, ExpertPlacement::Home);
    assert_eq!(args.engine.experts.cache_experts, Some(3));
    assert_eq!(args.engine.kernel_tier, Some(mxfp4_kernels::Tier::Scalar));

    let args = parsed(&["--model", "/m"]).unwrap().unwrap();
    assert_eq!(args.model, Some(PathBuf::from("/m")));
    assert_eq!(
        (args.steps, args.prefill_chunk, args.prefill),
        (16, 1, None)
    );
    assert_eq!(args.engine.pool.threads, Some(1), "one thread unless told");
    assert_eq!(args.engine.expert_placement, ExpertPlacement::Split);
    assert!(!args.profile && !args.engine.resident_trunk && args.tokens.is_none());
    assert_eq!(parsed(&[]).unwrap().unwrap().preset, Preset::K3_040B);
    assert!(parsed(&["--help"]).unwrap().is_none());

    let error = |args: &[&str]| parsed(args).unwrap_err().to_string();
    assert!(error(&["--steps", "2", "--steps", "3"]).contains("given twice"));
    assert!(error(&["--model", "/m", "--preset", "tiny"]).contains("cannot go with --model"));
    assert!(error(&["--tokens", "1,x"]).starts_with("--tokens must be"));
    assert!(error(&["--threads", "0"]).contains("at least 1"));
    assert!(error(&["--preset", "huge"]).starts_with("--preset must be one of"));
}

#[test]
fn the_presets_are_the_synth_presets() {
    let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
    assert_eq!(PRESETS, names);
}
