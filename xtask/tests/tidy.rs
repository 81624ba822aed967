//! Tidy checks, run as ordinary tests: the house rules a reviewer would otherwise check by eye.

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits below the root")
        .to_owned()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable source tree") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "benches"] {
        rust_files(&root().join(dir), &mut files);
    }
    assert!(
        files.len() > 10,
        "found only {} Rust files: is the walk broken?",
        files.len()
    );
    files
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let bad: Vec<_> = sources()
        .into_iter()
        .filter(|f| {
            !fs::read_to_string(f)
                .expect("utf-8 source")
                .starts_with("//!")
        })
        .collect();
    assert!(
        bad.is_empty(),
        "files without a leading `//!` line: {bad:?}"
    );
}

/// Every `unsafe` block and `unsafe impl` has its own `// SAFETY:` comment right above it.
#[test]
fn every_unsafe_has_its_own_safety_comment() {
    let mut bad = Vec::new();
    let mut found = 0;
    for file in sources() {
        let text = fs::read_to_string(&file).expect("utf-8 source");
        let source = Source::new(&text);
        found += source.unsafe_lines().len();
        for line in unsafe_without_safety(&source) {
            bad.push(format!("{}:{line}", file.display()));
        }
    }
    assert!(
        found > 20,
        "found only {found} unsafe blocks and impls: is the scan broken?"
    );
    assert!(
        bad.is_empty(),
        "unsafe without its own `// SAFETY:` comment right above: {bad:#?}"
    );
}

/// No thread is started outside numa-sched (the scheduler, which places every thread it
/// starts) but the deliberate exceptions of [`THREAD_ALLOW`], each with its reason.
#[test]
fn no_thread_is_started_outside_the_scheduler() {
    let mut bad = Vec::new();
    let mut used = vec![0; THREAD_ALLOW.len()];
    for file in sources() {
        let path = file
            .strip_prefix(root())
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        let text = fs::read_to_string(&file).expect("utf-8 source");
        for (line, pattern) in thread_starts(&path, &Source::new(&text)) {
            match THREAD_ALLOW
                .iter()
                .position(|a| a.path == path && a.pattern == pattern)
            {
                Some(i) => used[i] += 1,
                None => bad.push(format!("{path}:{line}: `{pattern}`")),
            }
        }
    }
    assert!(
        bad.is_empty(),
        "threads started outside numa-sched and not in THREAD_ALLOW (place them with numa-sched, or add an entry that says why they need no placement): {bad:#?}"
    );
    for (entry, n) in THREAD_ALLOW.iter().zip(used) {
        assert!(
            n > 0,
            "THREAD_ALLOW entry {}: `{}` ({}) matches nothing: remove it",
            entry.path,
            entry.pattern,
            entry.reason
        );
    }
}

/// A thread started outside the scheduler on purpose.
struct Allowed {
    path: &'static str,
    pattern: &'static str,
    /// Why this thread needs no placement.
    reason: &'static str,
}

const THREAD_ALLOW: &[Allowed] = &[
    Allowed {
        path: "xtask/src/bench_memory.rs",
        pattern: "thread::scope(",
        reason: "a benchmark harness's disk probe: threads that keep several O_DIRECT reads of \
                 a file in flight to measure the disk, touching no weights in memory (xtask \
                 is a tool, not the engine)",
    },
    Allowed {
        path: "xtask/src/cgroup.rs",
        pattern: "thread::spawn(",
        reason: "a benchmark harness's pipe readers: they copy a child engine's output and \
                 touch no weights (xtask is a tool, not the engine)",
    },
    Allowed {
        path: "crates/k3-serve/src/engine/handle.rs",
        pattern: "thread::Builder::new(",
        reason: "the engine thread: loads the model and drives the pool; each step's work runs \
                 on the pool's pinned workers, not on it",
    },
    Allowed {
        path: "crates/k3-serve/src/serving.rs",
        pattern: "runtime::Builder::new_multi_thread(",
        reason: "the HTTP runtime: two threads asleep on sockets that touch no weights \
                 (docs/ARCHITECTURE.md contract 5 names it)",
    },
    Allowed {
        path: "crates/k3-serve/src/serving.rs",
        pattern: "spawn_blocking(",
        reason: "the HTTP runtime's blocking pool: waits for the engine to finish loading",
    },
    Allowed {
        path: "xtask/src/bench_serve/load.rs",
        pattern: "thread::scope(",
        reason: "bench-serve's HTTP clients, one thread per simulated user: they wait on sockets \
                 in another process (the server under test) and touch no weights",
    },
    Allowed {
        path: "crates/k3-serve/src/server/handlers.rs",
        pattern: "spawn_blocking(",
        reason: "the HTTP runtime's blocking pool: renders and tokenizes prompts and compiles \
                 their output constraints, touches no weights",
    },
    Allowed {
        path: "crates/k3-testkit/src/special.rs",
        pattern: "thread::spawn(",
        reason: "test support (`promptly`): runs a call that might block for ever (an open of a \
                 FIFO) on a thread of its own, so the test fails after its bound instead of \
                 hanging; touches no weights",
    },
    Allowed {
        path: "crates/k3-structured/src/grammar.rs",
        pattern: "thread::scope(",
        reason: "an output constraint's compile, on a thread of its own for its 1 GiB stack \
                 (llguidance recurses per level of a schema's or grammar's chain): it touches \
                 no weights, and the caller waits for it",
    },
    Allowed {
        path: "crates/k3-structured/src/grammar.rs",
        pattern: "thread::Builder::new(",
        reason: "the same compile thread (`thread::scope` above), built with its stack size",
    },
    Allowed {
        path: "crates/k3-serve/src/engine/constrain.rs",
        pattern: "thread::Builder::new(",
        reason: "a constrained sequence's next token mask (llguidance over the token trie), \
                 computed beside the step's forward pass for tens of microseconds; it touches no \
                 weights, and a pinned worker would have to leave the step to run it",
    },
];

