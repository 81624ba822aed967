//! The command line as [`Args`]: the flag table's values (`k3_serve::cli`), checked against
//! each other and against what they name (the model directory, `--prompt-cache-dir`,
//! `--api-key-file`) before anything is loaded; a mistake is one line and exit 2
//! ([`usage_exit`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use expert_store::file::read_regular_text;
use k3_model::builder::EngineOptions;
use k3_model::builder::PackCachePlace;
use k3_model::chat::ThinkingEffort;
use k3_serve::cli::{self, Flag, Parsed, UsageError};
use k3_serve::conn::ConnLimits;
use k3_serve::engine::{SpecOptions, StateFiles};
use k3_serve::model_dir::check_model_dir;
use k3_structured::Spec;

use crate::startup::user_cache_dir;

/// The most bytes `--api-key-file` may hold: a thousand keys of a hundred bytes are 100 KB,
/// and a path that names something else by mistake is not read whole.
const MAX_API_KEY_FILE_BYTES: u64 = 1 << 20;
/// The most bytes `--json-schema` or `--grammar` may hold: real schemas and grammars are KBs
/// (llguidance's own compile limits stop far smaller ones), so this only stops a wrong path
/// from being read whole.
const MAX_CONSTRAINT_FILE_BYTES: u64 = 16 << 20;

/// The binary's name in `--help`, `--version` and usage errors.
const BINARY: &str = "k3-serve";
const VERSION: &str = env!("CARGO_PKG_VERSION");

