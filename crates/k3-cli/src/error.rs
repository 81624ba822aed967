//! The one error of the command line, [`UsageError`]: a mistake its user made, printed as one
//! line before the binary exits 2.

/// A mistake on the command line; its `Display` is the one line to print (then exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    /// A spelling no flag of the table has.
    #[error("unknown flag {flag}{}; see --help", did_you_mean(.suggestion))]
    Unknown {
        /// The spelling as given.
        flag: String,
        /// The nearest spelling the table has, if one is near enough.
        suggestion: Option<String>,
    },
    /// An argument that is not a flag (the binaries take no positional arguments).
    #[error("unexpected argument {argument:?}: flags start with --, see --help")]
    Positional {
        /// The argument as given.
        argument: String,
    },
    /// A flag that takes a value came last, or right before another flag.
    #[error("{flag} needs a value ({value_name}){}", found_flag(.found))]
    MissingValue {
        /// The flag (`--name`).
        flag: String,
        /// Its value's placeholder (`DIR`, `N`).
        value_name: &'static str,
        /// The flag that came where the value should be.
        found: Option<String>,
    },
    /// `--switch=value`.
    #[error("{flag} is a switch and takes no value, got {value:?}")]
    SwitchWithValue {
        /// The switch (`--name`).
        flag: String,
        /// The value given to it.
        value: String,
    },
    /// A value its flag's kind refuses.
    #[error("{flag} must be {want}, got {value:?}")]
    BadValue {
        /// The flag (`--name`).
        flag: String,
        /// The value as given.
        value: String,
        /// What the value must be (`a count of at least 1`).
        want: String,
    },
    /// A flag that takes one value, given twice.
    #[error("{flag} was given twice ({first:?}, then {second:?}); it takes one value")]
    Repeated {
        /// The flag (`--name`).
        flag: String,
        /// The first value.
        first: String,
        /// The second value.
        second: String,
    },
    /// A required flag that is missing.
    #[error("{flag} {value_name} is required; see --help")]
    Required {
        /// The flag (`--name`).
        flag: String,
        /// Its value's placeholder (`DIR`).
        value_name: &'static str,
    },
    /// Any other mistake (two flags that exclude each other, a file a flag names that
    /// cannot be read): the whole line.
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
