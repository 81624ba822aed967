//! The command line as data: a table of [`Flag`]s (name, aliases, value, default, group, help),
//! a parser over it ([`parse`]) that accepts `--flag value`, `--flag=value`, short and long
//! aliases and repeated flags where the table allows them, grouped `--help` text
//! ([`render_help`]), and the table of everything `k3-serve` accepts ([`k3_serve_flags`]).
//!
//! The parser checks each value against its flag's [`Kind`] while parsing, so every usage
//! error (one line, naming the flag and the bad value, or the unknown flag with a "did you
//! mean") surfaces before anything is loaded. Nothing here reads the environment: the binary
//! passes its arguments and, for flags with an environment variable, a lookup
//! ([`Parsed::fill_from_env`]).

use std::fmt::Write as _;

mod flags;

pub use flags::{CHAT_TEMPLATES, apply_library_flags, default_threads, k3_serve_flags};

/// The sections of `--help`, in the order they are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Model,
    Server,
    Sampling,
    Performance,
    Experts,
    Numa,
}

impl Group {
    pub const ALL: [Group; 6] = [
        Group::Model,
        Group::Server,
        Group::Sampling,
        Group::Performance,
        Group::Experts,
        Group::Numa,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Group::Model => "Model",
            Group::Server => "Server",
            Group::Sampling => "Sampling and one-shot generation",
            Group::Performance => "Performance",
            Group::Experts => "Experts",
            Group::Numa => "NUMA",
        }
    }
}

/// What a flag's value must be; checked while parsing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// A switch: no value (`--flag=value` is an error).
    Switch,
    /// Any text (a path, a host, a key).
    Text,
    /// An integer of at least 1.
    Count,
    /// An integer of at least 0.
    Whole,
    /// A TCP port (1 to 65535).
    Port,
    /// A duration in seconds: a finite number above 0 and below 1e9 (`1.5` allowed).
    Seconds,
    /// A finite number in `[min, max]`.
    Number { min: f64, max: f64 },
    /// One of a closed set of words.
    Choice(&'static [&'static str]),
}

/// One flag of the table.
#[derive(Debug, Clone)]
pub struct Flag {
    /// The long name without its dashes: `model` for `--model`.
    pub name: &'static str,
    /// Other spellings, dashes included: `-m`, `--ctx-size`.
    pub aliases: &'static [&'static str],
    /// The value's placeholder in `--help` (`DIR`, `N`); empty for a switch.
    pub value_name: &'static str,
    pub kind: Kind,
    /// The default as `--help` shows it (`8000`, `off`, `one-shot 32, server 256`).
    pub default: &'static str,
    pub group: Group,
    /// One line, lower-case, no trailing period.
    pub help: &'static str,
    /// May be given more than once (every value is kept, see [`Parsed::all`]).
    pub repeatable: bool,
    /// An environment variable the binary reads when the flag is absent.
    pub env: Option<&'static str>,
}

impl Flag {
    /// A flag taking a value.
    pub fn value(
        name: &'static str,
        value_name: &'static str,
        kind: Kind,
        default: &'static str,
        group: Group,
        help: &'static str,
    ) -> Self {
        debug_assert!(kind != Kind::Switch && !value_name.is_empty());
        Self {
            name,
            aliases: &[],
            value_name,
            kind,
            default,
            group,
            help,
            repeatable: false,
            env: None,
        }
    }

    /// A switch (off unless given).
    pub fn switch(name: &'static str, group: Group, help: &'static str) -> Self {
        Self {
            name,
            aliases: &[],
            value_name: "",
            kind: Kind::Switch,
            default: "off",
            group,
            help,
            repeatable: false,
            env: None,
        }
    }