pub(crate) struct Args {
    pub(crate) model: Option<PathBuf>,
    pub(crate) serve: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
    /// What the engine is built with: the library flags, `--scan`, `--max-batch`, `--ctx`.
    pub(crate) engine: EngineOptions,
    pub(crate) queue: usize,
    /// `--step-tokens`: tokens one engine step feeds at most.
    pub(crate) step_tokens: usize,
    pub(crate) conn: ConnLimits,
    pub(crate) prompt: Option<String>,
    /// `--raw`: the one-shot prompt is plain text, not a user message.
    pub(crate) raw: bool,
    /// `--load-state`, `--save-state` (one-shot only).
    pub(crate) state: StateFiles,
    /// `--max-tokens`: the one-shot run's tokens, the server's default.
    pub(crate) max_tokens: Option<usize>,
    /// One-shot only (the server takes each request's).
    pub(crate) temperature: f32,
    pub(crate) seed: u64,
    /// Thinking when nothing else says (`--no-think` turns it off).
    pub(crate) thinking: bool,
    /// The chat template's `thinking_effort` for requests that give none.
    pub(crate) thinking_effort: ThinkingEffort,
    /// `--api-key` (each), `K3_API_KEY` and the lines of `--api-key-file`.
    pub(crate) api_keys: Vec<String>,
    pub(crate) served_model_names: Vec<String>,
    /// `--prompt-cache-gb` (`None`: the default share of the memory budget).
    pub(crate) prompt_cache_gb: Option<f64>,
    pub(crate) prompt_cache_dir: Option<PathBuf>,
    /// `--json-schema FILE` or `--grammar FILE` (one-shot): the answer's constraint, read,
    /// and the flag that gave it.
    pub(crate) constraint: Option<(Spec, &'static str)>,
    /// `--max-constraint-compile-ms`.
    pub(crate) max_compile: Duration,
    /// `--max-mask-ms`.
    pub(crate) max_mask: Duration,
    /// `--spec`, `--spec-max-draft`, `--spec-cache-mb`.
    pub(crate) spec: SpecOptions,
}

/// The command line (without the program name) as [`Args`]; `None` when `--help` or
/// `--version` was printed.
pub(crate) fn parse(
    table: &[Flag],
    args: impl IntoIterator<Item = String>,
) -> Result<Option<Args>, UsageError> {
    let Some(mut p) = k3_cli::parse_or_answer(table, BINARY, VERSION, args)? else {
        return Ok(None);
    };
    p.fill_from_env(table, |var| std::env::var(var).ok())?;
    let mut engine = EngineOptions {
        scan: p.switch("scan"),
        max_batch: p.get_or_default(table, "max-batch")?,
        ctx: p.get_or_default(table, "ctx")?,
        ..EngineOptions::default()
    };
    cli::apply_library_flags(&p, &mut engine)?;
    if engine.pack_cache == PackCachePlace::Auto(None) {
        // Where the checkpoint's directory is read-only, the pack cache goes to the user's.
        engine.pack_cache = PackCachePlace::Auto(Some(user_cache_dir().join("k3")));
    }
    let seconds = |name: &str| -> Result<Duration, UsageError> {
        Ok(Duration::from_secs_f64(p.get_or_default(table, name)?))
    };
    let millis = |name: &str| -> Result<Duration, UsageError> {
        Ok(Duration::from_secs_f64(
            p.get_or_default::<f64>(table, name)? / 1e3,
        ))
    };
    let a = Args {
        model: p.get_str("model").map(PathBuf::from),
        serve: p.switch("serve"),
        host: p.get_or_default(table, "host")?,
        port: p.get_or_default(table, "port")?,
        engine,
        queue: p.get_or_default(table, "queue")?,
        step_tokens: p.get_or_default(table, "step-tokens")?,
        conn: ConnLimits {
            header: seconds("header-timeout-s")?,
            body: seconds("body-timeout-s")?,
            idle: seconds("idle-timeout-s")?,
            max_connections: p.get_or_default(table, "max-connections")?,
        },
        prompt: p.get_str("prompt").map(str::to_owned),
        raw: p.switch("raw"),
        state: StateFiles {
            load: p.get_str("load-state").map(PathBuf::from),
            save: p.get_str("save-state").map(PathBuf::from),
        },
        max_tokens: p.get_usize("max-tokens")?,
        temperature: p.get_f32("temperature")?.unwrap_or(0.0),
        seed: p.get_u64("seed")?.unwrap_or(0),
        thinking: !p.switch("no-think"),
        thinking_effort: p.get_or_default(table, "thinking-effort")?,
        api_keys: api_keys(&p)?,
        served_model_names: p
            .all("served-model-name")
            .into_iter()
            .map(str::to_owned)
            .collect(),
        prompt_cache_gb: p.get_f64("prompt-cache-gb")?,
        prompt_cache_dir: p.get_str("prompt-cache-dir").map(PathBuf::from),
        constraint: one_shot_constraint(&p)?,
        max_compile: millis("max-constraint-compile-ms")?,
        max_mask: millis("max-mask-ms")?,
        spec: SpecOptions {
            ngram: p.get_or_default::<String>(table, "spec")? == "ngram",
            max_draft: p.get_or_default(table, "spec-max-draft")?,
            cache_bytes: p
                .get_or_default::<usize>(table, "spec-cache-mb")?
                .saturating_mul(1 << 20),
        },
    };
    check_mode(&p, &a)?;
    if let Some(dir) = &a.model {
        check_model_dir(dir).map_err(|e| UsageError::Other(e.to_string()))?;
    }
    if let (true, Some(dir)) = (a.serve, &a.prompt_cache_dir) {
        check_prompt_cache_dir(dir)?;
    }
    Ok(Some(a))
}

/// Every `--api-key` (or `K3_API_KEY`), then the keys in `--api-key-file` (one per line,
/// trimmed; blank lines skipped). A file that cannot be read, is not a regular file (a FIFO,
/// a device) or is over [`MAX_API_KEY_FILE_BYTES`], or holds no key, is a usage error.
fn api_keys(p: &Parsed) -> Result<Vec<String>, UsageError> {
    let mut keys: Vec<String> = p.all("api-key").into_iter().map(str::to_owned).collect();
    if let Some(path) = p.get_str("api-key-file") {
        let text = read_regular_text(Path::new(path), MAX_API_KEY_FILE_BYTES)
            .map_err(|e| UsageError::Other(format!("--api-key-file {e}")))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .map(str::to_owned),
        );
        if keys.len() == before {
            return Err(UsageError::Other(format!(
                "--api-key-file {path} holds no key (one key per line)"
            )));
        }
    }
    // A key with a control character (a NUL, say) or a space inside can never arrive in an
    // `Authorization: Bearer` header, so it would lock its tenant out for good: refused, named
    // by its place (never echoed).
    if let Some(at) = keys
        .iter()
        .position(|k| k.chars().any(|c| c.is_control() || c.is_whitespace()))
    {
        return Err(UsageError::Other(format!(
            "API key {} of {} (--api-key, K3_API_KEY, then --api-key-file's lines) holds a \
             control character or a space, which no Authorization header can carry",
            at + 1,
            keys.len()
        )));
    }
    Ok(keys)
}

