//! `--help` and `--version` text from a flag table, and the inverse a test needs: the flags a
//! help text lists ([`flags_in_help`]).

use std::fmt::Write as _;

use crate::flag::{Flag, Group};

/// `NAME VERSION`, what `--version` prints.
pub fn render_version(binary: &str, version: &str) -> String {
    format!("{binary} {version}\n")
}

/// `--help`: a usage line, then one section per [`Group`] (in the order of the table's first
/// flag of each) with one line per flag: its short spellings, name and value, its help,
/// `[default: ...]`, then its long aliases, environment variable and whether it repeats,
/// where it has them.
pub fn render_help(table: &[Flag], binary: &str, version: &str) -> String {
    let width = table
        .iter()
        .map(|f| spelled(f).len())
        .max()
        .unwrap_or(0)
        .min(40);
    let mut out = format!("{binary} {version}\n\nusage: {binary} [FLAGS]\n");
    for group in groups(table) {
        let _ = write!(out, "\n{}:\n", group.title);
        for flag in table.iter().filter(|f| f.group == group) {
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

/// The groups of `table`, each once, in the order of their first flag.
pub fn groups(table: &[Flag]) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for flag in table {
        if !groups.contains(&flag.group) {
            groups.push(flag.group);
        }
    }
    groups
}

/// The long names (`--model`) of the flag lines of a help text: each line indented by two
/// spaces whose first column (up to two spaces) holds a `--name`, `--help` and `--version`
/// left out. A test compares it with the table the help was made from.
pub fn flags_in_help(help: &str) -> Vec<String> {
    help.lines()
        .filter_map(|line| line.strip_prefix("  "))
        .filter_map(|line| line.split("  ").next())
        .filter_map(|column| {
            column
                .split([',', ' '])
                .find(|w| w.starts_with("--"))
                .map(str::to_owned)
        })
        .filter(|long| long != "--help" && long != "--version")
        .collect()
}

/// A flag's first column in `--help`: `-m, --model DIR` (long aliases go at the line's end).
pub fn spelled(flag: &Flag) -> String {
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
