//! The parser, the help and the library flags, on a small table of every kind plus the
//! library flags; the reading of a docs page's first example.

use super::*;
use k3_model::builder::EngineOptions;

const TEST: Group = Group::new("Test");

/// The library flags and one flag of each other kind.
fn table() -> Vec<Flag> {
    let mut table = vec![
        Flag::value("model", "DIR", Kind::Text, "none", TEST, "a directory").aliases(&["-m"]),
        Flag::value("port", "PORT", Kind::Port, "8000", TEST, "a port"),
        Flag::value("ctx", "N", Kind::Count, "4096", TEST, "a count")
            .aliases(&["-c", "--ctx-size"]),
        Flag::value("seed", "S", Kind::Whole, "0", TEST, "a whole number"),
        Flag::value("wait-s", "S", Kind::Seconds, "10", TEST, "seconds"),
        Flag::value(
            "temperature",
            "T",
            Kind::Number { min: 0.0, max: 2.0 },
            "1",
            TEST,
            "a number",
        ),
        Flag::value(
            "template",
            "NAME",
            Kind::Choice(&["kimi-k3"]),
            "kimi-k3",
            TEST,
            "one word",
        ),
        Flag::value(
            "effort",
            "E",
            Kind::Choice(&["low", "high", "max"]),
            "max",
            TEST,
            "words",
        ),
        Flag::value("name", "NAME", Kind::Text, "none", TEST, "repeats").repeatable(),
        Flag::value(
            "key",
            "KEY",
            Kind::Text,
            "none",
            TEST,
            "from the environment",
        )
        .env("K3_KEY"),
        Flag::switch("serve", TEST, "a switch"),
    ];
    table.extend(library_flags());
    table
}

fn run(args: &[&str]) -> Result<Parsed, UsageError> {
    match parse(&table(), args.iter().map(|a| a.to_string()))? {
        Outcome::Run(parsed) => Ok(parsed),
        other => panic!("{args:?} parsed as {other:?}"),
    }
}

fn error(args: &[&str]) -> String {
    let message = run(args).expect_err("should be refused").to_string();
    assert!(!message.contains('\n'), "{message:?} is one line");
    message
}

#[test]
fn both_value_forms_and_typed_getters() {
    let p = run(&["--port=8001", "--model", "x", "--temperature=0.7"]).unwrap();
    assert_eq!(p.get_u16("port").unwrap(), Some(8001));
    assert_eq!(p.get_str("model"), Some("x"));
    assert_eq!(p.get_f32("temperature").unwrap(), Some(0.7));
    assert_eq!(p.get_usize("ctx").unwrap(), None);
    let p = run(&["--serve", "--model=a=b"]).unwrap();
    assert!(p.switch("serve") && !p.switch("numa"));
    assert_eq!(p.get_str("model"), Some("a=b"), "only the first `=` splits");
    assert_eq!(
        run(&["--model", "-x"]).unwrap().get_str("model"),
        Some("-x")
    );
    assert_eq!(
        run(&["--model", ""]).unwrap().iter().collect::<Vec<_>>(),
        [("model", Some(""))]
    );
    let p = run(&["-m", "/m", "-t", "8", "--ctx-size", "8192"]).unwrap();
    assert_eq!(p.get_str("model"), Some("/m"));
    assert_eq!(p.get_usize("threads").unwrap(), Some(8));
    assert_eq!(
        run(&["-c=512"]).unwrap().get_usize("ctx").unwrap(),
        Some(512)
    );
}

#[test]
fn mistakes_are_one_line() {
    assert_eq!(error(&["--serve", "--port"]), "--port needs a value (PORT)");
    assert_eq!(
        error(&["-m", "--serve"]),
        "--model needs a value (DIR), got the flag --serve"
    );
    assert_eq!(
        error(&["--thread", "4"]),
        "unknown flag --thread (did you mean --threads?); see --help"
    );
    assert_eq!(
        error(&["--frobnicate"]),
        "unknown flag --frobnicate; see --help"
    );
    assert!(error(&["serve"]).starts_with("unexpected argument \"serve\""));
    assert_eq!(
        error(&["--serve=yes"]),
        "--serve is a switch and takes no value, got \"yes\""
    );
    assert_eq!(
        error(&["--port", "1", "--port=2"]),
        "--port was given twice (\"1\", then \"2\"); it takes one value"
    );
    assert_eq!(
        run(&["--name", "a", "--name=b"]).unwrap().all("name"),
        ["a", "b"]
    );
    assert_eq!(run(&["--serve", "--serve"]).unwrap().iter().count(), 1);
}