    pub fn aliases(mut self, aliases: &'static [&'static str]) -> Self {
        self.aliases = aliases;
        self
    }

    pub fn repeatable(mut self) -> Self {
        self.repeatable = true;
        self
    }

    pub fn env(mut self, var: &'static str) -> Self {
        self.env = Some(var);
        self
    }

    pub fn takes_value(&self) -> bool {
        self.kind != Kind::Switch
    }

    /// `--name`.
    pub fn long(&self) -> String {
        format!("--{}", self.name)
    }

    /// Whether `spelling` (dashes included) names this flag.
    fn is_spelled(&self, spelling: &str) -> bool {
        spelling.strip_prefix("--") == Some(self.name) || self.aliases.contains(&spelling)
    }

    /// Checks one value against [`Self::kind`].
    fn check(&self, value: &str) -> Result<(), UsageError> {
        let bad = |want: String| UsageError::BadValue {
            flag: self.long(),
            value: value.to_owned(),
            want,
        };
        match self.kind {
            Kind::Switch | Kind::Text => Ok(()),
            Kind::Count => match value.parse::<u64>() {
                Ok(n) if n >= 1 => Ok(()),
                _ => Err(bad("a count of at least 1".into())),
            },
            Kind::Whole => match value.parse::<u64>() {
                Ok(_) => Ok(()),
                _ => Err(bad("a whole number".into())),
            },
            Kind::Port => match value.parse::<u16>() {
                Ok(n) if n >= 1 => Ok(()),
                _ => Err(bad("a port number in [1, 65535]".into())),
            },
            Kind::Seconds => match value.parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(()),
                _ => Err(bad("a positive number of seconds below 1e9".into())),
            },
            Kind::Number { min, max } => match value.parse::<f64>() {
                Ok(x) if x.is_finite() && (min..=max).contains(&x) => Ok(()),
                _ if max.is_infinite() => Err(bad(format!("a number of at least {min}"))),
                _ => Err(bad(format!("a number in [{min}, {max}]"))),
            },
            Kind::Choice(words) if words.contains(&value) => Ok(()),
            Kind::Choice([only]) => Err(bad(format!("{only} (the only one there is)"))),
            Kind::Choice(words) => {
                let mut want = words.join(", ");
                if let Some(near) = nearest(value, words.iter().copied()) {
                    let _ = write!(want, "; did you mean {near}?");
                }
                Err(bad(format!("one of {want}")))
            }
        }
    }
}

/// A mistake on the command line; its `Display` is the one line to print (then exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("unknown flag {flag}{}; see --help", did_you_mean(.suggestion))]
    Unknown {
        flag: String,
        suggestion: Option<String>,
    },
    #[error("unexpected argument {argument:?}: flags start with --, see --help")]
    Positional { argument: String },
    #[error("{flag} needs a value ({value_name}){}", found_flag(.found))]
    MissingValue {
        flag: String,
        value_name: &'static str,
        /// The flag that came where the value should be.
        found: Option<String>,
    },
    #[error("{flag} is a switch and takes no value, got {value:?}")]
    SwitchWithValue { flag: String, value: String },
    #[error("{flag} must be {want}, got {value:?}")]
    BadValue {
        flag: String,
        value: String,
        want: String,
    },
    #[error("{flag} was given twice ({first:?}, then {second:?}); it takes one value")]
    Repeated {
        flag: String,
        first: String,
        second: String,
    },
    #[error("{0}")]
    Other(String),
}

fn did_you_mean(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map_or(String::new(), |s| format!(" (did you mean {s}?)"))
}

fn found_flag(found: &Option<String>) -> String {
    found
        .as_ref()
        .map_or(String::new(), |f| format!(", got the flag {f}"))
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Run with these flags.
    Run(Parsed),
    /// `--help` or `-h`: print [`render_help`] and exit 0.
    Help,
    /// `--version` or `-V`: print [`render_version`] and exit 0.
    Version,
}

/// The flags given, in command-line order, each value already checked against its kind.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// `(flag name, value)`; `None` for a switch.
    given: Vec<(&'static str, Option<String>)>,
}

impl Parsed {
    /// Whether the flag was given (or filled from its environment variable).
    pub fn has(&self, name: &str) -> bool {
        self.given.iter().any(|(n, _)| *n == name)
    }

