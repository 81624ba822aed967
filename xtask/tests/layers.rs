//! The layering rules, run as ordinary tests: inside each crate, no two files import each
//! other, directly or through a chain (a module imports only from modules below it), and no
//! source file outside tests grows past [`MAX_LINES`] lines (a file that long holds two ideas).
//!
//! A file imports another when a path in it names the other's module or an item in it: a
//! `use` (`crate::`, `super::`, `self::` or a child module's name), or a `crate::`/`super::`
//! path in its code. A parent that re-exports a child (`pub use child::X`) imports it; a child
//! that takes `super::Y` imports its parent. Inline modules belong to their file. Test modules
//! (`#[cfg(test)] mod tests;` or `mod tests { }`) are consumers, not layers: they may take
//! fixtures from anywhere, and are left out. The module tree is followed from each crate root
//! (`lib.rs`, `main.rs`, `bin/*.rs`, and `NAME/main.rs`: a binary whose modules live in a
//! folder of their own) through its `mod name;` declarations.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Lines a source file outside tests may have.
const MAX_LINES: usize = 600;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits below the root")
        .to_owned()
}

/// Every crate's `src` directory: `crates/*`, `xtask`, `benches`.
fn crate_sources() -> Vec<PathBuf> {
    let root = root();
    let mut dirs: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .expect("crates/")
        .map(|e| e.expect("dir entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.extend(["xtask", "benches"].map(|d| root.join(d).join("src")));
    dirs.sort();
    assert!(dirs.len() >= 8, "found only {dirs:?}: is the walk broken?");
    dirs
}

/// The `.rs` files below `dir`, by path relative to it.
fn read_tree(dir: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(dir: &Path, base: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in fs::read_dir(dir).expect("readable source tree") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = fs::read_to_string(&path).expect("utf-8 source");
                out.insert(path.strip_prefix(base).unwrap().to_owned(), text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `text` with comments, strings and char literals blanked (newlines kept), so that paths
/// written in them are not read as imports.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (at(i + 1) == '"' || (at(i + 1) == '#' && !ident(at(i.wrapping_sub(1)))))
            && !ident(at(i.wrapping_sub(1)))
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) != '"' {
                out.push(c);
                i += 1;
                continue;
            }
            out.extend(std::iter::repeat_n(' ', j + 1 - i));
            i = j + 1;
            while i < chars.len() {
                if chars[i] == '"' && (0..hashes).all(|k| at(i + 1 + k) == '#') {
                    out.extend(std::iter::repeat_n(' ', hashes + 1));
                    i += hashes + 1;
                    break;
                }
                out.push(blank(chars[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\''
            && (at(i + 2) == '\''
                || (at(i + 1) == '\\' && at(i + 3) == '\'')
                || (at(i + 1) == '\\' && at(i + 2) == 'u'))
        {
            // A char literal (a lifetime has no closing quote).
            let end = (i + 1..chars.len())
                .find(|&j| chars[j] == '\'' && j > i + 1)
                .unwrap_or(i);
            out.extend(std::iter::repeat_n(' ', end + 1 - i));
            i = end + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// One crate's files as modules: module path (`""` the root, `"a::b"`) to its file.
fn modules(tree: &BTreeMap<PathBuf, String>) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
        .iter()
        .map(PathBuf::from)
        .filter(|p| tree.contains_key(p))
        .collect();
    roots.extend(
        tree.keys()
            .filter(|p| p.parent() == Some(Path::new("bin")))
            .cloned(),
    );
    // A second binary with its modules in a folder of its own (`[[bin]] path =
    // "src/spec/main.rs"`, k3-bench's spec_bench): `NAME/main.rs`.
    roots.extend(
        tree.keys()
            .filter(|p| {
                p.file_name() == Some("main.rs".as_ref())
                    && p.parent()
                        .is_some_and(|d| d.parent() == Some(Path::new("")) && d != Path::new("bin"))
            })
            .cloned(),
    );
    for root in roots {
        // Each root is a crate of its own; its modules are keyed under the root's name so a
        // binary's `crate::` never reaches the library's files.
        let prefix = if root == Path::new("lib.rs") {
            String::new()
        } else {
            format!("<{}>", root.display())
        };
        let mut stack = vec![(prefix, root)];
        while let Some((module, file)) = stack.pop() {
            let text = code_only(&tree[&file]);
            // A `x.rs` file's children live in `x/`; `lib.rs`, `main.rs`, `mod.rs` in their dir.
            let stem = file.file_stem().unwrap().to_str().unwrap();
            let dir = if ["lib", "main", "mod"].contains(&stem)
                || file.starts_with("bin") && file.parent() == Some(Path::new("bin"))
            {
                file.parent().unwrap().to_owned()
            } else {
                file.with_extension("")
            };
            for child in declared_modules(&text) {
                let candidates = [
                    dir.join(format!("{child}.rs")),
                    dir.join(&child).join("mod.rs"),
                ];
                if let Some(found) = candidates.into_iter().find(|c| tree.contains_key(c)) {
                    let path = join(&module, &child);
                    stack.push((path, found));
                }
            }
            out.insert(module, file);
        }
    }
    out
}

fn join(module: &str, child: &str) -> String {
    if module.is_empty() {
        child.to_owned()
    } else {
        format!("{module}::{child}")
    }
}

/// The `mod name;` declarations of a file (not inline `mod name { }`, nor test modules).
fn declared_modules(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = find_word(rest, "mod") {
        let before = &rest[..at];
        let after = rest[at + 3..].trim_start();
        let name: String = after.chars().take_while(|&c| ident(c)).collect();
        let tail = after[name.len()..].trim_start();
        if tail.starts_with(';') && !name.is_empty() && !test_only(before) {
            out.push(name.clone());
        }
        rest = &rest[at + 3..];
    }
    out
}

/// Where `word` stands as a whole word in `text`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(found) = text[from..].find(word) {
        let at = from + found;
        let left = text[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !ident(c) && c != ':');
        let right = text[at + word.len()..]
            .chars()
            .next()
            .is_none_or(|c| !ident(c));
        if left && right {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// Whether the item that follows `before` carries `#[cfg(test)]` (among its attributes and
/// visibility words).
fn test_only(before: &str) -> bool {
    let mut text = before.trim_end();
    for word in ["pub(crate)", "pub(super)", "pub"] {
        if let Some(stripped) = text.strip_suffix(word) {
            text = stripped.trim_end();
            break;
        }
    }
    while text.ends_with(']') {
        let Some(open) = text.rfind("#[") else { break };
        let attribute: String = text[open..]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if attribute == "#[cfg(test)]" {
            return true;
        }
        text = text[..open].trim_end();
    }
    false
}

/// The paths a file names (each as its segments), with the inline module they sit in.
fn named_paths(code: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    // Inline modules open at a depth: (name, depth of their `{`).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let word_at = |i: usize| -> String { chars[i..].iter().take_while(|&&c| ident(c)).collect() };
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            depth += 1;
            i += 1;
            continue;
        }
        if c == '}' {
            if inline.last().is_some_and(|(_, d)| *d == depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
            i += 1;
            continue;
        }
        if !ident(c) || (i > 0 && (ident(chars[i - 1]) || chars[i - 1] == ':')) {
            i += 1;
            continue;
        }
        let word = word_at(i);
        let scope: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
        match word.as_str() {
            "mod" => {
                let start = i;
                let mut j = i + 3;
                while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                    j += 1;
                }
                let name = word_at(j);
                let mut k = j + name.len();
                while chars.get(k).is_some_and(|c| c.is_whitespace()) {
                    k += 1;
                }
                i = j + name.len();
                if chars.get(k) == Some(&'{') {
                    let before: String = chars[..start].iter().collect();
                    if test_only(&before) {
                        // A test module: skip to its closing brace.
                        let mut level = 0usize;
                        let mut m = k;
                        while m < chars.len() {
                            match chars[m] {
                                '{' => level += 1,
                                '}' => {
                                    level -= 1;
                                    if level == 0 {
                                        break;
                                    }
                                }
                                _ => {}
                            }
                            m += 1;
                        }
                        i = m + 1;
                        continue;
                    }
                    inline.push((name, depth + 1));
                }
            }
            "use" => {
                let end = (i..chars.len())
                    .find(|&j| chars[j] == ';')
                    .unwrap_or(chars.len());
                // Whitespace collapsed, and dropped beside punctuation: `a :: { b as c }` is
                // `a::{b as c}`.
                let raw: String = chars[i + 3..end].iter().collect();
                let words: Vec<&str> = raw.split_whitespace().collect();
                let mut tree = String::new();
                for w in words {
                    let glue =
                        tree.ends_with(|c: char| ident(c)) && w.starts_with(|c: char| ident(c));
                    if glue {
                        tree.push(' ');
                    }
                    tree.push_str(w);
                }
                for path in expand_use(&tree) {
                    out.push((scope.clone(), path));
                }
                i = end;
            }
            "crate" | "super" | "self" if visibility(&chars[..i]) => {
                // A visibility, `pub(crate)` / `pub(super)`: not a path.
                i += word.len();
            }
            "crate" | "super" | "self" => {
                let mut j = i;
                let mut segments = Vec::new();
                loop {
                    let w = word_at(j);
                    if w.is_empty() {
                        break;
                    }
                    segments.push(w.clone());
                    j += w.len();
                    if chars.get(j) == Some(&':')
                        && chars.get(j + 1) == Some(&':')
                        && chars.get(j + 2).is_some_and(|&c| ident(c))
                    {
                        j += 2;
                    } else {
                        break;
                    }
                }
                out.push((scope, segments));
                i = j;
            }
            _ => i += word.len(),
        }
    }
    out
}

/// Whether a path that follows `before` is a visibility's (`pub(crate)`, `pub(in crate::a)`).
fn visibility(before: &[char]) -> bool {
    let text: String = before
        .iter()
        .rev()
        .take(8)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let text = text.trim_end();
    text.ends_with('(') || text.ends_with("(in")
}

/// A use tree (`a::{b, c::{d}}` without spaces) as its paths.
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    let tree = tree.trim_start_matches("::");
    let mut out = Vec::new();
    let Some(brace) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or(tree);
        out.push(
            path.split("::")
                .filter(|s| !s.is_empty() && *s != "*")
                .map(str::to_owned)
                .collect(),
        );
        return out;
    };
    let prefix: Vec<String> = tree[..brace]
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let inner = &tree[brace + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut start) = (0, 0);
    let mut items = Vec::new();
    for (k, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    for item in items.into_iter().filter(|s| !s.is_empty()) {
        for tail in expand_use(item) {
            let mut path = prefix.clone();
            path.extend(tail.into_iter().filter(|s| s != "self"));
            out.push(path);
        }
    }
    out
}

/// File-level import edges of one crate: file -> the files it imports.
fn imports(tree: &BTreeMap<PathBuf, String>) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let modules = modules(tree);
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (module, file) in &modules {
        let here: Vec<String> = module
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let crate_root: Vec<String> = here
            .first()
            .filter(|s| s.starts_with('<'))
            .into_iter()
            .cloned()
            .collect();
        let targets = edges.entry(file.clone()).or_default();
        for (inline, path) in named_paths(&code_only(&tree[file])) {
            let Some(first) = path.first() else { continue };
            let mut base: Vec<String> =
                here.iter().cloned().chain(inline.iter().cloned()).collect();
            let rest: Vec<String> = match first.as_str() {
                "crate" => {
                    base = crate_root.clone();
                    path[1..].to_vec()
                }
                "self" => path[1..].to_vec(),
                "super" => {
                    let supers = path.iter().take_while(|s| *s == "super").count();
                    for _ in 0..supers {
                        base.pop();
                    }
                    path[supers..].to_vec()
                }
                // A child module of the module the path is written in.
                name if modules.contains_key(&join(&base.join("::"), name)) => path.clone(),
                _ => continue,
            };
            let full: Vec<String> = base.into_iter().chain(rest).collect();
            // The longest prefix that is a file of this crate.
            let target = (0..=full.len())
                .rev()
                .map(|n| full[..n].join("::"))
                .find_map(|m| modules.get(&m));
            if let Some(target) = target
                && target != file
            {
                targets.insert(target.clone());
            }
        }
    }
    edges
}

/// The cycles of `edges` (strongly connected sets of two or more files), each as its edges.
fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<(PathBuf, PathBuf)>> {
    // Tarjan's algorithm, iteratively.
    let nodes: Vec<&PathBuf> = edges.keys().collect();
    let id: BTreeMap<&PathBuf, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let succ: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            edges[*n]
                .iter()
                .filter_map(|t| id.get(t).copied())
                .collect()
        })
        .collect();
    let n = nodes.len();
    let (mut index, mut low, mut on) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut next, mut components) = (Vec::new(), 0, Vec::new());
    for start in 0..n {
        if index[start] != usize::MAX {
            continue;
        }
        let mut call: Vec<(usize, usize)> = vec![(start, 0)];
        while let Some(&mut (v, ref mut k)) = call.last_mut() {
            if *k == 0 && index[v] == usize::MAX {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on[v] = true;
            }
            if let Some(&w) = succ[v].get(*k) {
                *k += 1;
                if index[w] == usize::MAX {
                    call.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            call.pop();
            if let Some(&(parent, _)) = call.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    components.push(component);
                }
            }
        }
    }
    components
        .into_iter()
        .map(|c| {
            let mut inside = Vec::new();
            for &a in &c {
                for &b in &succ[a] {
                    if c.contains(&b) {
                        inside.push((nodes[a].clone(), nodes[b].clone()));
                    }
                }
            }
            inside.sort();
            inside
        })
        .collect()
}

#[test]
fn no_two_files_of_a_crate_import_each_other() {
    let mut report = String::new();
    for src in crate_sources() {
        let tree = read_tree(&src);
        for cycle in cycles(&imports(&tree)) {
            report.push_str(&format!("a cycle of files in {}:\n", src.display()));
            for (a, b) in cycle {
                report.push_str(&format!("  {} -> {}\n", a.display(), b.display()));
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}

#[test]
fn no_source_file_outside_tests_is_over_the_limit() {
    let mut long = Vec::new();
    for src in crate_sources() {
        for (path, text) in read_tree(&src) {
            let test = path.file_name().is_some_and(|n| n == "tests.rs")
                || path.components().any(|c| c.as_os_str() == "tests");
            let lines = text.lines().count();
            if !test && lines > MAX_LINES {
                long.push(format!("{} ({lines} lines)", src.join(&path).display()));
            }
        }
    }
    assert!(long.is_empty(), "over {MAX_LINES} lines: {long:#?}");
}

/// The checks on small crates: a cycle through `super::`, a re-export and `crate::` paths is
/// found, the layered version of the same crate is clean, and an inline test module's
/// `use super::*` stays in its file.
#[test]
fn the_checks_catch_what_they_should() {
    let tree = |files: &[(&str, &str)]| -> BTreeMap<PathBuf, String> {
        files
            .iter()
            .map(|(p, t)| (PathBuf::from(p), (*t).to_owned()))
            .collect()
    };
    let cyclic = tree(&[
        ("lib.rs", "//! x\nmod plan;\nmod model;\n"),
        (
            "plan.rs",
            "//! x\nmod sizes;\npub use sizes::Sizes;\npub struct Plan;\n",
        ),
        (
            "plan/sizes.rs",
            "//! x\nuse super::Plan;\npub struct Sizes;\n",
        ),
        ("model/mod.rs", "//! x\nuse crate::plan::Plan;\n"),
    ]);
    let found = cycles(&imports(&cyclic));
    assert_eq!(
        found,
        vec![vec![
            (PathBuf::from("plan/sizes.rs"), PathBuf::from("plan.rs")),
            (PathBuf::from("plan.rs"), PathBuf::from("plan/sizes.rs")),
        ]]
    );
    // The same crate layered: the shared type in a file of its own.
    let layered = tree(&[
        ("lib.rs", "//! x\nmod plan;\nmod model;\n"),
        (
            "plan.rs",
            "//! x\nmod sizes;\nmod types;\npub use sizes::Sizes;\npub use types::Plan;\n",
        ),
        ("plan/types.rs", "//! x\npub struct Plan;\n"),
        (
            "plan/sizes.rs",
            "//! x\nuse super::types::Plan;\npub struct Sizes;\n",
        ),
        (
            "model/mod.rs",
            "//! x\nuse crate::plan::types::Plan; // crate::model::x in a comment\n",
        ),
    ]);
    assert_eq!(cycles(&imports(&layered)), Vec::<Vec<_>>::new());
    // A cycle through code paths and a grouped use, three files long.
    let chain = tree(&[
        ("lib.rs", "//! x\nmod a;\nmod b;\nmod c;\n"),
        ("a.rs", "//! x\nuse crate::{b::{B}, c as _};\n"),
        ("b.rs", "//! x\nfn f() { crate::c::g(); }\n"),
        ("c.rs", "//! x\nfn g() -> super::a::A { todo!() }\n"),
    ]);
    assert_eq!(cycles(&imports(&chain)).len(), 1);
    assert_eq!(cycles(&imports(&chain))[0].len(), 4);
    // Inline test modules and strings do not make edges.
    let inline = tree(&[
        ("lib.rs", "//! x\nmod a;\nmod b;\n"),
        (
            "a.rs",
            "//! x\nuse crate::b::B;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        (
            "b.rs",
            "//! x\npub struct B;\nconst S: &str = \"crate::a::x\";\n",
        ),
    ]);
    assert_eq!(cycles(&imports(&inline)), Vec::<Vec<_>>::new());
    // Test modules, inline or in a file, are left out: they may take fixtures from above.
    let tests = tree(&[
        ("lib.rs", "//! x\nmod a;\nmod b;\n"),
        (
            "a.rs",
            "//! x\nuse crate::b::B;\n#[cfg(test)]\nmod tests;\n",
        ),
        (
            "a/tests.rs",
            "//! x\nuse crate::b::fixture;\nuse super::*;\n",
        ),
        (
            "b.rs",
            "//! x\npub struct B;\n#[cfg(test)]\nmod tests {\n    use crate::a::x;\n}\n",
        ),
    ]);
    assert_eq!(cycles(&imports(&tests)), Vec::<Vec<_>>::new());
    assert!(!imports(&tests).contains_key(&PathBuf::from("a/tests.rs")));
    // A binary's `crate::` is its own crate, not the library's.
    // A visibility's path is not an import.
    let visibility = tree(&[
        ("lib.rs", "//! x\npub mod a;\n"),
        (
            "a.rs",
            "//! x\npub(in crate::a) mod b;\npub(super) fn f() {}\n",
        ),
        ("a/b.rs", "//! x\npub(in crate::a) struct B;\n"),
    ]);
    assert_eq!(
        imports(&visibility)[&PathBuf::from("a/b.rs")],
        BTreeSet::new()
    );
    let binary = tree(&[
        ("lib.rs", "//! x\npub mod a;\n"),
        ("a.rs", "//! x\n"),
        ("main.rs", "//! x\nmod follow;\nuse k3::a;\n"),
        ("follow.rs", "//! x\nuse crate::a::X;\n"),
    ]);
    let edges = imports(&binary);
    let follow = &edges[&PathBuf::from("follow.rs")];
    assert!(!follow.contains(&PathBuf::from("a.rs")), "{edges:?}");
    assert!(follow.contains(&PathBuf::from("main.rs")), "{edges:?}");
    // A second binary rooted in a folder of its own is walked, and a cycle in it found.
    let second = tree(&[
        (
            "main.rs", "//! x
",
        ),
        (
            "spec/main.rs",
            "//! x
mod a;
mod b;
",
        ),
        (
            "spec/a.rs",
            "//! x
use crate::b::B;
pub struct A;
",
        ),
        (
            "spec/b.rs",
            "//! x
use crate::a::A;
pub struct B;
",
        ),
    ]);
    assert_eq!(cycles(&imports(&second)).len(), 1, "{:?}", imports(&second));
}