#[test]
fn values_are_checked_against_their_kind() {
    assert_eq!(
        error(&["--temperature", "-1"]),
        "--temperature must be a number in [0, 2], got \"-1\""
    );
    assert!(error(&["--temperature=nan"]).contains("\"nan\""));
    assert_eq!(
        error(&["--port=0"]),
        "--port must be a port number in [1, 65535], got \"0\""
    );
    assert_eq!(
        error(&["--ctx", "0"]),
        "--ctx must be a count of at least 1, got \"0\""
    );
    assert!(error(&["--seed=-3"]).starts_with("--seed must be a whole number"));
    assert!(error(&["--expert-cache-gb=-1"]).contains("at least 0"));
    assert_eq!(
        error(&["--wait-s", "0"]),
        "--wait-s must be a positive number of seconds below 1e9, got \"0\""
    );
    assert_eq!(
        error(&["--template", "chatml"]),
        "--template must be kimi-k3 (the only one there is), got \"chatml\""
    );
    assert_eq!(
        error(&["--effort=maxx"]),
        "--effort must be one of low, high, max; did you mean max?, got \"maxx\""
    );
    assert!(error(&["--kernel-tier", "sse2"]).starts_with("--kernel-tier must be one of"));
}

#[test]
fn help_version_and_environment() {
    let outcome = |args: &[&str]| parse(&table(), args.iter().map(|a| a.to_string()));
    assert_eq!(outcome(&["-h"]), Ok(Outcome::Help));
    assert_eq!(outcome(&["--serve", "--help"]), Ok(Outcome::Help));
    assert_eq!(outcome(&["-V"]), Ok(Outcome::Version));
    assert_eq!(render_version("k3", "0.1.0"), "k3 0.1.0\n");
    let env = |var: &str| (var == "K3_KEY").then(|| "from-env".to_string());
    let mut p = run(&[]).unwrap();
    p.fill_from_env(&table(), env).unwrap();
    assert_eq!(p.get_str("key"), Some("from-env"));
    let mut p = run(&["--key", "flag"]).unwrap();
    p.fill_from_env(&table(), env).unwrap();
    assert_eq!(p.all("key"), ["flag"]);
    let mut p = run(&[]).unwrap();
    p.fill_from_env(&table(), |_| Some(String::new())).unwrap();
    assert!(!p.has("key"), "an empty variable is unset");
}

/// The help lists every flag once, on one line with its default, help and aliases, groups in
/// table order; [`flags_in_help`] reads the same flags back.
#[test]
fn the_help_lists_the_table() {
    let table = table();
    let help = render_help(&table, "k3", "0.1.0");
    let listed = flags_in_help(&help);
    let names: Vec<String> = table.iter().map(Flag::long).collect();
    assert_eq!(listed, names);
    for flag in &table {
        let line = help
            .lines()
            .find(|l| l.starts_with(&format!("  {} ", spelled(flag))))
            .unwrap_or_else(|| panic!("{} in {help}", flag.long()));
        assert!(
            line.contains(&format!("[default: {}]", flag.default)),
            "{line}"
        );
        assert!(line.contains(flag.help), "{line}");
        assert!(flag.aliases.iter().all(|a| line.contains(a)), "{line}");
    }
    let titles: Vec<&str> = groups(&table).iter().map(|g| g.title).collect();
    assert_eq!(titles, ["Test", "Performance", "Experts", "NUMA"]);
    let at = |title: &str| help.find(&format!("\n{title}:\n")).unwrap();
    assert!(at("Test") < at("Performance") && at("Experts") < at("NUMA"));
    assert!(help.contains("[env: K3_KEY]") && help.contains("[repeatable]"));
}

#[test]
fn the_library_table_is_consistent() {
    assert_eq!(table_problems(&table()), Vec::<String>::new());
    let tiers: Vec<&str> = mxfp4_kernels::Tier::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(library::KERNEL_TIERS, tiers);
}

/// The checks find what they look for.
#[test]
fn the_table_checks_find_their_problems() {
    let bad = vec![
        Flag::switch("numa", TEST, "Capitalised."),
        Flag {
            value_name: "",
            ..Flag::value("threads", "N", Kind::Count, "", TEST, "no value name").aliases(&["t"])
        },
        Flag::switch("fast", TEST, "ok").aliases(&["--numa"]),
    ];
    let problems = table_problems(&bad);
    for expected in [
        "--numa names two flags",
        "--numa: help \"Capitalised.\" is empty or ends with '.'",
        "--numa: help \"Capitalised.\" is capitalised",
        "--threads: no default",
        "--threads: value name \"\"",
        "--threads: alias \"t\" without its dashes",
    ] {
        assert!(
            problems.iter().any(|p| p == expected),
            "{expected} in {problems:?}"
        );
    }
    assert_eq!(problems.len(), 6, "{problems:?}");
    let doc = "use `--numa-fake N` or -t/--threads, [--steps N]";
    let table = [
        Flag::switch("numa", TEST, "a"),
        Flag::value("numa-fake", "N", Kind::Count, "1", TEST, "b"),
        Flag::value("threads", "N", Kind::Count, "1", TEST, "c"),
        Flag::value("steps", "N", Kind::Count, "1", TEST, "d"),
        Flag::switch("profile", TEST, "e"),
    ];
    assert_eq!(flags_not_named_in(doc, &table), ["--numa", "--profile"]);
}

