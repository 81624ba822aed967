//! The docs' facts that a command can check, checked: the release's download command, as
//! huggingface_hub's own CLI parses it (frozen by `cargo xtask oracle-hf-download`), selects
//! every text shard and every file `--model` needs, and no vision shard, and the docs still give
//! exactly that command; docs/RELEASE.md's quote of `k3-plan` is what it prints; the xtask
//! pages' first examples run; the README's first screen stays short and links every page.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits below the root")
        .to_owned()
}

/// README.md and every page in docs/.
fn docs() -> Vec<(PathBuf, String)> {
    let mut pages = vec![root().join("README.md")];
    let mut more: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    pages.extend(more);
    pages
        .into_iter()
        .map(|p| {
            let text = fs::read_to_string(&p).expect("a readable page");
            (p, text)
        })
        .collect()
}

/// Each `hf download moonshotai/Kimi-K3` command in `text`, its `\` continuation lines joined
/// by single spaces (as `cargo xtask oracle-hf-download` reads it).
fn download_commands(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i]
            .trim_start()
            .starts_with("hf download moonshotai/Kimi-K3")
        {
            let mut parts = Vec::new();
            while i < lines.len() {
                let line = lines[i].trim();
                match line.strip_suffix('\\') {
                    Some(head) => parts.push(head.trim().to_owned()),
                    None => {
                        parts.push(line.to_owned());
                        break;
                    }
                }
                i += 1;
            }
            out.push(parts.join(" "));
        }
        i += 1;
    }
    out
}

#[test]
fn the_download_command_selects_every_text_shard_and_no_vision_shard() {
    let dir = root().join("xtask/tests/data/hf_download");
    let bytes = fs::read(dir.join("parsed.json")).expect("the frozen parse");
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let sidecar = fs::read_to_string(dir.join("parsed.json.sha256")).unwrap();
    assert!(
        sidecar.starts_with(&digest),
        "parsed.json does not match its sha256"
    );
    let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();

    // The docs give exactly the command that was parsed.
    let commands: Vec<(PathBuf, String)> = docs()
        .into_iter()
        .flat_map(|(p, text)| {
            download_commands(&text)
                .into_iter()
                .map(move |c| (p.clone(), c))
        })
        .collect();
    assert_eq!(
        commands.len(),
        1,
        "one download command in the docs: {commands:?}"
    );
    assert_eq!(
        parsed["command"],
        commands[0].1,
        "{} changed the command: run `cargo xtask oracle-hf-download`",
        commands[0].0.display()
    );

    // huggingface_hub took it as patterns, without a warning.
    assert_eq!(parsed["call"], "snapshot_download", "{parsed}");
    assert_eq!(parsed["warnings"], serde_json::json!([]), "{parsed}");
    let selected: Vec<&str> = parsed["selected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for shard in 1..=94 {
        let name = format!("model-{shard:05}-of-000096.safetensors");
        assert!(
            selected.contains(&name.as_str()),
            "text shard {name} not selected"
        );
    }
    for shard in [95, 96] {
        let name = format!("model-{shard:05}-of-000096.safetensors");
        assert!(
            !selected.contains(&name.as_str()),
            "vision shard {name} selected"
        );
    }
    // What `--model` reads.
    for needed in [
        "model.safetensors.index.json",
        "config.json",
        "tiktoken.model",
        "tokenizer_config.json",
    ] {
        assert!(selected.contains(&needed), "{needed} not selected");
    }
}

/// The extraction joins continuation lines and finds every command.
#[test]
fn download_commands_are_read_whole() {
    let text = "x\n```sh\n  hf download moonshotai/Kimi-K3 --local-dir D \\\n    --include \"a\" \\\n    --exclude \"b\"\n```\nhf download moonshotai/Kimi-K3 c\n";
    assert_eq!(
        download_commands(text),
        [
            "hf download moonshotai/Kimi-K3 --local-dir D --include \"a\" --exclude \"b\"",
            "hf download moonshotai/Kimi-K3 c"
        ]
    );
}

