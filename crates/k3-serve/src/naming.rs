//! The model's served names: the default one ([`default_served_name`]: the config's model id,
//! else the Hugging Face repo of a cache path, else the directory's name, never a bare commit
//! hash), the aliases `--served-model-name` adds ([`served_names`]), and whether a request's
//! `model` names the model ([`accepts`]).
//!
//! As in vLLM, the first `--served-model-name` is the name the server reports (`/v1/models`
//! lists every name first to last, responses carry the first); unlike vLLM the default name
//! stays accepted, so a request naming the model as the directory or repo does keeps working.

use std::path::{Component, Path};

use serde_json::Value;

/// What a model is served as when nothing better is known.
pub const FALLBACK_NAME: &str = "k3";

/// Config fields that may hold the model's id, tried in order at the top level and then in
/// `text_config` (`transformers`' `save_pretrained` writes `_name_or_path`).
const ID_FIELDS: [&str; 3] = ["_name_or_path", "name_or_path", "model_id"];

/// The name the model in `model_dir` is served as by default: the config's model id (a repo
/// id like `moonshotai/Kimi-K3` as it is, a path by the rules below), else for a Hugging Face
/// cache path `.../models--ORG--NAME/snapshots/<hash>` `ORG/NAME`, else the directory's last
/// component that is neither a commit hash nor `snapshots`, else [`FALLBACK_NAME`].
pub fn default_served_name(model_dir: &Path, config: &Value) -> String {
    let configured = [Some(config), config.get("text_config")]
        .into_iter()
        .flatten()
        .flat_map(|c| ID_FIELDS.iter().filter_map(move |f| c.get(*f)?.as_str()))
        .map(str::trim)
        .find(|id| !id.is_empty());
    if let Some(name) = configured.and_then(name_from_id) {
        return name;
    }
    let absolute = std::path::absolute(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
    name_from_path(&absolute).unwrap_or_else(|| FALLBACK_NAME.to_owned())
}

/// Every name the model answers to, the reported one first: the `--served-model-name`s in
/// order, then the default name; duplicates dropped.
pub fn served_names(default: String, extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = Vec::with_capacity(extra.len() + 1);
    for name in extra.iter().cloned().chain([default]) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Whether a request's `model` names this model: exactly one of `names`.
pub fn accepts(names: &[String], requested: &str) -> bool {
    names.iter().any(|n| n == requested)
}

/// A config id: a repo id (`ORG/NAME` or `NAME`) as it is, anything else as a path.
fn name_from_id(id: &str) -> Option<String> {
    let is_repo_id = !id.starts_with(['.', '/', '~'])
        && id.split('/').count() <= 2
        && id.split('/').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
        && !id.contains("..")
        && !is_commit_hash(id);
    if is_repo_id {
        return Some(id.to_owned());
    }
    name_from_path(Path::new(id))
}

/// A model's name from where it lies (see [`default_served_name`]).
fn name_from_path(path: &Path) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            Component::RootDir | Component::Prefix(_) | Component::CurDir => {}
        }
    }
    // The Hugging Face cache names a repo's folder `models--ORG--NAME` (the `/` as `--`).
    if let Some(repo) = parts
        .iter()
        .rev()
        .find_map(|p| p.strip_prefix("models--"))
        .filter(|r| !r.is_empty())
    {
        return Some(repo.replacen("--", "/", 1));
    }
    parts
        .into_iter()
        .rev()
        .find(|p| !is_commit_hash(p) && p != "snapshots")
}

/// A git commit id as Hugging Face snapshot folders are named: 40 (or 64) hex digits.
fn is_commit_hash(part: &str) -> bool {
    matches!(part.len(), 40 | 64) && part.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn the_config_id_comes_first() {
        let dir = Path::new("/models/whatever");
        let name = |config: Value| default_served_name(dir, &config);
        assert_eq!(
            name(json!({"_name_or_path": "moonshotai/Kimi-K3"})),
            "moonshotai/Kimi-K3"
        );
        assert_eq!(name(json!({"model_id": "kimi-k3"})), "kimi-k3");
        // In `text_config` when the top level has none.
        assert_eq!(
            name(json!({"text_config": {"_name_or_path": "org/m"}})),
            "org/m"
        );
        // A path-like id by the path rules.
        assert_eq!(
            name(json!({"_name_or_path": "/home/u/train/out/Kimi-K3-ft"})),
            "Kimi-K3-ft"
        );
        assert_eq!(
            name(json!({"_name_or_path": format!(
                "/root/.cache/huggingface/hub/models--moonshotai--Kimi-K3/snapshots/{HASH}"
            )})),
            "moonshotai/Kimi-K3"
        );
        // An empty id, or none: the directory.
        assert_eq!(name(json!({"_name_or_path": " "})), "whatever");
        assert_eq!(name(json!({"model_type": "kimi_k3"})), "whatever");
    }

    #[test]
    fn the_release_configs_have_no_id_so_the_directory_names_the_model() {
        // The release's config.json (as in crates/k3-model/configs) carries no `_name_or_path`.
        let config = json!({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}});
        assert_eq!(
            default_served_name(Path::new("/models/Kimi-K3"), &config),
            "Kimi-K3"
        );
    }

    #[test]
    fn a_hugging_face_cache_path_is_served_as_its_repo() {
        let config = json!({});
        for dir in [
            format!("/root/.cache/huggingface/hub/models--moonshotai--Kimi-K3/snapshots/{HASH}"),
            format!("/root/.cache/huggingface/hub/models--moonshotai--Kimi-K3/snapshots/{HASH}/"),
            "/hub/models--moonshotai--Kimi-K3".to_owned(),
        ] {
            assert_eq!(
                default_served_name(Path::new(&dir), &config),
                "moonshotai/Kimi-K3",
                "{dir}"
            );
        }
        assert_eq!(
            default_served_name(Path::new("/hub/models--gpt2/snapshots/x"), &config),
            "gpt2"
        );
    }

    #[test]
    fn a_hash_directory_is_never_the_name() {
        let config = json!({});
        assert_eq!(
            default_served_name(Path::new(&format!("/srv/kimi/snapshots/{HASH}")), &config),
            "kimi"
        );
        assert_eq!(
            default_served_name(Path::new(&format!("/{HASH}")), &config),
            FALLBACK_NAME
        );
        assert_eq!(
            default_served_name(Path::new("/srv/tiny/./sub/.."), &config),
            "tiny"
        );
        // A relative directory is named from where it resolves.
        let cwd = std::env::current_dir().unwrap();
        let expected = cwd.file_name().map_or(FALLBACK_NAME.to_owned(), |n| {
            n.to_string_lossy().into_owned()
        });
        if !is_commit_hash(&expected) {
            assert_eq!(default_served_name(Path::new("."), &config), expected);
        }
    }

    #[test]
    fn aliases_come_first_and_the_default_stays_accepted() {
        let names = served_names(
            "moonshotai/Kimi-K3".into(),
            &["kimi-k3".into(), "k3".into(), "kimi-k3".into()],
        );
        assert_eq!(names, ["kimi-k3", "k3", "moonshotai/Kimi-K3"]);
        for requested in ["kimi-k3", "k3", "moonshotai/Kimi-K3"] {
            assert!(accepts(&names, requested), "{requested}");
        }
        assert!(!accepts(&names, "Kimi-K3"));
        assert!(!accepts(&names, "gpt-4o"));
        assert_eq!(served_names("d".into(), &[]), ["d"]);
    }
}
