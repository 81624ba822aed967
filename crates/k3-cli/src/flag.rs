//! One flag of a table ([`Flag`]): its spellings, the [`Kind`] its value must be (checked while
//! parsing), its default and help as `--help` shows them, and the [`Group`] it is listed under.

use std::fmt::Write as _;

use crate::error::UsageError;
use crate::suggest::nearest;

/// A section of `--help`. Sections are printed in the order their first flag has in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// The section's heading (`Server`), printed with a colon after it.
    pub title: &'static str,
}

impl Group {
    /// A section headed `title`.
    pub const fn new(title: &'static str) -> Self {
        Self { title }
    }

    /// `--threads`, `--kernel-tier`, `--resident-trunk`.
    pub const PERFORMANCE: Group = Group::new("Performance");
    /// The expert store's flags.
    pub const EXPERTS: Group = Group::new("Experts");
    /// Where the workers run.
    pub const NUMA: Group = Group::new("NUMA");
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
    Number {
        /// The least value accepted.
        min: f64,
        /// The greatest value accepted (`f64::INFINITY`: no bound).
        max: f64,
    },
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
    /// What the value must be; checked while parsing.
    pub kind: Kind,
    /// The default as `--help` shows it (`8000`, `off`, `one-shot 32, server 256`).
    pub default: &'static str,
    /// The section of `--help` it is listed under.
    pub group: Group,
    /// One line, lower-case, no trailing period.
    pub help: &'static str,
    /// May be given more than once (every value is kept, see [`crate::Parsed::all`]).
    pub repeatable: bool,
    /// An environment variable the binary reads when the flag is absent.
    pub env: Option<&'static str>,
    /// The run needs it: [`crate::parse`] refuses a command line without it.
    pub required: bool,
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
            required: false,
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
            required: false,
        }
    }

    /// The same flag with other spellings (dashes included: `-m`, `--ctx-size`).
    pub fn aliases(mut self, aliases: &'static [&'static str]) -> Self {
        self.aliases = aliases;
        self
    }

    /// The same flag, accepted more than once (every value kept).
    pub fn repeatable(mut self) -> Self {
        self.repeatable = true;
        self
    }

    /// The same flag, read from the environment variable `var` when not given.
    pub fn env(mut self, var: &'static str) -> Self {
        self.env = Some(var);
        self
    }

    /// A flag the run cannot go without (its default shows as `required`).
    pub fn required(mut self) -> Self {
        self.required = true;
        self.default = "required";
        self
    }

    /// The same flag with another default (a binary whose default differs from the table's).
    pub fn with_default(mut self, default: &'static str) -> Self {
        self.default = default;
        self
    }

    /// Whether a value follows it (every kind but [`Kind::Switch`]).
    pub fn takes_value(&self) -> bool {
        self.kind != Kind::Switch
    }

    /// `--name`.
    pub fn long(&self) -> String {
        format!("--{}", self.name)
    }

    /// Whether `spelling` (dashes included) names this flag.
    pub(crate) fn is_spelled(&self, spelling: &str) -> bool {
        spelling.strip_prefix("--") == Some(self.name) || self.aliases.contains(&spelling)
    }

    /// Checks one value against [`Self::kind`].
    pub(crate) fn check(&self, value: &str) -> Result<(), UsageError> {
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

/// Every spelling of every flag in `table`, `--help` and `--version` included.
pub fn all_spellings(table: &[Flag]) -> impl Iterator<Item = String> + '_ {
    table
        .iter()
        .flat_map(|f| std::iter::once(f.long()).chain(f.aliases.iter().map(|a| a.to_string())))
        .chain(["--help", "--version"].map(String::from))
}

/// Whether `arg` (`--flag` or `--flag=value`) names a flag of `table`, or help or version.
pub fn is_flag_spelling(table: &[Flag], arg: &str) -> bool {
    let spelling = arg.split_once('=').map_or(arg, |(s, _)| s);
    matches!(spelling, "--help" | "-h" | "--version" | "-V")
        || table.iter().any(|f| f.is_spelled(spelling))
}