/// What starts a thread (or uses rayon's global pool, whose threads nobody places), as it
/// appears in code with strings and comments blanked.
const THREAD_STARTS: &[&str] = &[
    "thread::spawn(",
    "thread::Builder::new(",
    "thread::scope(",
    "ThreadPoolBuilder::new(",
    "rayon::",
    "runtime::Builder::new_multi_thread(",
    "runtime::Builder::new_current_thread(",
    "tokio::main",
    "spawn_blocking(",
];

/// `(line, pattern)` of every thread start in `source` (at `path`, relative to the root) that
/// the scheduler rule covers. Exempt: numa-sched's own sources (the scheduler), and test code
/// (files under `tests/`, `#[cfg(test)]` modules), whose threads stand for callers (two
/// clients, two engines) and run no engine work.
fn thread_starts(path: &str, source: &Source) -> Vec<(usize, &'static str)> {
    if path.starts_with("crates/numa-sched/src/") || path.split('/').any(|part| part == "tests") {
        return Vec::new();
    }
    let tests = source.test_modules();
    let mut out = Vec::new();
    for (i, code) in source.code.iter().enumerate() {
        if tests.iter().any(|r| r.contains(&i)) {
            continue;
        }
        for pattern in THREAD_STARTS {
            if code.contains(pattern) {
                out.push((i + 1, *pattern));
            }
        }
    }
    out
}

/// Lines (1-based) of `unsafe` blocks and impls without their own SAFETY comment: a comment
/// block containing `SAFETY:` on the same line, or right above (attributes may sit between,
/// and so may the earlier lines of the same statement, as in `let x =` then `unsafe {`), with
/// no other `unsafe` between that could be sharing it.
fn unsafe_without_safety(source: &Source) -> Vec<usize> {
    let mut bad = Vec::new();
    for i in source.unsafe_lines() {
        if source.comment[i].contains("SAFETY:") {
            continue;
        }
        let mut ok = false;
        let mut j = i;
        let mut in_comment = false;
        while j > 0 {
            j -= 1;
            let code = source.code[j].trim();
            let comment = source.comment[j].trim();
            if code.is_empty() && !comment.is_empty() {
                in_comment = true;
                if comment.contains("SAFETY:") {
                    ok = true;
                    break;
                }
                continue;
            }
            if in_comment {
                // The comment block above ended without a SAFETY line.
                if code.starts_with("#[") {
                    continue;
                }
                break;
            }
            let continues = !code.is_empty()
                && !code.ends_with(';')
                && !code.ends_with('{')
                && !code.ends_with('}')
                && !code.ends_with(',')
                && !has_unsafe(code);
            if code.starts_with("#[") || continues {
                continue;
            }
            break;
        }
        if !ok {
            bad.push(i + 1);
        }
    }
    bad
}

/// Whether `code` (one line, strings and comments blanked) opens an `unsafe` block or impl.
fn has_unsafe(code: &str) -> bool {
    code.match_indices("unsafe").any(|(at, _)| {
        let before = code[..at].chars().next_back().is_some_and(ident);
        let rest = code[at + "unsafe".len()..].trim_start();
        !before && (rest.starts_with('{') || rest.starts_with("impl ") || rest.starts_with("impl<"))
    })
}