/// The xtask binary with `args`, from the root: its stdout, after checking it succeeded.
fn xtask(args: &[String]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("xtask starts");
    assert!(
        output.status.success(),
        "xtask {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// `page`'s quote of `k3-plan`: the arguments in its opening marker
/// (`<!-- k3-plan ARGS -->`) and the lines of the `text` block up to `<!-- end k3-plan -->`.
fn k3_plan_quote(page: &str) -> (Vec<String>, Vec<String>) {
    let mut lines = page.lines();
    let args = lines
        .by_ref()
        .find_map(|l| l.strip_prefix("<!-- k3-plan ")?.strip_suffix(" -->"))
        .expect("a `<!-- k3-plan ARGS -->` marker");
    let block: Vec<String> = lines
        .take_while(|l| *l != "<!-- end k3-plan -->")
        .map(str::to_owned)
        .collect();
    assert_eq!(
        block.first().map(String::as_str),
        Some("```text"),
        "{block:?}"
    );
    assert_eq!(block.last().map(String::as_str), Some("```"), "{block:?}");
    let args = args.split_whitespace().map(str::to_owned).collect();
    (args, block[1..block.len() - 1].to_vec())
}

/// docs/RELEASE.md opens with `cargo xtask k3-plan` and quotes what it prints from its
/// projection on (the table, disk, least memory, start times) between markers; the quote is
/// the command's output now, so the release's figures cannot go stale.
#[test]
fn the_release_page_quotes_k3_plan_as_it_prints_now() {
    let page = fs::read_to_string(root().join("docs/RELEASE.md")).expect("docs/RELEASE.md");
    let (args, quoted) = k3_plan_quote(&page);
    let first = k3_cli::first_sh_block(&page);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(
        k3_cli::args_after(&first[0], "cargo xtask k3-plan"),
        args,
        "the page's first example is the command it quotes"
    );
    let mut command = vec!["k3-plan".to_owned()];
    command.extend(args);
    let output = xtask(&command);
    let mut printed: Vec<&str> = output
        .lines()
        .skip_while(|l| !l.starts_with("projection: "))
        .collect();
    while printed.last().is_some_and(|l| l.trim().is_empty()) {
        printed.pop();
    }
    assert!(!printed.is_empty(), "no projection in:\n{output}");
    assert_eq!(
        quoted, printed,
        "docs/RELEASE.md's k3-plan quote is stale: paste the output from `projection:` on"
    );
}

/// docs/DEVELOPING.md opens by generating the tiny checkpoint and checking it; both run, and
/// the check ends with the line the page quotes.
#[test]
fn the_developing_page_first_example_generates_and_checks() {
    let page = fs::read_to_string(root().join("docs/DEVELOPING.md")).expect("docs/DEVELOPING.md");
    let commands = k3_cli::first_sh_block(&page);
    assert_eq!(commands.len(), 2, "{commands:?}");
    let out = std::env::temp_dir().join(format!("k3-xtask-docs-{}", std::process::id()));
    let _ = fs::remove_dir_all(&out);
    let mut last = String::new();
    for command in &commands {
        let args: Vec<String> = k3_cli::args_after(command, "cargo xtask")
            .into_iter()
            .map(|a| a.replace("/tmp/k3-tiny", out.to_str().unwrap()))
            .collect();
        assert!(
            args.iter().any(|a| a.starts_with(out.to_str().unwrap())),
            "{args:?}"
        );
        last = xtask(&args);
    }
    let _ = fs::remove_dir_all(&out);
    let checked = last.lines().last().unwrap_or_default();
    // The page quotes the line up to the experts' details, wrapped.
    let flat: String = page.split_whitespace().collect::<Vec<_>>().join(" ");
    let quoted = flat
        .split_once("`/tmp/k3-tiny: valid — ")
        .and_then(|(_, rest)| rest.split_once(" (...)"))
        .map(|(quoted, _)| quoted)
        .expect("the page quotes the check's last line");
    assert!(
        checked.starts_with(&format!("{}: valid — {quoted} (", out.display())),
        "k3-check ended with {checked:?}; the page quotes {quoted:?}"
    );
}

/// README.md: its first screen (what it is, the two commands, what you see) ends within 40
/// lines, at the contents, which link every docs page.
#[test]
fn the_readme_opens_short_and_links_every_page() {
    let readme = fs::read_to_string(root().join("README.md")).expect("README.md");
    let before = readme
        .lines()
        .position(|l| l == "## Contents")
        .expect("a `## Contents` heading");
    assert!(
        before <= 40,
        "README.md's first screen is {before} lines: 40 at most before the contents"
    );
    let first = k3_cli::first_sh_block(&readme);
    assert_eq!(
        first,
        [
            "cargo run --release -p k3-serve -- --prompt \"Write a haiku about memory bandwidth.\"",
            "cargo test --workspace"
        ],
        "the README opens with the two commands"
    );
    let contents = &readme[readme.find("## Contents").unwrap()..];
    for (page, _) in docs().into_iter().skip(1) {
        let name = page.file_name().unwrap().to_str().unwrap();
        assert!(
            contents.contains(&format!("(docs/{name})")),
            "the contents do not link docs/{name}"
        );
    }
    for page in ["PERFORMANCE.md", "CHANGELOG.md"] {
        assert!(contents.contains(&format!("({page})")), "{page} not linked");
    }
}

/// GitHub's anchor for a heading: lower case, spaces as `-`, punctuation but `-` and `_` gone.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every relative link of README.md and docs/ (`[text](path#anchor)`) names a file that exists
/// and, with an anchor, a heading of it.
#[test]
fn the_docs_links_resolve() {
    let mut broken = Vec::new();
    for (page, text) in docs() {
        let dir = page.parent().unwrap();
        for (at, _) in text.match_indices("](") {
            let rest = &text[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains("://") || target.contains(' ') {
                continue;
            }
            let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
            let linked = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            let Ok(linked_text) = fs::read_to_string(&linked) else {
                broken.push(format!("{}: {target}", page.display()));
                continue;
            };
            let headings = linked_text
                .lines()
                .filter_map(|l| {
                    l.trim_start_matches('#')
                        .strip_prefix(' ')
                        .filter(|_| l.starts_with('#'))
                })
                .map(anchor)
                .collect::<Vec<_>>();
            if !fragment.is_empty() && !headings.iter().any(|h| h == fragment) {
                broken.push(format!("{}: {target} (no such heading)", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links: {broken:#?}");
    assert_eq!(anchor("Several hosts (MPI)"), "several-hosts-mpi");
}
