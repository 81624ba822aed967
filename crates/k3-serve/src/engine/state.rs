//! The one-shot run's state files (`--load-state FILE`, `--save-state FILE`): a job may start
//! from a saved session state, when its prompt extends the tokens the state covers, and may
//! write its session's state once its answer is complete (the prompt and every output token
//! but the last: what the session has consumed). The files are k3-model's checksummed snapshot
//! files, refused when they come from another checkpoint or engine.

use std::path::{Path, PathBuf};

use k3_model::model::snapshot::file::{self, Identity};
use k3_model::model::{Model, Session};

/// A job's state files; both `None` for every request the server takes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateFiles {
    /// Restore this state before the prompt; the prompt must extend its tokens.
    pub load: Option<PathBuf>,
    /// Write the session's state here once the answer is complete.
    pub save: Option<PathBuf>,
}

/// Restores `path` into `session` (fresh) when `prompt` extends the tokens it covers by at
/// least one token (the first output token is sampled from the last prompt token's logits);
/// returns the tokens restored.
pub(super) fn load(
    path: &Path,
    identity: &Identity,
    model: &Model<'_>,
    session: &mut Session,
    prompt: &[usize],
) -> Result<usize, String> {
    let shown = path.display();
    // A file the user names may be reached through links (the prompt cache's own files may
    // not); what it resolves to must still be a regular file, opened without blocking.
    let resolved = std::fs::canonicalize(path).map_err(|e| format!("--load-state {shown}: {e}"))?;
    let (header, snapshot) =
        file::load(&resolved, identity).map_err(|e| format!("--load-state {shown}: {e}"))?;
    let saved: Vec<usize> = header.tokens.iter().map(|&t| t as usize).collect();
    if let Some(at) = saved.iter().zip(prompt).position(|(a, b)| a != b) {
        return Err(format!(
            "--load-state {shown}: the prompt does not extend the saved tokens: they differ at \
             token {at} (saved {}, prompt {}); the state covers {} tokens",
            saved[at],
            prompt[at],
            saved.len()
        ));
    }
    if prompt.len() <= saved.len() {
        return Err(format!(
            "--load-state {shown}: the prompt ({} tokens) must extend the {} saved tokens by at \
             least one token",
            prompt.len(),
            saved.len()
        ));
    }
    model
        .restore(session, &snapshot)
        .map_err(|e| format!("--load-state {shown}: {e}"))?;
    Ok(saved.len())
}

/// Writes `session`'s state, which covers `fed`, to `path`; returns a line saying so.
pub(super) fn save(
    path: &Path,
    identity: &Identity,
    session: &Session,
    fed: &[usize],
) -> Result<String, String> {
    let snapshot = session.snapshot();
    let report = file::save(path, identity, fed, &snapshot)
        .map_err(|e| format!("--save-state {}: {e}", path.display()))?;
    Ok(format!(
        "state of {} tokens saved to {} ({} bytes{})",
        fed.len(),
        path.display(),
        snapshot.bytes(),
        report
            .fallback
            .map(|why| format!("; buffered writes: {why}"))
            .unwrap_or_default()
    ))
}