/// `--json-schema FILE` (a JSON Schema) or `--grammar FILE` (llguidance's Lark), read: the
/// one-shot answer's constraint. A file that cannot be read, is not a regular file or is over
/// [`MAX_CONSTRAINT_FILE_BYTES`], or a schema that is not JSON, is a usage error; what the
/// library makes of it is checked when it compiles.
fn one_shot_constraint(p: &Parsed) -> Result<Option<(Spec, &'static str)>, UsageError> {
    let read = |flag: &str, path: &str| {
        read_regular_text(Path::new(path), MAX_CONSTRAINT_FILE_BYTES)
            .map_err(|e| UsageError::Other(format!("--{flag} {e}")))
    };
    match (p.get_str("json-schema"), p.get_str("grammar")) {
        (Some(_), Some(_)) => Err(UsageError::Other(
            "--json-schema and --grammar each constrain the answer: give one of them".into(),
        )),
        (Some(path), None) => {
            let schema = serde_json::from_str(&read("json-schema", path)?)
                .map_err(|e| UsageError::Other(format!("--json-schema {path}: not JSON: {e}")))?;
            Ok(Some((Spec::JsonSchema(schema), "--json-schema")))
        }
        (None, Some(path)) => Ok(Some((Spec::Lark(read("grammar", path)?), "--grammar"))),
        (None, None) => Ok(None),
    }
}

/// The flags that belong to one mode, given in the other.
fn check_mode(p: &Parsed, a: &Args) -> Result<(), UsageError> {
    match (a.serve, &a.prompt) {
        (false, None) => Err(UsageError::Other(
            "give --prompt TEXT for a one-shot generation, or --serve to start the server; see --help".into(),
        )),
        (true, Some(_)) => Err(UsageError::Other(
            "--prompt is for a one-shot run and --serve starts the server: give one of them".into(),
        )),
        (true, None) => {
            for name in [
                "temperature",
                "seed",
                "raw",
                "load-state",
                "save-state",
                "json-schema",
                "grammar",
            ] {
                if p.has(name) {
                    return Err(UsageError::Other(format!(
                        "--{name} is for a one-shot run; the server takes each request's {name}"
                    )));
                }
            }
            Ok(())
        }
        (false, Some(_)) => {
            for name in [
                "served-model-name",
                "host",
                "port",
                "max-connections",
                "queue",
                "prompt-cache-gb",
                "prompt-cache-dir",
                "api-key-file",
            ] {
                if p.has(name) {
                    log::warn!("--{name} applies to the server (--serve) and is ignored by a one-shot run");
                }
            }
            Ok(())
        }
    }
}

/// `--prompt-cache-dir`: a directory, or a path the engine can make one (its parent is a
/// directory: the engine creates the last directory only, so a mistyped path is not built).
/// Checked here, before the model loads, which would otherwise come first and the cache's
/// failure only as a warning after it.
fn check_prompt_cache_dir(dir: &Path) -> Result<(), UsageError> {
    use std::io::ErrorKind::{NotADirectory, NotFound};
    let refuse = |why: String| {
        Err(UsageError::Other(format!(
            "--prompt-cache-dir {}: {why}",
            dir.display()
        )))
    };
    // An empty value (an unset variable in a template, say) names no directory: taken as
    // given it put every snapshot in the working directory.
    if dir.as_os_str().is_empty() {
        return refuse("an empty path names no directory".into());
    }
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => return refuse("exists and is not a directory".into()),
        Err(e) if !matches!(e.kind(), NotFound | NotADirectory) => return refuse(e.to_string()),
        Err(_) => {}
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let shown = parent.display();
    match std::fs::metadata(parent) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => refuse(format!("its parent {shown} is not a directory")),
        Err(e) if e.kind() == NotADirectory => {
            refuse(format!("its parent {shown} is not a directory"))
        }
        Err(e) if e.kind() == NotFound => refuse(format!(
            "its parent {shown} does not exist (only the last directory is created)"
        )),
        Err(e) => refuse(format!("its parent {shown}: {e}")),
    }
}

/// A usage error: one line, exit 2, whatever `RUST_BACKTRACE` says.
pub(crate) fn usage_exit(message: impl std::fmt::Display) -> ! {
    eprintln!("{BINARY}: {message}");
    std::process::exit(2);
}

#[cfg(test)]
mod tests;
