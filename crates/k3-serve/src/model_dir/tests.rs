//! Tests of `model_dir.rs`: each refusal on a scratch directory.

use std::path::PathBuf;

use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("k3-model-dir-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_missing_path_is_no_such_directory() {
    let error = check_model_dir(Path::new("/nonexistent/model")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "--model /nonexistent/model: no such directory"
    );
}

#[test]
fn a_gguf_file_is_named_by_its_extension_or_its_magic() {
    let dir = scratch("gguf");
    let named = dir.join("model.gguf");
    std::fs::write(&named, b"not even gguf").unwrap();
    let unnamed = dir.join("weights.bin");
    std::fs::write(&unnamed, b"GGUF\x03\0\0\0").unwrap();
    for file in [&named, &unnamed] {
        let error = check_model_dir(file).unwrap_err();
        assert_eq!(error, ModelDirError::Gguf(file.display().to_string()));
        let line = error.to_string();
        assert!(
            line.contains("a GGUF file") && line.contains("hf download"),
            "{line}"
        );
    }
    let other = dir.join("notes.txt");
    std::fs::write(&other, b"hello").unwrap();
    assert!(matches!(
        check_model_dir(&other),
        Err(ModelDirError::NotADirectory(_))
    ));
    // A path through a file is no directory either.
    assert!(matches!(
        check_model_dir(&named.join("sub")),
        Err(ModelDirError::Missing(_))
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_says_which_files_it_lacks() {
    let dir = scratch("partial");
    let error = check_model_dir(&dir).unwrap_err().to_string();
    assert!(
        error.contains(
            "no config.json, tiktoken.model, tokenizer_config.json, \
             model.safetensors.index.json in the directory"
        ),
        "{error}"
    );
    for name in [
        "tiktoken.model",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::write(dir.join(name), b"").unwrap();
    }
    let error = check_model_dir(&dir).unwrap_err();
    assert_eq!(
        error,
        ModelDirError::MissingFiles {
            path: dir.display().to_string(),
            missing: "config.json".into()
        }
    );
    std::fs::write(dir.join("config.json"), b"{}").unwrap();
    assert_eq!(check_model_dir(&dir), Ok(()));
    let _ = std::fs::remove_dir_all(&dir);
}