    /// A switch: given or not.
    pub fn switch(&self, name: &str) -> bool {
        self.has(name)
    }

    /// The flag's value (the last one for a repeatable flag).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.given
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Every value of a repeatable flag, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.given
            .iter()
            .filter(|(n, _)| *n == name)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }

    pub fn get_usize(&self, name: &str) -> Result<Option<usize>, UsageError> {
        self.get_parsed(name, "a whole number")
    }

    pub fn get_u64(&self, name: &str) -> Result<Option<u64>, UsageError> {
        self.get_parsed(name, "a whole number")
    }

    pub fn get_u16(&self, name: &str) -> Result<Option<u16>, UsageError> {
        self.get_parsed(name, "a port number in [1, 65535]")
    }

    pub fn get_f32(&self, name: &str) -> Result<Option<f32>, UsageError> {
        self.get_parsed(name, "a number")
    }

    pub fn get_f64(&self, name: &str) -> Result<Option<f64>, UsageError> {
        self.get_parsed(name, "a number")
    }

    /// The flags given, in command-line order: `(name, value)`, `None` for a switch. Lets the
    /// binary hand the expert and NUMA flags to `ExpertOptions::apply_flag` and
    /// `PoolOptions::apply_flag` (as `--name`) unchanged.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Option<&str>)> + '_ {
        self.given.iter().map(|(n, v)| (*n, v.as_deref()))
    }

    /// Fills each flag of `table` that has an environment variable and was not given, from
    /// `lookup(var)` (the binary passes `|v| std::env::var(v).ok()`). An empty variable
    /// counts as unset. The value is checked like one from the command line, and an error
    /// names the variable.
    pub fn fill_from_env(
        &mut self,
        table: &[Flag],
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), UsageError> {
        for flag in table {
            let Some(var) = flag.env else { continue };
            if self.has(flag.name) {
                continue;
            }
            let Some(value) = lookup(var).filter(|v| !v.is_empty()) else {
                continue;
            };
            flag.check(&value).map_err(|e| match e {
                UsageError::BadValue { want, .. } => UsageError::Other(format!(
                    "the environment variable {var} (for {}) must be {want}",
                    flag.long()
                )),
                other => other,
            })?;
            self.given.push((flag.name, Some(value)));
        }
        Ok(())
    }

    /// The flag's value, else its default from `table` (for flags whose default is a plain
    /// value, such as `8000` for `--port`: the help's default is the one used).
    pub fn get_or_default<T: std::str::FromStr>(
        &self,
        table: &[Flag],
        name: &str,
    ) -> Result<T, UsageError> {
        let flag = table
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| UsageError::Other(format!("--{name} is not in the flag table")))?;
        let value = self.get_str(name).unwrap_or(flag.default);
        value.parse().map_err(|_| UsageError::BadValue {
            flag: flag.long(),
            value: value.to_owned(),
            want: format!("a {}", flag.value_name),
        })
    }

    fn get_parsed<T: std::str::FromStr>(
        &self,
        name: &str,
        want: &str,
    ) -> Result<Option<T>, UsageError> {
        self.get_str(name)
            .map(|v| {
                v.parse().map_err(|_| UsageError::BadValue {
                    flag: format!("--{name}"),
                    value: v.to_owned(),
                    want: want.to_owned(),
                })
            })
            .transpose()
    }
}

