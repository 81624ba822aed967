//! `k3-serve`'s command line: its own flags (model, server, sampling) in one table with the
//! library flags of `k3-cli` ([`k3_serve_flags`]); the parser and `--help` are `k3-cli`'s,
//! re-exported here for `main.rs`.

pub use k3_cli::{
    Flag, Group, Kind, Outcome, Parsed, UsageError, apply_library_flags, parse, render_help,
    render_version,
};

use k3_cli::library_flags;

/// The sections of `--help` for `k3-serve`'s own flags (the library flags' follow): the
/// checkpoint and what is served from it,
pub const MODEL: Group = Group::new("Model");
/// the HTTP server and its limits,
pub const SERVER: Group = Group::new("Server");
/// and sampling with the one-shot run's own flags.
pub const SAMPLING: Group = Group::new("Sampling and one-shot generation");
/// The flags of speculative decoding.
pub const SPECULATION: Group = Group::new("Speculative decoding");

/// The chat templates `--chat-template` accepts: only the built-in renderer exists.
pub const CHAT_TEMPLATES: &[&str] = &["kimi-k3"];

/// Everything `k3-serve` accepts: its own flags, then the library flags.
pub fn k3_serve_flags() -> Vec<Flag> {
    use Kind::*;
    let temperature = Number { min: 0.0, max: 2.0 };
    let mut table = vec![
        // Model.
        Flag::value(
            "model",
            "DIR",
            Text,
            "the synthetic tiny checkpoint, generated into ~/.cache/k3/tiny",
            MODEL,
            "checkpoint directory: config.json, tokenizer files and *.safetensors",
        )
        .aliases(&["-m"]),
        Flag::value(
            "served-model-name",
            "NAME",
            Text,
            "the config's model id, else the repo or directory name",
            MODEL,
            "a name requests may give as `model`; repeat for more (the first is reported)",
        )
        .repeatable(),
        Flag::value(
            "chat-template",
            "NAME",
            Choice(CHAT_TEMPLATES),
            "kimi-k3",
            MODEL,
            "chat template: only the built-in kimi-k3 renderer exists (no Jinja files)",
        ),
        Flag::value(
            "ctx",
            "N",
            Count,
            "4096",
            MODEL,
            "context length per sequence: prompt plus generated tokens",
        )
        .aliases(&["-c", "--ctx-size", "--max-model-len"]),
        Flag::switch(
            "scan",
            MODEL,
            "read every weight once at startup: NaN/Inf counts and the E8M0 scale scan",
        ),
        // Server.
        Flag::switch(
            "serve",
            SERVER,
            "start the OpenAI-compatible server (without it: one-shot --prompt)",
        ),
        Flag::value(
            "host",
            "HOST",
            Text,
            "127.0.0.1",
            SERVER,
            "address to listen on",
        ),
        Flag::value("port", "PORT", Port, "8000", SERVER, "port to listen on"),
        Flag::value(
            "api-key",
            "KEY",
            Text,
            "none: the API is open",
            SERVER,
            "require `Authorization: Bearer KEY` on /v1 routes (/health, /metrics stay open); \
             repeat for more keys, each its own tenant (prompt-cache entries are not shared \
             between keys)",
        )
        .env("K3_API_KEY")
        .repeatable(),
        Flag::value(
            "api-key-file",
            "FILE",
            Text,
            "none",
            SERVER,
            "more API keys, one per line (blank lines skipped), each its own tenant",
        ),
        Flag::value(
            "max-batch",
            "N",
            Count,
            "8",
            SERVER,
            "sequences decoded together in one batch",
        )
        .aliases(&["-np", "--parallel"]),
        Flag::value(
            "step-tokens",
            "N",
            Count,
            "128",
            SERVER,
            "tokens one engine step feeds at most: each running stream's next token, then chunks of the prompts being prefilled, oldest first (larger: prompts prefill in fewer steps; smaller: streams wait less while a prompt prefills)",
        ),
        Flag::value(
            "queue",
            "N",
            Count,
            "64",
            SERVER,
            "requests waiting beyond the batch before 429 answers",
        ),
        Flag::value(
            "max-connections",
            "N",
            Count,
            "4096",
            SERVER,
            "open connections at once; over it a client gets 503",
        ),
        Flag::value(
            "header-timeout-s",
            "S",
            Seconds,
            "10",
            SERVER,
            "seconds a client has to send a request's headers",
        ),
        Flag::value(
            "body-timeout-s",
            "S",
            Seconds,
            "30",
            SERVER,
            "seconds a client has to send a request's body",
        ),
        Flag::value(
            "idle-timeout-s",
            "S",
            Seconds,
            "60",
            SERVER,
            "seconds an idle keep-alive connection stays open",
        ),
        Flag::value(
            "prompt-cache-gb",
            "G",
            Number { min: 0.0, max: 1e6 },
            "a tenth of the memory budget at startup",
            SERVER,
            "size in GB (10^9 bytes) of the session snapshots kept in RAM to resume prompts that extend a cached prefix; 0 turns the cache off",
        ),
        Flag::value(
            "prompt-cache-dir",
            "DIR",
            Text,
            "none: RAM only",
            SERVER,
            "spill prompt-cache snapshots to DIR (up to 4x the RAM budget); a restart finds them again",
        ),
        // Sampling and one-shot generation.
        Flag::value(
            "prompt",
            "TEXT",
            Text,
            "none",
            SAMPLING,
            "one-shot: answer TEXT as a user message, print the reply and exit",
        )
        .aliases(&["-p"]),
        Flag::switch(
            "raw",
            SAMPLING,
            "one-shot: continue --prompt as plain text (no chat template, no BOS)",
        ),
        Flag::value(
            "load-state",
            "FILE",
            Text,
            "none",
            SAMPLING,
            "one-shot: start from a state --save-state wrote; the prompt must extend its tokens",
        ),
        Flag::value(
            "save-state",
            "FILE",
            Text,
            "none",
            SAMPLING,
            "one-shot: after the answer, write the session's state (prompt and answer) to FILE",
        ),
        Flag::value(
            "json-schema",
            "FILE",
            Text,
            "none",
            SAMPLING,
            "one-shot: constrain the answer to JSON valid against the JSON Schema in FILE",
        ),
        Flag::value(
            "grammar",
            "FILE",
            Text,
            "none",
            SAMPLING,
            "one-shot: constrain the answer to the Lark grammar in FILE (llguidance's Lark)",
        ),
        Flag::value(
            "max-constraint-compile-ms",
            "MS",
            Number {
                min: 1.0,
                max: 600_000.0,
            },
            "2000",
            SAMPLING,
            "a request's output constraint (response_format, a forced or strict tool call, --json-schema, --grammar) may take this long to compile; longer is a 400",
        ),
        Flag::value(
            "max-mask-ms",
            "MS",
            Number {
                min: 1.0,
                max: 600_000.0,
            },
            "200",
            SAMPLING,
            "one token's output-constraint mask may take this long; a request whose mask takes longer fails, and the batch goes on",
        ),
        Flag::value(
            "max-tokens",
            "N",
            Count,
            "one-shot 32, server 256",
            SAMPLING,
            "tokens to generate (a request's max_tokens overrides the server's)",
        )
        .aliases(&["-n", "--n-predict"]),
        Flag::value(
            "temperature",
            "T",
            temperature,
            "one-shot 0 (greedy), server 1",
            SAMPLING,
            "sampling temperature in [0, 2] (the server takes a request's temperature)",
        )
        .aliases(&["--temp"]),
        Flag::value(
            "seed",
            "S",
            Whole,
            "one-shot 0; server: a request's seed",
            SAMPLING,
            "sampling seed: the same seed and prompt give the same text",
        ),
        Flag::switch(
            "no-think",
            SAMPLING,
            "thinking off (it is on by default; a request's chat_template_kwargs.thinking overrides)",
        ),
        Flag::value(
            "thinking-effort",
            "EFFORT",
            Choice(&["low", "high", "max"]),
            "max",
            SAMPLING,
            "thinking effort the chat template announces: low, high or max",
        ),
        Flag::value(
            "spec",
            "MODE",
            Choice(&["ngram", "off"]),
            "off",
            SPECULATION,
            "speculative decoding: `ngram` drafts tokens from the conversation itself (what followed the latest earlier occurrence of the last few tokens) and from earlier answers of the same tenant, and checks them in the step's one pass over the weights; the output is the same bits as `off`, which decodes one token a pass",
        ),
        Flag::value(
            "spec-max-draft",
            "N",
            Count,
            "8",
            SPECULATION,
            "drafted tokens per sequence and step at most; fewer when the measured cost of a longer pass or the sequence's acceptance says they would not pay",
        ),
        Flag::value(
            "spec-cache-mb",
            "M",
            Whole,
            "64",
            SPECULATION,
            "memory for earlier answers to draft from (with their index), per server, least recently used dropped first; each tenant drafts only from its own (0: none kept)",
        ),
    ];
    table.extend(library_flags());
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_cli::{flags_in_help, groups, is_flag_spelling, spelled};

    fn run(args: &[&str]) -> Result<Parsed, UsageError> {
        match parse(&k3_serve_flags(), args.iter().map(|a| a.to_string()))? {
            Outcome::Run(parsed) => Ok(parsed),
            other => panic!("{args:?} parsed as {other:?}"),
        }
    }

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
        let names: Vec<String> = table.iter().map(Flag::long).collect();
        assert_eq!(flags_in_help(&help), names);
        for flag in &table {
            let lines: Vec<&str> = help
                .lines()
                .filter(|l| l.starts_with(&format!("  {} ", spelled(flag))))
                .collect();
            assert_eq!(lines.len(), 1, "{} in {help}", flag.long());
            assert!(lines[0].contains(&format!("[default: {}]", flag.default)));
            assert!(lines[0].contains(flag.help), "{}", lines[0]);
        }
        let titles: Vec<&str> = groups(&table).iter().map(|g| g.title).collect();
        assert_eq!(
            titles,
            [
                "Model",
                "Server",
                "Sampling and one-shot generation",
                "Speculative decoding",
                "Performance",
                "Experts",
                "NUMA"
            ]
        );
        assert!(help.contains("[env: K3_API_KEY]"));
        // Defaults that differ between one-shot and server say both.
        for name in ["max-tokens", "temperature"] {
            let flag = table.iter().find(|f| f.name == name).unwrap();
            assert!(flag.default.contains("one-shot") && flag.default.contains("server"));
        }
    }

    /// docs/SERVING.md, where the flags are told by group, names every flag the binary
    /// accepts, and every long alias (the llama-server and vLLM spellings: `--ctx-size`,
    /// `--parallel`, ...).
    #[test]
    fn the_serving_page_names_every_flag() {
        let page = include_str!("../../../docs/SERVING.md");
        let table = k3_serve_flags();
        let missing = k3_cli::flags_not_named_in(page, &table);
        assert!(
            missing.is_empty(),
            "docs/SERVING.md does not name {missing:?}"
        );
        // Each long alias as a flag of its own, so the same rule finds it.
        let aliases: Vec<Flag> = table
            .iter()
            .flat_map(|flag| {
                flag.aliases
                    .iter()
                    .filter_map(|alias| alias.strip_prefix("--"))
                    .map(|name| Flag {
                        name,
                        ..flag.clone()
                    })
            })
            .collect();
        assert!(aliases.iter().any(|f| f.name == "parallel"));
        let missing = k3_cli::flags_not_named_in(page, &aliases);
        assert!(
            missing.is_empty(),
            "docs/SERVING.md does not name {missing:?}"
        );
    }

    #[test]
    fn the_table_is_consistent_and_aliases_map_to_their_flag() {
        let table = k3_serve_flags();
        assert_eq!(k3_cli::table_problems(&table), Vec::<String>::new());
        for flag in &table {
            for alias in flag.aliases {
                let mut args = vec![*alias];
                args.extend(sample(flag));
                assert!(run(&args).unwrap().has(flag.name), "{alias}");
            }
        }
        let p = run(&["-m", "/models/k3", "-t", "8", "--max-model-len", "8192"]).unwrap();
        assert_eq!(p.get_str("model"), Some("/models/k3"));
        assert_eq!(p.get_usize("ctx").unwrap(), Some(8192));
        // llama-server's slot count is the batch.
        for spelling in ["-np", "--parallel"] {
            let p = run(&[spelling, "3"]).unwrap();
            assert_eq!(p.get_or_default::<usize>(&table, "max-batch").unwrap(), 3);
        }
        assert_eq!(
            run(&["--chat-template", "chatml"]).unwrap_err().to_string(),
            "--chat-template must be kimi-k3 (the only one there is), got \"chatml\""
        );
    }

    /// The binary (`main.rs` and its files) handles no flag outside the table: no `"--flag"`
    /// literal there is unknown, and every name it reads (`get_str("port")`,
    /// `switch("serve")`, ...) is in the table; the defaults it takes from the table parse and
    /// agree with the code's.
    #[test]
    fn main_reads_table_flags_and_the_help_defaults_are_the_ones_used() {
        let table = k3_serve_flags();
        let main = [
            include_str!("main.rs"),
            include_str!("args.rs"),
            include_str!("startup.rs"),
            include_str!("one_shot.rs"),
            include_str!("serving.rs"),
            include_str!("follower.rs"),
        ]
        .concat();
        let main = main.as_str();
        for (at, _) in main.match_indices("\"--") {
            let rest = &main[at + 1..];
            let end = rest[2..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .map_or(rest.len(), |e| e + 2);
            if rest[end..].starts_with('"') {
                let literal = &rest[..end];
                assert!(
                    is_flag_spelling(&table, literal),
                    "{literal} is not in the table"
                );
            }
        }
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
        let conn = crate::conn::limits::ConnLimits::default();
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
        for name in ["ctx", "max-batch", "queue", "step-tokens"] {
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
}
