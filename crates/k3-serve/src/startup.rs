//! What the process sets up before it serves: the open-files limit, the prompt cache's budget
//! (logged), and the default `tiny` checkpoint in the user's cache directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use k3_serve::engine::PromptCacheOptions;

/// Raises the soft limit on open files to the hard one, as servers do (each connection is a
/// descriptor), and returns the limit in force.
pub(crate) fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live, writable one.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` through a pointer to a live one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur)
}

/// The prompt cache `--prompt-cache-gb` (`gb`) and `--prompt-cache-dir` (`dir`) ask for;
/// without `--prompt-cache-gb`, a tenth of the memory budget (`--memory-gb`, given as
/// `memory_bytes`, else the memory this process may allocate at startup; 1 GB where that
/// cannot be read). The choice is logged, in GB (10^9 bytes) as every size the startup log
/// gives; the engine's memory plan sets these bytes aside
/// (`EngineOptions::prompt_cache_bytes`).
pub(crate) fn prompt_cache_options(
    memory_bytes: Option<u64>,
    gb: Option<f64>,
    dir: Option<PathBuf>,
) -> PromptCacheOptions {
    const GB: f64 = 1e9;
    let budget = match memory_bytes {
        Some(bytes) => Some(expert_store::io::MemoryBudget {
            bytes,
            source: "--memory-gb".into(),
            limit: true,
        }),
        None => expert_store::io::memory_budget(),
    };
    let (budget_bytes, why) = match gb {
        Some(gb) => ((gb * GB) as usize, "--prompt-cache-gb".to_owned()),
        None => match budget {
            Some(budget) => (
                (budget.bytes / 10) as usize,
                format!(
                    "a tenth of the {:.1} GB memory budget ({})",
                    budget.bytes as f64 / GB,
                    budget.source
                ),
            ),
            None => (GB as usize, "the memory budget is unknown".to_owned()),
        },
    };
    if budget_bytes == 0 {
        log::info!("prompt cache off (--prompt-cache-gb 0)");
    } else {
        log::info!(
            "prompt cache: {:.2} GB of snapshots in memory ({why}){}",
            budget_bytes as f64 / GB,
            dir.as_ref()
                .map_or(String::new(), |d| format!(", spilled to {}", d.display()))
        );
    }
    PromptCacheOptions { budget_bytes, dir }
}

/// The user's cache directory: `$XDG_CACHE_HOME`, else `$HOME/.cache`, else the temporary
/// directory.
pub(crate) fn user_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
}

/// The cached `tiny` checkpoint, generated on first use.
pub(crate) fn default_model() -> Result<PathBuf> {
    let base = user_cache_dir();
    let dir = base.join("k3").join("tiny");
    if !dir.join("config.json").exists() {
        let partial = base
            .join("k3")
            .join(format!("tiny.partial-{}", std::process::id()));
        let options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
        k3_model::synth::generate(&partial, &options).context("generating the tiny checkpoint")?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&partial, &dir).context("placing the tiny checkpoint")?;
        eprintln!(
            "no --model: generated the synthetic `tiny` checkpoint in {}",
            dir.display()
        );
    }
    Ok(dir)
}
