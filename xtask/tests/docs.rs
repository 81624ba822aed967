//! The docs' facts that a command can check, checked: the release's download command, as
//! huggingface_hub's own CLI parses it (frozen by `cargo xtask oracle-hf-download`), selects
//! every text shard and every file `--model` needs, and no vision shard; and the docs still give
//! exactly that command.

use std::fs;
use std::path::{Path, PathBuf};

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