/// Parses `args` (without the program name) against `table`.
pub fn parse(
    table: &[Flag],
    args: impl IntoIterator<Item = String>,
) -> Result<Outcome, UsageError> {
    let mut parsed = Parsed::default();
    let mut switches_seen = Vec::new();
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        if !arg.starts_with('-') || arg == "-" {
            return Err(UsageError::Positional { argument: arg });
        }
        let (spelling, attached) = match arg.split_once('=') {
            Some((s, v)) if s.starts_with("--") || s.len() == 2 => (s, Some(v)),
            _ => (arg.as_str(), None),
        };
        match spelling {
            "--help" | "-h" => return Ok(Outcome::Help),
            "--version" | "-V" => return Ok(Outcome::Version),
            _ => {}
        }
        let Some(flag) = table.iter().find(|f| f.is_spelled(spelling)) else {
            return Err(UsageError::Unknown {
                flag: spelling.to_owned(),
                suggestion: nearest(spelling, all_spellings(table)),
            });
        };
        if !flag.takes_value() {
            if let Some(value) = attached {
                return Err(UsageError::SwitchWithValue {
                    flag: flag.long(),
                    value: value.to_owned(),
                });
            }
            // A switch given twice means what it means once.
            if !switches_seen.contains(&flag.name) {
                switches_seen.push(flag.name);
                parsed.given.push((flag.name, None));
            }
            continue;
        }
        let value = match attached {
            Some(v) => v.to_owned(),
            None => match args.peek() {
                // A value may start with `-` (`--temperature -1` is then refused for its
                // value, not taken as a missing one), but a known flag is not a value.
                Some(next) if !is_flag_spelling(table, next) => args.next().unwrap_or_default(),
                found => {
                    return Err(UsageError::MissingValue {
                        flag: flag.long(),
                        value_name: flag.value_name,
                        found: found.cloned(),
                    });
                }
            },
        };
        flag.check(&value)?;
        if !flag.repeatable
            && let Some(first) = parsed.get_str(flag.name)
        {
            return Err(UsageError::Repeated {
                flag: flag.long(),
                first: first.to_owned(),
                second: value,
            });
        }
        parsed.given.push((flag.name, Some(value)));
    }
    Ok(Outcome::Run(parsed))
}

fn all_spellings(table: &[Flag]) -> impl Iterator<Item = String> + '_ {
    table
        .iter()
        .flat_map(|f| std::iter::once(f.long()).chain(f.aliases.iter().map(|a| a.to_string())))
        .chain(["--help", "--version"].map(String::from))
}

fn is_flag_spelling(table: &[Flag], arg: &str) -> bool {
    let spelling = arg.split_once('=').map_or(arg, |(s, _)| s);
    matches!(spelling, "--help" | "-h" | "--version" | "-V")
        || table.iter().any(|f| f.is_spelled(spelling))
}

/// The candidate closest to `word` by edit distance, if close enough to be a likely typo.
fn nearest<S: AsRef<str>>(word: &str, candidates: impl Iterator<Item = S>) -> Option<String> {
    if word.len() < 4 {
        return None; // `-x` is one edit from every short alias
    }
    let limit = (word.len() / 4).clamp(1, 3);
    candidates
        .map(|c| (edit_distance(word, c.as_ref()), c.as_ref().to_owned()))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Edit distance over bytes, a swap of two neighbours counting as one edit (optimal string
/// alignment): `--modle` is one edit from `--model`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    for i in 0..=a.len() {
        for j in 0..=b.len() {
            d[i * width + j] = if i == 0 || j == 0 {
                i + j
            } else {
                let mut best = (d[(i - 1) * width + j - 1] + usize::from(a[i - 1] != b[j - 1]))
                    .min(d[(i - 1) * width + j] + 1)
                    .min(d[i * width + j - 1] + 1);
                if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                    best = best.min(d[(i - 2) * width + j - 2] + 1);
                }
                best
            };
        }
    }
    d[a.len() * width + b.len()]
}

/// `NAME VERSION`, what `--version` prints.
pub fn render_version(binary: &str, version: &str) -> String {
    format!("{binary} {version}\n")
}

