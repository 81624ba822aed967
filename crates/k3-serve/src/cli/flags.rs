//! The table of every flag `k3-serve` takes ([`k3_serve_flags`]), handing the libraries' flags
//! to their options ([`apply_library_flags`]), and the default thread count
//! ([`default_threads`]).

use super::{Flag, Group, Kind, Parsed, UsageError};

/// The number of threads `--threads` defaults to: the physical cores this process may run on
/// (the affinity mask, hyperthread siblings dropped), over all NUMA nodes; at least 1.
pub fn default_threads() -> usize {
    numa_sched::Topology::detect(numa_sched::TopologyOptions::default())
        .domains
        .iter()
        .map(|d| d.cpus.len())
        .sum::<usize>()
        .max(1)
}

/// Hands the flags the libraries own (the expert flags to `ExpertOptions::apply_flag`, the
/// NUMA flags and `--threads` to `PoolOptions::apply_flag`) their values, in command-line
/// order and under their long names, so `-t 8` reaches the pool as `--threads 8`. Flags
/// neither takes are the binary's and are skipped.
pub fn apply_library_flags(
    parsed: &Parsed,
    experts: &mut k3_model::experts::ExpertOptions,
    pool: &mut numa_sched::PoolOptions,
) -> Result<(), UsageError> {
    for (name, value) in parsed.iter() {
        let long = format!("--{name}");
        let value = || value.map(String::from);
        if !experts
            .apply_flag(&long, value)
            .map_err(UsageError::Other)?
        {
            pool.apply_flag(&long, value).map_err(UsageError::Other)?;
        }
    }
    Ok(())
}

/// The chat templates `--chat-template` accepts: only the built-in renderer exists.
pub const CHAT_TEMPLATES: &[&str] = &["kimi-k3"];

