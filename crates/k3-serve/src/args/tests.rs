//! Tests of `args.rs`: the command line as the binary reads it.

use super::*;

fn args(line: &[&str]) -> Result<Args, UsageError> {
    let table = cli::k3_serve_flags();
    parse(&table, line.iter().map(|a| a.to_string())).map(|a| a.expect("not --help"))
}

#[test]
fn llama_server_slots_are_the_batch() {
    for line in [
        &["--serve", "-np", "3"][..],
        &["--serve", "--parallel", "3"],
    ] {
        assert_eq!(args(line).unwrap().engine.max_batch, 3, "{line:?}");
    }
    assert_eq!(
        args(&["--serve", "--max-batch=5"])
            .unwrap()
            .engine
            .max_batch,
        5
    );
}

#[test]
fn a_model_that_is_no_checkpoint_directory_is_a_usage_error() {
    let Err(error) = args(&["--serve", "-m", "/nonexistent/model"]) else {
        panic!("a missing model directory was accepted");
    };
    assert_eq!(
        error.to_string(),
        "--model /nonexistent/model: no such directory"
    );
}

/// A FIFO or a link to `/dev/zero` as `--api-key-file`, `--json-schema` or `--grammar`: a
/// usage error at once, naming the flag, the path and what it is.
#[test]
fn a_fifo_or_a_device_as_a_flags_file_is_refused_at_once() {
    let scratch = k3_testkit::Scratch::new("args-specials");
    for special in ["fifo", "/dev/zero"] {
        let path = scratch.path().join("flag-file");
        let kind = k3_testkit::replace_with_special(&path, special);
        let path = path.display().to_string();
        for (mode, flag) in [
            ("--serve", "--api-key-file"),
            ("--prompt=hi", "--json-schema"),
            ("--prompt=hi", "--grammar"),
        ] {
            let case = format!("{flag} {path}");
            let parsed = k3_testkit::promptly(&case, std::time::Duration::from_secs(5), {
                let (flag, path) = (flag.to_owned(), path.clone());
                move || args(&[mode, &flag, &path]).map(|_| ())
            });
            let Err(error) = parsed else {
                panic!("{case}: accepted");
            };
            assert_eq!(
                error.to_string(),
                format!("{flag} {path} is {kind}, not a regular file")
            );
        }
    }
}

/// A key that no `Authorization` header can carry (a NUL or a space inside) is refused at
/// startup, by its place and never echoed; keys are trimmed, so a padded line is its key.
#[test]
fn an_api_key_no_header_can_carry_is_refused() {
    let scratch = k3_testkit::Scratch::new("args-keys");
    let file = scratch.path().join("keys");
    std::fs::write(&file, "  padded-key  \nsk-ok\n").unwrap();
    let file = file.display().to_string();
    let parsed = args(&["--serve", "--api-key", "first", "--api-key-file", &file]).unwrap();
    assert_eq!(parsed.api_keys, ["first", "padded-key", "sk-ok"]);
    let bad = scratch.path().join("bad");
    std::fs::write(&bad, "sk-ok\nsk-with\0nul\n").unwrap();
    let bad = bad.display().to_string();
    for line in [
        &["--serve", "--api-key-file", bad.as_str()][..],
        &["--serve", "--api-key", "two words"],
    ] {
        let error = args(line).map(|_| ()).unwrap_err().to_string();
        assert!(
            error.contains("API key") && error.contains("control character or a space"),
            "{error}"
        );
        assert!(
            !error.contains("nul") && !error.contains("words"),
            "never echoed: {error}"
        );
    }
}

/// `--prompt-cache-dir ""` is refused: it names no directory (it used to spill every
/// snapshot into the working directory).
#[test]
fn an_empty_prompt_cache_dir_is_refused() {
    let error = args(&["--serve", "--prompt-cache-dir", ""])
        .map(|_| ())
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "--prompt-cache-dir : an empty path names no directory"
    );
}
