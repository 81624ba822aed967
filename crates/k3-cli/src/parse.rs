//! The parser over a flag table ([`parse`]) and what it gives: an [`Outcome`], the flags given
//! ([`Parsed`], each value already checked against its kind) or a one-line [`UsageError`].

use crate::error::UsageError;
use crate::flag::{Flag, all_spellings, is_flag_spelling};
use crate::help::{render_help, render_version};
use crate::suggest::nearest;

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Run with these flags.
    Run(Parsed),
    /// `--help` or `-h`: print [`crate::render_help`] and exit 0.
    Help,
    /// `--version` or `-V`: print [`crate::render_version`] and exit 0.
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

    /// The flag's value as a `usize` (`None`: not given); one the type cannot hold is an error.
    pub fn get_usize(&self, name: &str) -> Result<Option<usize>, UsageError> {
        self.get_parsed(name, "a whole number")
    }

    /// The flag's value as a `u64` (`None`: not given); one the type cannot hold is an error.
    pub fn get_u64(&self, name: &str) -> Result<Option<u64>, UsageError> {
        self.get_parsed(name, "a whole number")
    }

    /// The flag's value as a `u16` (`None`: not given); one the type cannot hold is an error.
    pub fn get_u16(&self, name: &str) -> Result<Option<u16>, UsageError> {
        self.get_parsed(name, "a port number in [1, 65535]")
    }

    /// The flag's value as an `f32` (`None`: not given); one the type cannot hold is an error.
    pub fn get_f32(&self, name: &str) -> Result<Option<f32>, UsageError> {
        self.get_parsed(name, "a number")
    }

    /// The flag's value as an `f64` (`None`: not given); one the type cannot hold is an error.
    pub fn get_f64(&self, name: &str) -> Result<Option<f64>, UsageError> {
        self.get_parsed(name, "a number")
    }

    /// The flags given, in command-line order: `(name, value)`, `None` for a switch.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Option<&str>)> + '_ {
        self.given.iter().map(|(n, v)| (*n, v.as_deref()))
    }

    /// Fills each flag of `table` that has an environment variable and was not given, from
    /// `lookup(var)` (the binary passes a lookup of its environment). An empty variable
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

/// Parses `args` (without the program name) against `table`: `--flag value`, `--flag=value`,
/// short and long aliases; a single-value flag given twice is refused, a repeatable one keeps
/// every value, a switch given twice is the switch once.
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
    if let Some(flag) = table.iter().find(|f| f.required && !parsed.has(f.name)) {
        return Err(UsageError::Required {
            flag: format!("--{}", flag.name),
            value_name: flag.value_name,
        });
    }
    Ok(Outcome::Run(parsed))
}

/// [`parse`], answering `--help` / `--version` itself: prints [`crate::render_help`] /
/// [`crate::render_version`] to stdout and returns `None` (the binary then exits 0); the flags
/// to run with otherwise. A usage error is returned for the binary to print.
pub fn parse_or_answer(
    table: &[Flag],
    binary: &str,
    version: &str,
    args: impl IntoIterator<Item = String>,
) -> Result<Option<Parsed>, UsageError> {
    match parse(table, args)? {
        Outcome::Run(parsed) => Ok(Some(parsed)),
        Outcome::Help => {
            print!("{}", render_help(table, binary, version));
            Ok(None)
        }
        Outcome::Version => {
            print!("{}", render_version(binary, version));
            Ok(None)
        }
    }
}

/// What a binary does with its command line before anything else: [`parse`] it, and on
/// `--help` / `--version` print [`crate::render_help`] / [`crate::render_version`] to stdout and
/// exit 0, on a usage error print `binary: error` to stderr and exit 2 (the usual convention
/// for usage errors). Returns the flags to run with. For a binary's `main` only: a library
/// never exits.
pub fn parse_or_exit(
    table: &[Flag],
    binary: &str,
    version: &str,
    args: impl IntoIterator<Item = String>,
) -> Parsed {
    match parse_or_answer(table, binary, version, args) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => std::process::exit(0),
        Err(e) => {
            eprintln!("{binary}: {e}");
            std::process::exit(2)
        }
    }
}