/// A Rust source split per line into its code (strings, chars and comments blanked) and its
/// comments' text, so that neither check can be fooled by the other's words.
struct Source {
    code: Vec<String>,
    comment: Vec<String>,
}

impl Source {
    fn new(text: &str) -> Self {
        #[derive(PartialEq)]
        enum State {
            Code,
            Line,
            Block(usize),
            Str,
            Raw(usize),
        }
        let chars: Vec<char> = text.chars().collect();
        let (mut code, mut comment) = (vec![String::new()], vec![String::new()]);
        let mut state = State::Code;
        let mut i = 0;
        let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
        while i < chars.len() {
            let c = chars[i];
            if c == '\n' {
                if state == State::Line {
                    state = State::Code;
                }
                code.push(String::new());
                comment.push(String::new());
                i += 1;
                continue;
            }
            let (code_line, comment_line) = (code.last_mut().unwrap(), comment.last_mut().unwrap());
            match state {
                State::Code => {
                    if c == '/' && at(i + 1) == '/' {
                        state = State::Line;
                        i += 2;
                        continue;
                    }
                    if c == '/' && at(i + 1) == '*' {
                        state = State::Block(1);
                        i += 2;
                        continue;
                    }
                    if c == '"' {
                        state = State::Str;
                        code_line.push('"');
                        i += 1;
                        continue;
                    }
                    if c == 'r'
                        && (at(i + 1) == '"' || at(i + 1) == '#')
                        && !ident(at(i.wrapping_sub(1)))
                    {
                        let hashes = (i + 1..).take_while(|&k| at(k) == '#').count();
                        if at(i + 1 + hashes) == '"' {
                            state = State::Raw(hashes);
                            code_line.push('"');
                            i += 2 + hashes;
                            continue;
                        }
                    }
                    if c == '\'' {
                        // A char literal ('x', '\n', '\''), not a lifetime: blank it.
                        let len = if at(i + 1) == '\\' {
                            (i + 2..i + 12).find(|&k| at(k) == '\'').map(|k| k - i + 1)
                        } else if at(i + 2) == '\'' {
                            Some(3)
                        } else {
                            None
                        };
                        if let Some(len) = len {
                            code_line.push_str("' '");
                            i += len;
                            continue;
                        }
                    }
                    code_line.push(c);
                }
                State::Line => comment_line.push(c),
                State::Block(depth) => {
                    if c == '*' && at(i + 1) == '/' {
                        state = if depth == 1 {
                            State::Code
                        } else {
                            State::Block(depth - 1)
                        };
                        i += 2;
                        continue;
                    }
                    if c == '/' && at(i + 1) == '*' {
                        state = State::Block(depth + 1);
                        i += 2;
                        continue;
                    }
                    comment_line.push(c);
                }
                State::Str => {
                    if c == '\\' {
                        i += 2;
                        continue;
                    }
                    if c == '"' {
                        state = State::Code;
                        code_line.push('"');
                    }
                }
                State::Raw(hashes) => {
                    if c == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                        state = State::Code;
                        code_line.push('"');
                        i += 1 + hashes;
                        continue;
                    }
                }
            }
            i += 1;
        }
        Self { code, comment }
    }

    /// 0-based lines whose code opens an `unsafe` block or an `unsafe impl`.
    fn unsafe_lines(&self) -> Vec<usize> {
        (0..self.code.len())
            .filter(|&i| has_unsafe(&self.code[i]))
            .collect()
    }

    /// 0-based line ranges of `#[cfg(test)]` modules written inline (`mod name { .. }`).
    fn test_modules(&self) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        for (i, line) in self.code.iter().enumerate() {
            if line.trim() != "#[cfg(test)]" {
                continue;
            }
            let Some(start) = (i + 1..self.code.len()).find(|&k| !self.code[k].trim().is_empty())
            else {
                continue;
            };
            let head = self.code[start].trim();
            if !(head.starts_with("mod ") || head.starts_with("pub mod ")) || !head.ends_with('{') {
                continue;
            }
            let mut depth = 0i64;
            for k in start..self.code.len() {
                depth += self.code[k].matches('{').count() as i64;
                depth -= self.code[k].matches('}').count() as i64;
                if depth == 0 {
                    out.push(start..k + 1);
                    break;
                }
            }
        }
        out
    }
}

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// One binary runs everywhere and picks its kernel tier at runtime.
#[test]
fn no_target_cpu_native() {
    let config = fs::read_to_string(root().join(".cargo/config.toml")).expect("cargo config");
    let active: String = config
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    assert!(
        !active.contains("target-cpu"),
        "target-cpu must not be set in .cargo/config.toml"
    );
}

