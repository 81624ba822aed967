//! Checks a binary's tests run on its flag table: the table is consistent
//! ([`table_problems`]) and a document names every flag ([`flags_not_named_in`]).

use crate::flag::{Flag, all_spellings};

/// What is wrong with `table`, one line each: a spelling that names two flags, a help line
/// that is empty, capitalised or ends with a period, an empty default, a value name on a
/// switch or none on a value flag, an alias without its dashes.
pub fn table_problems(table: &[Flag]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut spellings: Vec<String> = all_spellings(table).collect();
    spellings.sort();
    for pair in spellings.windows(2).filter(|p| p[0] == p[1]) {
        problems.push(format!("{} names two flags", pair[0]));
    }
    for flag in table {
        let long = flag.long();
        if flag.help.is_empty() || flag.help.ends_with('.') {
            problems.push(format!(
                "{long}: help {:?} is empty or ends with '.'",
                flag.help
            ));
        }
        if flag.help.starts_with(|c: char| c.is_uppercase()) {
            problems.push(format!("{long}: help {:?} is capitalised", flag.help));
        }
        if flag.default.is_empty() {
            problems.push(format!("{long}: no default"));
        }
        if flag.takes_value() == flag.value_name.is_empty() {
            problems.push(format!("{long}: value name {:?}", flag.value_name));
        }
        if let Some(alias) = flag.aliases.iter().find(|a| !a.starts_with('-')) {
            problems.push(format!("{long}: alias {alias:?} without its dashes"));
        }
    }
    problems
}

/// The long names of the flags of `table` that `doc` (a docs page) does not name: a flag counts
/// as named where `--name` follows a backtick, a slash (`-m/--model`), a space or a bracket
/// and is not followed by more of a name (`--numa` is not named by `--numa-fake`).
pub fn flags_not_named_in(doc: &str, table: &[Flag]) -> Vec<String> {
    let named = |long: &str| {
        doc.match_indices(long).any(|(at, _)| {
            let before = doc[..at].chars().next_back();
            let after = doc[at + long.len()..].chars().next();
            matches!(before, Some('`' | '/' | ' ' | '[' | '('))
                && !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
        })
    };
    table
        .iter()
        .map(Flag::long)
        .filter(|long| !named(long))
        .collect()
}