/// `--help`: a usage line, then one section per [`Group`] with one line per flag: its short
/// spellings, name and value, its help, `[default: ...]`, then its long aliases, environment
/// variable and whether it repeats, where it has them.
pub fn render_help(table: &[Flag], binary: &str, version: &str) -> String {
    let width = table
        .iter()
        .map(|f| spelled(f).len())
        .max()
        .unwrap_or(0)
        .min(40);
    let mut out = format!("{binary} {version}\n\nusage: {binary} [FLAGS]\n");
    for group in Group::ALL {
        let flags: Vec<&Flag> = table.iter().filter(|f| f.group == group).collect();
        if flags.is_empty() {
            continue;
        }
        let _ = write!(out, "\n{}:\n", group.title());
        for flag in flags {
            let _ = write!(
                out,
                "  {:width$}  {} [default: {}]",
                spelled(flag),
                flag.help,
                flag.default
            );
            let long: Vec<&str> = long_aliases(flag).collect();
            if !long.is_empty() {
                let _ = write!(out, " [aliases: {}]", long.join(", "));
            }
            if let Some(var) = flag.env {
                let _ = write!(out, " [env: {var}]");
            }
            if flag.repeatable {
                out.push_str(" [repeatable]");
            }
            out.push('\n');
        }
    }
    let _ = write!(
        out,
        "\nOther:\n  {:width$}  print this help\n  {:width$}  print the version\n\
         Flags take `--flag value` or `--flag=value`.\n",
        "-h, --help", "-V, --version"
    );
    out
}

/// A flag's first column in `--help`: `-m, --model DIR` (long aliases go at the line's end).
fn spelled(flag: &Flag) -> String {
    let mut s: String = short_aliases(flag).map(|a| format!("{a}, ")).collect();
    s.push_str(&flag.long());
    if flag.takes_value() {
        s.push(' ');
        s.push_str(flag.value_name);
    }
    s
}

fn short_aliases(flag: &Flag) -> impl Iterator<Item = &'static str> + '_ {
    flag.aliases
        .iter()
        .copied()
        .filter(|a| !a.starts_with("--"))
}