/// Libraries take explicit config: only binaries (k3-serve, xtask) read the environment.
#[test]
fn libraries_read_no_environment() {
    let mut bad = Vec::new();
    for file in sources() {
        let path = file.to_string_lossy();
        if !path.contains("/crates/") || path.contains("/k3-serve/") || path.contains("/tests/") {
            continue;
        }
        let text = fs::read_to_string(&file).expect("utf-8 source");
        if text.contains("std::env::var") || text.contains("env::var(") {
            bad.push(file);
        }
    }
    assert!(
        bad.is_empty(),
        "library code reading environment variables: {bad:?}"
    );
}

/// The checks themselves, on small sources: each rule catches what it should and nothing else.
/// (`UNSAFE` and `THREAD` stand for the words, so this file does not trip its own checks.)
#[test]
fn the_checks_catch_what_they_should() {
    let unsafe_bad = |text: &str| {
        let text = text.replace("UNSAFE", "unsafe");
        unsafe_without_safety(&Source::new(&text))
    };
    assert_eq!(
        unsafe_bad("// SAFETY: fine.\nlet a = UNSAFE { f() };"),
        [] as [usize; 0]
    );
    assert_eq!(
        unsafe_bad("let a = UNSAFE { f() }; // SAFETY: fine."),
        [] as [usize; 0]
    );
    // A statement's earlier lines and attributes may sit between.
    assert_eq!(
        unsafe_bad("// SAFETY: fine.\n#[cfg(x)]\nlet p: *const u8 =\n    UNSAFE { g() };"),
        [] as [usize; 0]
    );
    assert_eq!(
        unsafe_bad("// SAFETY: a\n// second line\nUNSAFE impl Send for A {}"),
        [] as [usize; 0]
    );
    // Missing, separated by a blank line or a statement, shared, or too far up.
    assert_eq!(unsafe_bad("let a = UNSAFE { f() };"), [1]);
    assert_eq!(unsafe_bad("// SAFETY: x\n\nlet a = UNSAFE { f() };"), [3]);
    assert_eq!(
        unsafe_bad("// SAFETY: x\nlet a = UNSAFE { f() };\nlet b = UNSAFE { g() };"),
        [3]
    );
    assert_eq!(
        unsafe_bad("// SAFETY: x\nlet a = 1;\nUNSAFE impl Sync for A {}"),
        [3]
    );
    assert_eq!(
        unsafe_bad("// SAFETY: x\n// unrelated\nfoo();\nUNSAFE {}"),
        [4]
    );
    // Not code: strings, chars and comments; not a block: an unsafe fn.
    assert_eq!(
        unsafe_bad("let s = \"UNSAFE { }\";\nlet c = '\\'';\n// UNSAFE { }\nUNSAFE fn f() {}"),
        [] as [usize; 0]
    );
    assert_eq!(
        unsafe_bad("let s = r#\"a \" UNSAFE {\"#;\nlet t = UNSAFE { 1 };"),
        [2]
    );

    let threads = |path: &str, text: &str| {
        let text = text.replace("THREAD", "thread");
        thread_starts(path, &Source::new(&text))
    };
    let lib = "crates/k3-model/src/lib.rs";
    assert_eq!(
        threads(lib, "std::THREAD::spawn(|| ());"),
        [(1, "thread::spawn(")]
    );
    assert_eq!(
        threads(lib, "let t = std::THREAD::Builder::new()\n    .spawn(f);"),
        [(1, "thread::Builder::new(")]
    );
    assert_eq!(threads(lib, "use rayon::prelude::*;"), [(1, "rayon::")]);
    assert_eq!(
        threads(lib, "let s = \"std::THREAD::spawn(\"; // THREAD::spawn("),
        []
    );
    assert_eq!(
        threads(
            lib,
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    fn t() { std::THREAD::spawn(|| ()); }\n}\nfn g() { std::THREAD::spawn(|| ()); }"
        ),
        [(6, "thread::spawn(")]
    );
    assert_eq!(
        threads("crates/numa-sched/src/pool.rs", "std::THREAD::spawn(f);"),
        []
    );
    assert_eq!(
        threads("crates/k3-model/tests/model/a.rs", "std::THREAD::spawn(f);"),
        []
    );
}
