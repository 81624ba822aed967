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
