//! k3-serve under `mpirun`: the part of every rank but 0,
//! which runs the forward pass on its share of the rows and nothing else (rank 0 holds the
//! HTTP server, the tokenizer, the sequences and sampling).

use std::path::Path;

use anyhow::Result;
use k3_model::builder::{Engine, EngineOptions};
use k3_model::config::K3Config;

/// A rank other than 0: builds the engine with the same flags (its build lines unprinted),
/// prints its startup line, and runs rank 0's steps until rank 0's model goes away. It
/// ignores SIGTERM and SIGINT: rank 0 decides when the job ends.
pub(crate) fn follow(model_dir: &Path, options: &EngineOptions) -> Result<()> {
    // Shutdown is rank 0's to lead: `mpirun` passes a SIGTERM on to every rank, and rank 0
    // finishes its open streams before it drops its model, which ends this loop. A rank that
    // died on the signal would abort the job under rank 0's feet.
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: signal(2) with SIG_IGN installs no handler code; nothing else in this
        // process sets these dispositions.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
    let text = k3_model::config::read_config_text(model_dir)?;
    let config = K3Config::from_json(&text)?;
    let engine = Engine::build(model_dir, config, options, &mut |_: &str| {})
        .map_err(|e| anyhow::anyhow!(k3_cli::with_flags(&e)))?;
    eprintln!(
        "{}",
        engine.rank_share(&options.ranks).describe(&options.ranks)
    );
    let model = engine.model()?;
    model.follow()?;
    Ok(())
}
