//! What the benchmarks that run engines share: reading a number off an engine's output, and
//! dropping a file's pages so a run starts from a cold page cache.

use std::path::Path;

use anyhow::{Context, Result};

/// The number in `line` between `after` and the next `before`.
pub(crate) fn between(line: &str, after: &str, before: &str) -> Option<f64> {
    let rest = &line[line.find(after)? + after.len()..];
    rest[..rest.find(before)?].trim().parse().ok()
}

/// Asks the kernel to drop `path`'s pages from the page cache (`POSIX_FADV_DONTNEED`).
pub(crate) fn drop_page_cache(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    expert_store::io::drop_page_cache(&file, 0, 0)
        .with_context(|| format!("posix_fadvise on {}", path.display()))
}