fn long_aliases(flag: &Flag) -> impl Iterator<Item = &'static str> + '_ {
    flag.aliases.iter().copied().filter(|a| a.starts_with("--"))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `args` parsed with k3-serve's table; anything but a run is a test failure.
    pub(in crate::cli) fn run(args: &[&str]) -> Result<Parsed, UsageError> {
        match parse(&k3_serve_flags(), args.iter().map(|a| a.to_string()))? {
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
        let p = run(&["--port=8001", "--host", "0.0.0.0", "--temperature=0.7"]).unwrap();
        assert_eq!(p.get_u16("port").unwrap(), Some(8001));
        assert_eq!(p.get_str("host"), Some("0.0.0.0"));
        assert_eq!(p.get_f32("temperature").unwrap(), Some(0.7));
        assert_eq!(p.get_usize("ctx").unwrap(), None);
        let p = run(&["--port", "8000", "--serve", "--prompt=a=b"]).unwrap();
        assert_eq!(p.get_u16("port").unwrap(), Some(8000));
        assert!(p.switch("serve") && !p.switch("numa"));
        // Only the first `=` splits.
        assert_eq!(p.get_str("prompt"), Some("a=b"));
        // A value may start with a dash when it is not a flag.
        assert_eq!(
            run(&["--prompt", "-x"]).unwrap().get_str("prompt"),
            Some("-x")
        );
        assert_eq!(
            run(&["--prompt", ""]).unwrap().iter().collect::<Vec<_>>(),
            [("prompt", Some(""))]
        );
    }

    #[test]
    fn a_value_flag_without_its_value_is_refused() {
        assert_eq!(error(&["--serve", "--port"]), "--port needs a value (PORT)");
        assert_eq!(
            error(&["-m", "--serve"]),
            "--model needs a value (DIR), got the flag --serve"
        );
        assert!(error(&["--ctx", "-t"]).starts_with("--ctx needs a value"));
    }

    #[test]
    fn unknown_flags_are_one_line_with_a_suggestion_when_near() {
        assert_eq!(
            error(&["--thread", "4"]),
            "unknown flag --thread (did you mean --threads?); see --help"
        );
        assert_eq!(
            error(&["--modle", "x"]),
            "unknown flag --modle (did you mean --model?); see --help"
        );
        assert_eq!(
            error(&["--frobnicate"]),
            "unknown flag --frobnicate; see --help"
        );
        assert_eq!(error(&["-x"]), "unknown flag -x; see --help");
        assert!(error(&["serve"]).starts_with("unexpected argument \"serve\""));
    }

    #[test]
    fn repeatable_flags_collect_and_others_refuse_a_second_value() {
        let p = run(&[
            "--served-model-name",
            "kimi-k3",
            "--served-model-name=moonshotai/Kimi-K3",
        ])
        .unwrap();
        assert_eq!(
            p.all("served-model-name"),
            ["kimi-k3", "moonshotai/Kimi-K3"]
        );
        assert_eq!(
            error(&["--port", "1", "--port=2"]),
            "--port was given twice (\"1\", then \"2\"); it takes one value"
        );
        // A switch twice is the switch once.
        let p = run(&["--serve", "--serve"]).unwrap();
        assert_eq!(p.iter().count(), 1);
    }

    #[test]
    fn a_switch_given_a_value_is_refused() {
        assert_eq!(
            error(&["--serve=yes"]),
            "--serve is a switch and takes no value, got \"yes\""
        );
        assert!(error(&["--no-think=false"]).starts_with("--no-think is a switch"));
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
        assert!(error(&["--port=70000"]).contains("70000"));
        assert_eq!(
            error(&["--ctx", "0"]),
            "--ctx must be a count of at least 1, got \"0\""
        );
        assert!(error(&["--seed=-3"]).starts_with("--seed must be a whole number"));
        assert!(error(&["--expert-cache-gb=-1"]).contains("at least 0"));
        assert_eq!(
            error(&["--idle-timeout-s", "0"]),
            "--idle-timeout-s must be a positive number of seconds below 1e9, got \"0\""
        );
        assert_eq!(
            run(&["--body-timeout-s=1.5"])
                .unwrap()
                .get_f64("body-timeout-s")
                .unwrap(),
            Some(1.5)
        );
        assert_eq!(
            error(&["--chat-template", "chatml"]),
            "--chat-template must be kimi-k3 (the only one there is), got \"chatml\""
        );
        assert_eq!(
            error(&["--thinking-effort=maxx"]),
            "--thinking-effort must be one of low, high, max; did you mean max?, got \"maxx\""
        );
        assert!(run(&["--chat-template", "kimi-k3", "--expert-cache", "0"]).is_ok());
    }

    #[test]
    fn help_and_version_are_outcomes() {
        let table = k3_serve_flags();
        let outcome = |args: &[&str]| parse(&table, args.iter().map(|a| a.to_string()));
        assert_eq!(outcome(&["-h"]), Ok(Outcome::Help));
        assert_eq!(outcome(&["--serve", "--help"]), Ok(Outcome::Help));
        assert_eq!(outcome(&["--version"]), Ok(Outcome::Version));
        assert_eq!(outcome(&["-V"]), Ok(Outcome::Version));
        assert_eq!(render_version("k3-serve", "0.1.0"), "k3-serve 0.1.0\n");
        assert!(matches!(outcome(&[]), Ok(Outcome::Run(p)) if p.iter().count() == 0));
    }

    #[test]
    fn env_fills_only_absent_flags() {
        let table = k3_serve_flags();
        let env = |var: &str| (var == "K3_API_KEY").then(|| "from-env".to_string());
        let mut p = run(&[]).unwrap();
        p.fill_from_env(&table, env).unwrap();
        assert_eq!(p.get_str("api-key"), Some("from-env"));
        let mut p = run(&["--api-key", "from-flag"]).unwrap();
        p.fill_from_env(&table, env).unwrap();
        assert_eq!(p.all("api-key"), ["from-flag"]);
        let mut p = run(&[]).unwrap();
        p.fill_from_env(&table, |_| Some(String::new())).unwrap();
        assert!(!p.has("api-key"), "an empty variable is unset");
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("--thread", "--threads"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("--modle", "--model"), 1);
        assert_eq!(nearest("--zzzzzz", ["--model"].into_iter()), None);
    }
}