#[test]
fn library_flags_reach_the_engine_options() {
    let p = run(&[
        "-t",
        "3",
        "--numa-fake=2",
        "--numa-threads",
        "2",
        "--numa",
        "--hyperthreads",
        "--expert-cache-gb",
        "1.5",
        "--mlock",
        "--preload-experts",
        "--no-usage-cache",
        "--usage-file",
        "/u.json",
        "--expert-policy",
        "lru",
        "--io-threads",
        "4",
        "--resident-trunk",
        "--memory-gb",
        "3.5",
        "--kernel-tier",
        "scalar",
        "--port",
        "9",
    ])
    .unwrap();
    let mut options = EngineOptions::default();
    apply_library_flags(&p, &mut options).unwrap();
    let pool = options.pool;
    assert_eq!(
        (pool.threads, pool.fake_domains, pool.threads_per_domain),
        (Some(3), Some(2), Some(2))
    );
    assert!(pool.numa && pool.hyperthreads);
    let experts = &options.experts;
    assert_eq!(experts.cache_bytes, Some(1_500_000_000));
    assert_eq!(experts.cache_experts, None);
    assert!(experts.mlock && experts.preload && !experts.usage_cache);
    assert_eq!(
        experts.usage_file.as_deref(),
        Some(std::path::Path::new("/u.json"))
    );
    assert_eq!(experts.policy(), expert_store::Policy::Lru);
    assert_eq!(experts.io_threads, 4);
    assert!(options.resident_trunk);
    assert_eq!(options.memory_bytes, Some(3_500_000_000));
    assert_eq!(options.kernel_tier, Some(mxfp4_kernels::Tier::Scalar));
    let p = run(&["--expert-cache", "0", "--expert-policy=usage"]).unwrap();
    apply_library_flags(&p, &mut options).unwrap();
    assert_eq!(options.experts.cache_experts, Some(0));
    assert_eq!(
        options.experts.policy(),
        expert_store::Policy::UsageWeighted
    );
    // Nothing given: the defaults stay.
    let mut options = EngineOptions::default();
    apply_library_flags(&Parsed::default(), &mut options).unwrap();
    assert_eq!(options.pool, numa_sched::PoolOptions::default());
    assert!(!options.resident_trunk && options.kernel_tier.is_none());
    assert_eq!(options.memory_bytes, None);
    assert!(!options.experts.wants_store() && options.experts.usage_cache);
    // Two capacities are one mistake, refused before anything loads.
    let p = run(&["--expert-cache", "4", "--expert-cache-gb", "1"]).unwrap();
    assert_eq!(
        apply_library_flags(&p, &mut options)
            .unwrap_err()
            .to_string(),
        "--expert-cache and --expert-cache-gb cannot both be given"
    );
}

/// A required flag: its absence is a usage error naming it; `--help` still works without it.
#[test]
fn a_required_flag_must_be_given() {
    let table = vec![
        Flag::value("model", "DIR", Kind::Text, "", TEST, "a directory").required(),
        Flag::switch("fast", TEST, "go fast"),
    ];
    let parse_args = |args: &[&str]| parse(&table, args.iter().map(|a| a.to_string()));
    let message = parse_args(&["--fast"]).expect_err("no --model").to_string();
    assert_eq!(message, "--model DIR is required; see --help");
    assert!(matches!(parse_args(&["--help"]), Ok(Outcome::Help)));
    match parse_args(&["--model", "/m"]) {
        Ok(Outcome::Run(p)) => assert_eq!(p.get_str("model"), Some("/m")),
        other => panic!("{other:?}"),
    }
    assert_eq!(table[0].default, "required");
    assert!(
        table_problems(&table).is_empty(),
        "{:?}",
        table_problems(&table)
    );
}

/// A docs page's first `sh` block is read as a shell reads it: continuation lines joined,
/// comments cut, quoted words whole.
#[test]
fn the_first_example_of_a_page_is_read_as_a_shell_reads_it() {
    let page = "x\n```text\nno\n```\n```sh\na b \\\n  c   # said\nd 'e f' \"g h\"\n```\n```sh\nlater\n```\n";
    assert_eq!(first_sh_block(page), ["a b c", "d 'e f' \"g h\""]);
    assert_eq!(shell_words("d 'e f' \"g h\" ''"), ["d", "e f", "g h", ""]);
    assert_eq!(args_after("run -- --x 'y z'", "run --"), ["--x", "y z"]);
}

#[test]
#[should_panic(expected = "no ```sh block")]
fn a_page_without_an_example_fails() {
    first_sh_block("# title\n```text\nx\n```\n");
}

#[test]
#[should_panic(expected = "needs a shell")]
fn an_example_that_needs_a_shell_fails() {
    shell_words("k3-serve --prompt \"$(cat a.txt)\"");
}
