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

/// A FIFO, a link to `/dev/zero` or a directory in place of any of the files: refused at
/// once, naming the file and what it is.
#[test]
fn a_file_that_is_not_a_regular_file_is_named_with_its_kind() {
    let files = [
        "config.json",
        "tiktoken.model",
        "tokenizer_config.json",
        "model.safetensors",
    ];
    for file in files {
        for (special, kind) in [
            ("fifo", FileKind::Fifo),
            ("/dev/zero", FileKind::CharDevice),
            ("dir", FileKind::Directory),
        ] {
            let scratch = k3_testkit::Scratch::new("model-dir-specials");
            let dir = scratch.path().to_owned();
            for name in files.iter().filter(|n| **n != file) {
                std::fs::write(dir.join(name), b"{}").unwrap();
            }
            let path = dir.join(file);
            match special {
                "fifo" => k3_testkit::make_fifo(&path),
                "dir" => std::fs::create_dir(&path).unwrap(),
                _ => std::os::unix::fs::symlink(special, &path).unwrap(),
            }
            let case = format!("{file} as {special}");
            let checked = k3_testkit::promptly(&case, std::time::Duration::from_secs(5), {
                let dir = dir.clone();
                move || check_model_dir(&dir)
            });
            let error = checked.expect_err(&case);
            assert_eq!(
                error.to_string(),
                format!(
                    "--model {}: {file} is {kind}, not a regular file",
                    dir.display()
                ),
                "{case}"
            );
        }
    }
}
