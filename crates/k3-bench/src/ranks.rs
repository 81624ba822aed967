//! The bench under `mpirun`: the other ranks' part, and rank 0's report of
//! every rank's collectives and weight pages.

use std::path::Path;

use anyhow::Result;
use k3_model::builder::RankShare;
use k3_model::model::Model;
use k3_model::profile::{Bucket, Profile};
use numa_sched::{CollectiveStats, Ranks};

/// Bytes of this process's resident pages in mappings of files under `dir` (the
/// checkpoint's shards): the weight pages it touched (`/proc/self/smaps`).
pub(crate) fn mapped_rss(dir: &Path) -> u64 {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut inside = false;
    let mut total = 0u64;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode [path]".
            inside = line
                .split_whitespace()
                .nth(5)
                .is_some_and(|p| Path::new(p).starts_with(&dir));
        } else if inside && first == "Rss:" {
            let kb: u64 = line
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            total += kb * 1024;
        }
    }
    total
}

/// What each rank reports to rank 0 at the end: mapped weight pages, owned, split and
/// replicated bytes; nanoseconds in its MLA, MLA attention and KDA buckets (`--profile`,
/// since the last reset).
fn words(dir: &Path, share: &RankShare, profile: &Profile) -> [u64; 7] {
    let totals = profile.totals();
    let nanos = |b: Bucket| totals[b as usize].as_nanos() as u64;
    [
        mapped_rss(dir),
        share.owned,
        share.split,
        share.replicated,
        nanos(Bucket::Mla),
        nanos(Bucket::MlaAttention),
        nanos(Bucket::Kda),
    ]
}

/// A rank other than 0: runs rank 0's steps until its model is dropped, then sends its
/// figures for rank 0's report.
pub(crate) fn follow(
    model: Model<'_>,
    ranks: &Ranks,
    dir: &Path,
    share: &RankShare,
    profile: &Profile,
) -> Result<()> {
    model.follow()?;
    drop(model);
    ranks.gather_words(&words(dir, share, profile));
    Ok(())
}

/// Rank 0, after its last step: ends the other ranks' part and prints every rank's figures
/// (`decode`: the collectives of the timed steps, their count, and how many of them the
/// profile covers).
pub(crate) fn finish(
    model: Model<'_>,
    ranks: &Ranks,
    dir: &Path,
    share: &RankShare,
    profile: &Profile,
    decode: Option<(CollectiveStats, usize, usize)>,
) {
    if ranks.size() == 1 {
        return;
    }
    drop(model);
    let all = ranks.gather_words(&words(dir, share, profile));
    if let Some((stats, tokens, _)) = decode {
        let n = tokens.max(1) as f64;
        println!(
            "collectives per token (rank 0): {:.1} calls, {:.3} MB, {:.3} ms inside them",
            stats.calls as f64 / n,
            stats.bytes as f64 / n / 1e6,
            stats.seconds / n * 1e3,
        );
    }
    for (rank, w) in all.iter().enumerate() {
        let [rss, owned, split, replicated] = [w[0], w[1], w[2], w[3]];
        println!(
            "rank {rank}: weight pages mapped {:.3} GB; owns {:.3} GB of {:.3} GB row-split ({:.1}%), {:.3} GB replicated; bound checkpoint/{} + 5% + replicated = {:.3} GB",
            rss as f64 / 1e9,
            owned as f64 / 1e9,
            split as f64 / 1e9,
            100.0 * owned as f64 / split.max(1) as f64,
            replicated as f64 / 1e9,
            ranks.size(),
            ((split + replicated) as f64 / ranks.size() as f64 * 1.05 + replicated as f64) / 1e9,
        );
    }
    // `--profile`: each rank's attention buckets over the same profiled steps (every rank
    // computes its share of the MLA heads; KDA runs on rank 0).
    if let Some((_, _, profiled)) = decode
        && profiled > 0
        && all.iter().any(|w| w[4] + w[5] + w[6] > 0)
    {
        let ms = |nanos: u64| nanos as f64 / 1e6 / profiled as f64;
        for (rank, w) in all.iter().enumerate() {
            println!(
                "rank {rank}: per token over the profiled steps: MLA attention over the cache {:.3} ms, MLA projections {:.3} ms, KDA {:.3} ms",
                ms(w[5]),
                ms(w[4]),
                ms(w[6]),
            );
        }
    }
}
