//! The checkpoint directory `--model` names, checked before anything reads it
//! ([`check_model_dir`]), so a wrong path, a GGUF file or a partial download is told as what it
//! is rather than as the first file a loader failed to open.

use std::io::Read;
use std::path::Path;

use expert_store::file::{FileKind, kind_at};

/// The layout k3 reads, said after every refusal but a missing path.
const LAYOUT: &str = "k3 reads the Hugging Face release layout, a directory with config.json, \
     tiktoken.model, tokenizer_config.json and the *.safetensors shards with \
     model.safetensors.index.json (`hf download moonshotai/Kimi-K3 --local-dir DIR`, see \
     docs/RELEASE.md)";

/// The files a checkpoint directory must hold besides its weights.
const REQUIRED: [&str; 3] = ["config.json", "tiktoken.model", "tokenizer_config.json"];

/// The weights: the shard index, or a single file.
const WEIGHTS: [&str; 2] = ["model.safetensors.index.json", "model.safetensors"];

/// What GGUF files begin with.
const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// Why `--model DIR` is not a checkpoint directory; each is one line that names the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelDirError {
    /// Nothing is at the path.
    #[error("--model {0}: no such directory")]
    Missing(String),
    /// A GGUF file (by its name or its first bytes): llama.cpp's format, not k3's.
    #[error("--model {0}: a GGUF file, which k3 does not read; {LAYOUT}")]
    Gguf(String),
    /// Something other than a directory.
    #[error("--model {0}: not a directory; {LAYOUT}")]
    NotADirectory(String),
    /// A directory without some of the files a checkpoint needs.
    #[error("--model {path}: no {missing} in the directory; {LAYOUT}")]
    MissingFiles {
        /// The directory.
        path: String,
        /// The files missing, in the layout's order (`config.json, tiktoken.model`).
        missing: String,
    },
    /// One of the checkpoint's files is (or its links lead to) a FIFO, a device, a
    /// directory...: reading it would block, or never end.
    #[error("--model {path}: {file} is {kind}, not a regular file")]
    NotRegular {
        /// The directory.
        path: String,
        /// The file's name in it.
        file: &'static str,
        /// What it is.
        kind: FileKind,
    },
    /// The path could not be looked at (permissions, a loop of links).
    #[error("--model {path}: {reason}")]
    Unreadable {
        /// The path.
        path: String,
        /// What the system said.
        reason: String,
    },
}

/// Checks that `dir` is a checkpoint directory in the release layout: it exists, is a
/// directory (a GGUF file is named as such), and holds `config.json`, the tokenizer's two
/// files and the weights (`model.safetensors.index.json`, or a single `model.safetensors`).
/// Each of those files must be (or its links lead to) a regular file. Only names and types are
/// looked at (a file's first bytes when `dir` is a file), so a FIFO among them does not block
/// the check, and it is refused here, before the readers behind it would wait on it.
pub fn check_model_dir(dir: &Path) -> Result<(), ModelDirError> {
    use std::io::ErrorKind::{NotADirectory, NotFound};
    let shown = dir.display().to_string();
    let meta = match std::fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if matches!(e.kind(), NotFound | NotADirectory) => {
            return Err(ModelDirError::Missing(shown));
        }
        Err(e) => {
            return Err(ModelDirError::Unreadable {
                path: shown,
                reason: e.to_string(),
            });
        }
    };
    if !meta.is_dir() {
        return Err(if meta.is_file() && is_gguf(dir) {
            ModelDirError::Gguf(shown)
        } else {
            ModelDirError::NotADirectory(shown)
        });
    }
    let has = |name: &str| dir.join(name).exists();
    let mut missing: Vec<&str> = REQUIRED.into_iter().filter(|name| !has(name)).collect();
    if !WEIGHTS.into_iter().any(has) {
        missing.push(WEIGHTS[0]);
    }
    if !missing.is_empty() {
        return Err(ModelDirError::MissingFiles {
            path: shown,
            missing: missing.join(", "),
        });
    }
    for file in REQUIRED
        .into_iter()
        .chain(WEIGHTS.into_iter().filter(|f| has(f)))
    {
        // A file removed or unreadable since `has` looked is left to its reader to report.
        if let Ok(Some(kind)) = kind_at(&dir.join(file)) {
            return Err(ModelDirError::NotRegular {
                path: shown,
                file,
                kind,
            });
        }
    }
    Ok(())
}

/// Whether the file at `path` is a GGUF file: named `*.gguf`, or beginning with its magic.
fn is_gguf(path: &Path) -> bool {
    let named = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let mut magic = [0u8; 4];
    named
        || std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok_and(|()| &magic == GGUF_MAGIC)
}

#[cfg(test)]
mod tests;