/// Everything `k3-serve` accepts.
pub fn k3_serve_flags() -> Vec<Flag> {
    use Group::*;
    use Kind::*;
    let temperature = Number { min: 0.0, max: 2.0 };
    let non_negative = Number {
        min: 0.0,
        max: f64::INFINITY,
    };
    vec![
        // Model.
        Flag::value(
            "model",
            "DIR",
            Text,
            "the synthetic tiny checkpoint, generated into ~/.cache/k3/tiny",
            Model,
            "checkpoint directory: config.json, tokenizer files and *.safetensors",
        )
        .aliases(&["-m"]),
        Flag::value(
            "served-model-name",
            "NAME",
            Text,
            "the config's model id, else the repo or directory name",
            Model,
            "a name requests may give as `model`; repeat for more (the first is reported)",
        )
        .repeatable(),
        Flag::value(
            "chat-template",
            "NAME",
            Choice(CHAT_TEMPLATES),
            "kimi-k3",
            Model,
            "chat template: only the built-in kimi-k3 renderer exists (no Jinja files)",
        ),
        Flag::value(
            "ctx",
            "N",
            Count,
            "4096",
            Model,
            "context length per sequence: prompt plus generated tokens",
        )
        .aliases(&["-c", "--ctx-size", "--max-model-len"]),
        Flag::switch(
            "scan",
            Model,
            "read every weight once at startup: NaN/Inf counts and the E8M0 scale scan",
        ),
        // Server.
        Flag::switch(
            "serve",
            Server,
            "start the OpenAI-compatible server (without it: one-shot --prompt)",
        ),
        Flag::value(
            "host",
            "HOST",
            Text,
            "127.0.0.1",
            Server,
            "address to listen on",
        ),
        Flag::value("port", "PORT", Port, "8000", Server, "port to listen on"),
        Flag::value(
            "api-key",
            "KEY",
            Text,
            "none: the API is open",
            Server,
            "require `Authorization: Bearer KEY` on /v1 routes (/health, /metrics stay open)",
        )
        .env("K3_API_KEY"),
        Flag::value(
            "max-batch",
            "N",
            Count,
            "8",
            Server,
            "sequences decoded together in one batch",
        ),
        Flag::value(
            "queue",
            "N",
            Count,
            "64",
            Server,
            "requests waiting beyond the batch before 429 answers",
        ),
        Flag::value(
            "max-connections",
            "N",
            Count,
            "4096",
            Server,
            "open connections at once; over it a client gets 503",
        ),
        Flag::value(
            "header-timeout-s",
            "S",
            Seconds,
            "10",
            Server,
            "seconds a client has to send a request's headers",
        ),
        Flag::value(
            "body-timeout-s",
            "S",
            Seconds,
            "30",
            Server,
            "seconds a client has to send a request's body",
        ),
        Flag::value(
            "idle-timeout-s",
            "S",
            Seconds,
            "60",
            Server,
            "seconds an idle keep-alive connection stays open",
        ),
        // Sampling and one-shot generation.
        Flag::value(
            "prompt",
            "TEXT",
            Text,
            "none",
            Sampling,
            "one-shot: answer TEXT as a user message, print the reply and exit",
        )
        .aliases(&["-p"]),
        Flag::value(
            "max-tokens",
            "N",
            Count,
            "one-shot 32, server 256",
            Sampling,
            "tokens to generate (a request's max_tokens overrides the server's)",
        )
        .aliases(&["-n", "--n-predict"]),
        Flag::value(
            "temperature",
            "T",
            temperature,
            "one-shot 0 (greedy), server 1",
            Sampling,
            "sampling temperature in [0, 2] (the server takes a request's temperature)",
        )
        .aliases(&["--temp"]),
        Flag::value(
            "seed",
            "S",
            Whole,
            "one-shot 0; server: a request's seed",
            Sampling,
            "sampling seed: the same seed and prompt give the same text",
        ),
        Flag::switch(
            "no-think",
            Sampling,
            "thinking off (it is on by default; a request's chat_template_kwargs.thinking overrides)",
        ),
        Flag::value(
            "thinking-effort",
            "EFFORT",
            Choice(&["low", "high", "max"]),
            "max",
            Sampling,
            "thinking effort the chat template announces: low, high or max",
        ),
        // Performance.
        Flag::value(
            "threads",
            "N",
            Count,
            "the physical cores this process may use",
            Performance,
            "compute threads in all (hyperthread siblings are not counted)",
        )
        .aliases(&["-t"]),
        Flag::value(
            "kernel-tier",
            "TIER",
            Choice(&["scalar", "avx512", "avx512-bf16", "avx512-vnni"]),
            "the best this CPU supports",
            Performance,
            "kernel tier for MXFP4: scalar, avx512, avx512-bf16 or avx512-vnni",
        ),
        // Experts.
        Flag::value(
            "expert-cache",
            "N",
            Whole,
            "none: experts are read through the file mapping",
            Experts,
            "experts per layer kept resident (0: read on every use)",
        ),
        Flag::value(
            "expert-cache-gb",
            "G",
            non_negative,
            "none: experts are read through the file mapping",
            Experts,
            "gigabytes of experts kept resident, over all layers (instead of --expert-cache)",
        ),
        Flag::switch(
            "preload-experts",
            Experts,
            "fill the expert cache at startup, most used experts first",
        ),
        Flag::switch("mlock", Experts, "pin resident experts in memory"),
        Flag::switch(
            "no-usage-cache",
            Experts,
            "neither read nor write the expert usage file (the policy is then lru)",
        ),
        Flag::value(
            "usage-file",
            "FILE",
            Text,
            "k3-expert-usage.json in the model directory",
            Experts,
            "where expert usage counts are read at startup and written at exit",
        ),
        Flag::value(
            "expert-policy",
            "POLICY",
            Choice(&["lru", "usage"]),
            "usage while the usage cache is on, else lru",
            Experts,
            "expert cache eviction: lru or usage (usage-weighted)",
        ),
        Flag::value(
            "io-threads",
            "N",
            Count,
            "16",
            Experts,
            "expert reads in flight at once",
        ),
        // NUMA.
        Flag::switch(
            "numa",
            Numa,
            "one worker pool per NUMA node, weights placed on the node that uses them",
        ),
        Flag::value(
            "numa-fake",
            "N",
            Count,
            "none",
            Numa,
            "split the CPUs into N synthetic domains (testing NUMA code on one node)",
        ),
        Flag::value(
            "numa-threads",
            "N",
            Count,
            "none: --threads split over the domains",
            Numa,
            "threads per domain",
        ),
        Flag::switch(
            "hyperthreads",
            Numa,
            "count hyperthread siblings as CPUs (default: one per physical core)",
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::super::{all_spellings, is_flag_spelling, render_help, spelled};
    use super::*;

    /// A value each kind accepts.
    fn sample(flag: &Flag) -> Option<&'static str> {
        match flag.kind {
            Kind::Switch => None,
            Kind::Text => Some("x"),
            Kind::Count | Kind::Whole | Kind::Port | Kind::Seconds => Some("2"),
            Kind::Number { .. } => Some("1"),
            Kind::Choice(words) => Some(words[0]),
        }
    }

    #[test]
    fn every_flag_is_in_the_help_with_its_default_on_one_line() {
        let table = k3_serve_flags();
        let help = render_help(&table, "k3-serve", "0.1.0");
        for flag in &table {
            let lines: Vec<&str> = help
                .lines()
                .filter(|l| l.starts_with(&format!("  {} ", spelled(flag))))
                .collect();
            assert_eq!(lines.len(), 1, "{} in {help}", flag.long());
            let line = lines[0];
            assert!(
                line.contains(&format!("[default: {}]", flag.default)),
                "{line}"
            );
            assert!(line.contains(flag.help), "{line}");
            for alias in flag.aliases {
                assert!(line.contains(alias), "{alias} in {line}");
            }
        }
        assert_eq!(
            help.lines().filter(|l| l.contains("[default: ")).count(),
            table.len()
        );
        for group in Group::ALL {
            assert!(help.contains(&format!("\n{}:\n", group.title())), "{help}");
        }
        assert!(help.contains("--version") && help.contains("--help"));
        assert!(help.contains("[env: K3_API_KEY]"));
        // Defaults that differ between one-shot and server say both.
        for name in ["max-tokens", "temperature"] {
            let flag = table.iter().find(|f| f.name == name).unwrap();
            assert!(flag.default.contains("one-shot") && flag.default.contains("server"));
        }
    }

    #[test]
    fn the_table_is_consistent() {
        let table = k3_serve_flags();
        let mut spellings: Vec<String> = all_spellings(&table).collect();
        let n = spellings.len();
        spellings.sort();
        spellings.dedup();
        assert_eq!(spellings.len(), n, "a spelling names two flags");
        for flag in &table {
            assert!(
                !flag.default.is_empty() && !flag.help.is_empty(),
                "{}",
                flag.name
            );
            assert!(!flag.help.ends_with('.'), "{}", flag.help);
            assert!(flag.help.starts_with(|c: char| !c.is_uppercase()));
            assert_eq!(flag.takes_value(), !flag.value_name.is_empty());
            assert!(flag.aliases.iter().all(|a| a.starts_with('-')));
        }
    }

    #[test]
    fn aliases_map_to_their_flag() {
        let p = run(&["-m", "/models/k3", "-t", "8", "--ctx-size", "8192"]).unwrap();
        assert_eq!(p.get_str("model"), Some("/models/k3"));
        assert_eq!(p.get_usize("threads").unwrap(), Some(8));
        assert_eq!(p.get_usize("ctx").unwrap(), Some(8192));
        assert_eq!(
            run(&["-c=512"]).unwrap().get_usize("ctx").unwrap(),
            Some(512)
        );
        for flag in k3_serve_flags() {
            for alias in flag.aliases {
                let mut args = vec![*alias];
                args.extend(sample(&flag));
                let p = run(&args).unwrap();
                assert!(p.has(flag.name), "{alias} names --{}", flag.name);
            }
        }
    }

    /// `main.rs` and the two `apply_flag`s are where flags are handled today: each `"--flag"`
    /// literal there is in the table, and each expert and NUMA flag of the table is one that
    /// its `apply_flag` accepts.
    #[test]
    fn the_table_covers_every_flag_the_binary_handles() {
        let table = k3_serve_flags();
        // With the least number of flag literals each holds today (main.rs holds none: it
        // parses with this table), so the scan cannot silently find nothing.
        let sources = [
            ("main.rs", include_str!("../main.rs"), 0),
            (
                "experts.rs",
                include_str!("../../../k3-model/src/experts.rs"),
                8,
            ),
            (
                "numa-sched",
                include_str!("../../../numa-sched/src/lib.rs"),
                5,
            ),
        ];
        for (file, source, least) in sources {
            let mut found = 0;
            for (at, _) in source.match_indices("\"--") {
                let rest = &source[at + 1..];
                let end = rest[2..]
                    .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                    .map_or(rest.len(), |e| e + 2);
                if !rest[end..].starts_with('"') {
                    continue; // a message that mentions a flag, not a flag
                }
                let literal = &rest[..end];
                found += 1;
                assert!(
                    is_flag_spelling(&table, literal),
                    "{literal} is handled in {file} but not in the table"
                );
            }
            assert!(found >= least, "only {found} flag literals in {file}");
        }
        for flag in &table {
            let value = sample(flag).map(String::from);
            let mut experts = k3_model::experts::ExpertOptions::default();
            let mut pool = numa_sched::PoolOptions::default();
            let taken = match flag.group {
                Group::Experts => experts.apply_flag(&flag.long(), || value),
                Group::Numa => pool.apply_flag(&flag.long(), || value),
                _ => continue,
            };
            assert_eq!(taken, Ok(true), "{}", flag.long());
        }
        assert_eq!(
            numa_sched::PoolOptions::default().apply_flag("--threads", || Some("2".into())),
            Ok(true)
        );
    }

    /// Every flag name `main.rs` reads (`get_str("port")`, `switch("serve")`, ...) is in the
    /// table, and the defaults it takes from the table parse and agree with the libraries'.
    #[test]
    fn main_reads_table_flags_and_the_help_defaults_are_the_ones_used() {
        let table = k3_serve_flags();
        let main = include_str!("../main.rs");
        let mut read = 0;
        for getter in [
            "get_str(\"",
            "switch(\"",
            "get_usize(\"",
            "get_u64(\"",
            "get_f32(\"",
            "all(\"",
            "has(\"",
            "get_or_default(table, \"",
            "seconds(\"",
        ] {
            for (at, _) in main.match_indices(getter) {
                let rest = &main[at + getter.len()..];
                let name = &rest[..rest.find('"').unwrap()];
                read += 1;
                assert!(
                    table.iter().any(|f| f.name == name),
                    "main.rs reads --{name}, which is not in the table"
                );
            }
        }
        assert!(read >= 20, "only {read} flag reads found in main.rs");
        let none = Parsed::default();
        let conn = crate::conn::ConnLimits::default();
        let secs = |name| none.get_or_default::<f64>(&table, name).unwrap();
        assert_eq!(secs("header-timeout-s"), conn.header.as_secs_f64());
        assert_eq!(secs("body-timeout-s"), conn.body.as_secs_f64());
        assert_eq!(secs("idle-timeout-s"), conn.idle.as_secs_f64());
        assert_eq!(
            none.get_or_default::<usize>(&table, "max-connections")
                .unwrap(),
            conn.max_connections
        );
        assert_eq!(none.get_or_default::<u16>(&table, "port").unwrap(), 8000);
        for name in ["ctx", "max-batch", "queue"] {
            assert!(none.get_or_default::<usize>(&table, name).unwrap() >= 1);
        }
        assert_eq!(
            none.get_or_default::<k3_model::chat::ThinkingEffort>(&table, "thinking-effort")
                .unwrap(),
            k3_model::chat::ThinkingEffort::Max
        );
        let given = run(&["--port=9"]).unwrap();
        assert_eq!(given.get_or_default::<u16>(&table, "port").unwrap(), 9);
    }

    #[test]
    fn library_flags_reach_their_options() {
        let p = run(&[
            "-t",
            "3",
            "--numa-fake=2",
            "--expert-cache-gb",
            "1.5",
            "--mlock",
            "--expert-policy",
            "lru",
            "--port",
            "9",
            "--io-threads",
            "4",
        ])
        .unwrap();
        let mut experts = k3_model::experts::ExpertOptions::default();
        let mut pool = numa_sched::PoolOptions::default();
        apply_library_flags(&p, &mut experts, &mut pool).unwrap();
        assert_eq!(pool.threads, Some(3));
        assert_eq!(pool.fake_domains, Some(2));
        assert_eq!(experts.cache_bytes, Some(1_500_000_000));
        assert!(experts.mlock && !experts.preload);
        assert_eq!(experts.policy(), expert_store::Policy::Lru);
        assert_eq!(experts.io_threads, 4);
        // Nothing given: the libraries' defaults stay (threads None: one per physical core).
        let mut pool = numa_sched::PoolOptions::default();
        apply_library_flags(&Parsed::default(), &mut experts, &mut pool).unwrap();
        assert_eq!(pool, numa_sched::PoolOptions::default());
    }

    #[test]
    fn default_threads_is_within_the_machine() {
        let n = default_threads();
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!((1..=available).contains(&n), "{n} of {available}");
    }
}
