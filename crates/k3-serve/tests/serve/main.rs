//! Integration tests of k3-serve: the router without sockets (every endpoint and error
//! class), the binary on a loopback port driven by a plain HTTP client, its command line, and
//! the first examples of the docs pages about it.

mod cli;
mod docs;
mod e2e;
mod fuzz;
mod http_layer;
mod output_text;
mod prompt_cache_files;
mod prompt_cache_log;
mod queue;
mod router;
mod spec_log;
mod speculative;
mod status_counts;
mod steps;
mod structured;
mod validation;

use std::path::PathBuf;
use std::sync::OnceLock;

/// The `tiny` synthetic checkpoint, generated once per test binary.
pub(crate) fn tiny() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("k3-serve-tiny-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
        k3_model::synth::generate(&dir, &options).unwrap();
        dir
    })
    .clone()
}
