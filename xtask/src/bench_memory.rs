//! `cargo xtask bench-peers --memory-gb G[,..]` (or `--memory-fraction F[,..]` of the model
//! size): both engines decode the same checkpoint, each run inside a fresh memory cgroup of
//! the budget (`cgroup`), alternating pairs, every run from a cold page cache. Per run:
//! s/token, tokens/s, bytes read from disk per token, the group's peak memory, whether the OOM
//! killer fired; per budget the ratio ours / llama.cpp of each pair (min / median / max);
//! before and after, the disk's own `O_DIRECT` sequential read rate.
//!
//! "Model size" is the decode's working set (issue 17): the checkpoint's tensor bytes less
//! the embedding table, of which a token reads one row. Our bench runs with no memory flags:
//! its budget comes from the cgroup it finds itself in.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use crate::cgroup::{Hierarchy, Mark, MemoryGroup, Outcome, group_name};

/// Where the two engines are and how to call them.
#[derive(Debug)]
pub(crate) struct Engines {
    /// `teacher_forced_decode_bench`.
    pub(crate) ours: PathBuf,
    /// Extra arguments for ours (the kernel tier and trunk format: never memory flags).
    pub(crate) ours_args: Vec<String>,
    /// `llama-bench` and the GGUF; `None`: our engine alone (`--no-peer`).
    pub(crate) peer: Option<(PathBuf, PathBuf)>,
}

/// What to run: the budgets (bytes, and how they were asked for), thread counts, pairs and
/// decoded tokens per run.
#[derive(Debug)]
pub(crate) struct Sweep {
    pub(crate) budgets: Vec<(u64, String)>,
    pub(crate) threads: Vec<usize>,
    pub(crate) pairs: usize,
    pub(crate) tokens: usize,
}

/// The checkpoint's tensor bytes and its embedding table's bytes.
pub(crate) fn model_size(model: &Path) -> Result<(u64, u64)> {
    let ckpt = expert_store::Checkpoint::open(model)?;
    let embedding = ckpt.require("model.embed_tokens.weight")?.bytes.len();
    Ok((ckpt.data_bytes() as u64, embedding as u64))
}

/// The budgets of `--memory-gb G,..` (decimal GB) or `--memory-fraction F,..` (of `model`
/// bytes), in the order given.
pub(crate) fn budgets(
    gb: Option<&str>,
    fraction: Option<&str>,
    model: u64,
) -> Result<Vec<(u64, String)>> {
    let list = positive_list;
    Ok(match (gb, fraction) {
        (Some(_), Some(_)) => bail!("--memory-gb and --memory-fraction cannot both be given"),
        (Some(gb), None) => list(gb, "memory-gb")?
            .into_iter()
            .map(|g| {
                (
                    (g * 1e9) as u64,
                    format!("{g} GB ({:.2}x the model)", g * 1e9 / model as f64),
                )
            })
            .collect(),
        (None, Some(f)) => list(f, "memory-fraction")?
            .into_iter()
            .map(|f| {
                let bytes = (f * model as f64) as u64;
                (
                    bytes,
                    format!("{f}x the model ({:.3} GB)", bytes as f64 / 1e9),
                )
            })
            .collect(),
        (None, None) => bail!("no budget: give --memory-gb or --memory-fraction"),
    })
}

/// `X,..` of `--flag`: each a finite number above 0, in the order given.
pub(crate) fn positive_list(text: &str, flag: &str) -> Result<Vec<f64>> {
    text.split(',')
        .map(|v| {
            let x: f64 = v
                .trim()
                .parse()
                .with_context(|| format!("--{flag} {v:?} is not a number"))?;
            ensure!(x > 0.0 && x.is_finite(), "--{flag} {v:?} must be above 0");
            Ok(x)
        })
        .collect()
}

/// Reads the first `max` bytes of `path` (whole 8 MiB requests) with `O_DIRECT`: the bytes
/// read and the seconds taken, for the disk's sequential rate. Requests are 8 MiB, `depth` of them in flight at once (`depth` threads each reading
/// every `depth`-th request; depth 1 is `dd iflag=direct bs=8M`). Our trunk stream and expert
/// store keep several requests in flight, and a page-cache reader gets readahead, so one
/// request at a time understates what a disk can give them.
pub(crate) fn direct_read(path: &Path, max: u64, depth: usize) -> Result<(u64, f64)> {
    const CHUNK: u64 = 8 << 20;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
    let end = max.min(file.metadata()?.len()) / CHUNK * CHUNK;
    ensure!(
        end > 0,
        "{} is smaller than one {CHUNK}-byte read",
        path.display()
    );
    let depth = depth.clamp(1, (end / CHUNK) as usize);
    let start = Instant::now();
    let read: Vec<Result<u64>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..depth)
            .map(|worker| {
                let file = &file;
                s.spawn(move || -> Result<u64> {
                    let mut buf = DirectBuf::new(CHUNK as usize)?;
                    let mut done = 0u64;
                    let mut at = worker as u64 * CHUNK;
                    while at < end {
                        match file.read_at(buf.bytes(), at) {
                            Ok(0) => break,
                            Ok(n) => {
                                done += n as u64;
                                at += depth as u64 * CHUNK;
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                return Err(e).with_context(|| {
                                    format!("O_DIRECT read of {} at byte {at}", path.display())
                                });
                            }
                        }
                    }
                    Ok(done)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a read-probe thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut total = 0;
    for r in read {
        total += r?;
    }
    Ok((total, elapsed))
}

/// A 4 KiB-aligned buffer for `O_DIRECT` reads.
struct DirectBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl DirectBuf {
    fn new(bytes: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(bytes, 4096)
            .with_context(|| format!("no 4 KiB-aligned layout of {bytes} bytes"))?;
        ensure!(bytes > 0, "an O_DIRECT buffer needs at least one byte");
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc(layout) };
        ensure!(
            !ptr.is_null(),
            "cannot allocate {bytes} bytes for O_DIRECT reads"
        );
        Ok(Self { ptr, layout })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of layout.size() bytes owned by self, borrowed
        // mutably through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for DirectBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Bytes of `path` now in the page cache (`mincore` over a read-only mapping).
fn resident_bytes(path: &Path) -> Result<u64> {
    let file = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: a fresh read-only shared mapping of an open file; unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    ensure!(map != libc::MAP_FAILED, "cannot map {}", path.display());
    let page = 4096;
    let mut pages = vec![0u8; len.div_ceil(page)];
    // SAFETY: map covers len bytes; pages has one byte per 4 KiB page of it.
    let rc = unsafe { libc::mincore(map, len, pages.as_mut_ptr()) };
    // SAFETY: map and len are the mapping made above, not used after this.
    unsafe { libc::munmap(map, len) };
    ensure!(rc == 0, "mincore on {} failed", path.display());
    Ok(pages.iter().filter(|&&p| p & 1 == 1).count() as u64 * page as u64)
}

/// Requests in flight in the disk probe: one at a time, and eight (as a reader that keeps
/// several requests in flight, or the kernel's readahead).
const PROBE_DEPTHS: [usize; 2] = [1, 8];

/// llama-bench's `--progress` line for its timed generation (`...: generation run 1/1`), and
/// not for its warm-up token before it (`...: warmup generation run`).
const LLAMA_TIMED_MARK: &str = ": generation run";

/// One engine's run in one group.
#[derive(Debug)]
struct Run {
    /// Seconds per decoded token; `None`: it did not finish (see `failure`).
    seconds: Option<f64>,
    /// Why it did not finish: the OOM killer, or the engine's own error.
    failure: Option<String>,
    /// Our combined logits fingerprint.
    fingerprint: Option<String>,
    /// Bytes read from disk per timed token: after the mark, over the tokens after it.
    disk_per_token: Option<f64>,
    /// Ours: the bytes from disk per token its memory plan predicted (`None`: no plan line,
    /// or everything fits).
    predicted: Option<f64>,
    outcome: Outcome,
}

/// The bytes from disk per token a memory plan line predicts (`... predicted from disk 3.18 GB
/// per token`), in bytes.
fn predicted_disk_per_token(stderr: &str) -> Option<f64> {
    let line = stderr.lines().find(|l| l.starts_with("memory plan:"))?;
    let gb = crate::runs::between(line, "predicted from disk ", " GB per token")?;
    Some(gb * 1e9)
}

/// The decode time per token out of a finished run's output.
fn seconds_per_token(ours: bool, stdout: &str) -> Result<f64> {
    if ours {
        let line = stdout
            .lines()
            .find(|l| l.contains("steps: median"))
            .context("our bench printed no \"steps: median\" line")?;
        let ms = crate::runs::between(line, "after the first ", " ms/token")
            .context("no mean after the first step")?;
        Ok(ms / 1e3)
    } else {
        let json: serde_json::Value =
            serde_json::from_str(stdout).context("llama-bench did not print JSON")?;
        let rate = json[0]["avg_ts"]
            .as_f64()
            .context("llama-bench printed no avg_ts")?;
        Ok(1.0 / rate)
    }
}

/// Runs one engine in a fresh group of `budget` bytes, from a cold page cache of `files`.
fn run_one(
    h: &Hierarchy,
    budget: u64,
    ours: bool,
    mut command: Command,
    files: &[PathBuf],
    tokens: usize,
) -> Result<Run> {
    let mut warm = 0;
    for f in files {
        crate::runs::drop_page_cache(f)?;
        warm += resident_bytes(f)?;
    }
    if warm > 0 {
        println!(
            "  note: {:.1} MB of the weight files stayed in the page cache",
            warm as f64 / 1e6
        );
    }
    std::thread::sleep(std::time::Duration::from_secs(1));
    let group = MemoryGroup::create(h, &group_name(if ours { "ours" } else { "llama" }), budget)?;
    // Where the timed decode starts: after our step 0 (the step whose time the mean leaves
    // out), at llama-bench's timed generation run (after loading and its warm-up token).
    let mark = if ours {
        Mark {
            stderr: false,
            text: "step    0 ",
        }
    } else {
        Mark {
            stderr: true,
            text: LLAMA_TIMED_MARK,
        }
    };
    let outcome = group.run(&mut command, Some(mark))?;
    drop(group);
    // What the engine said last, to tell where it died.
    let last = outcome
        .stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_owned();
    let (seconds, failure) = if outcome.oom_killed() {
        (
            None,
            Some(format!(
                "killed by the OOM killer (its last line: {last:?})"
            )),
        )
    } else if !outcome.status.success() {
        (None, Some(format!("{}: {last}", outcome.status)))
    } else {
        (Some(seconds_per_token(ours, &outcome.stdout)?), None)
    };
    let fingerprint = outcome
        .stdout
        .split("combined fingerprint ")
        .nth(1)
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string());
    // Our step 0 is before the mark; llama-bench's warm-up token is not in its timed run.
    let timed = if ours { tokens - 1 } else { tokens };
    let disk_per_token = outcome
        .read_bytes_at_mark
        .filter(|_| seconds.is_some() && timed > 0)
        .map(|at| outcome.read_bytes.saturating_sub(at) as f64 / timed as f64);
    let predicted = if ours {
        predicted_disk_per_token(&outcome.stderr)
    } else {
        None
    };
    Ok(Run {
        seconds,
        failure,
        fingerprint,
        disk_per_token,
        predicted,
        outcome,
    })
}

fn describe(name: &str, run: &Run) -> String {
    let o = &run.outcome;
    let speed = match (run.seconds, &run.failure) {
        (Some(s), _) => format!("{s:.4} s/token ({:.2} tokens/s)", 1.0 / s),
        (None, Some(why)) => why.clone(),
        (None, None) => "no result".into(),
    };
    let disk = match (run.disk_per_token, o.read_bytes_at_mark) {
        (Some(d), Some(at)) => format!(
            "{:.3} GB read from disk per timed token, {:.3} GB before them (load, warm-up)",
            d / 1e9,
            at as f64 / 1e9
        ),
        _ => "no timed tokens".into(),
    };
    let plan = match (run.disk_per_token, run.predicted) {
        (Some(d), Some(p)) if p > 0.0 => format!(
            " ({:.3} GB predicted by the plan: measured / predicted {:.3})",
            p / 1e9,
            d / p
        ),
        (_, Some(p)) => format!(" ({:.3} GB predicted by the plan)", p / 1e9),
        _ => String::new(),
    };
    format!(
        "{name}: {speed}; {disk}{plan}; {:.3} GB from disk in all in {:.1} s; peak {:.3} GB",
        o.read_bytes as f64 / 1e9,
        o.wall.as_secs_f64(),
        o.peak as f64 / 1e9,
    )
}

/// min / median / max of `v` (sorted here), or "n/a".
fn spread(v: &mut [f64], digits: usize) -> String {
    if v.is_empty() {
        return "n/a".into();
    }
    v.sort_by(f64::total_cmp);
    format!(
        "min {:.digits$} median {:.digits$} max {:.digits$}",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

pub(crate) fn run(model: &Path, engines: &Engines, sweep: &Sweep, files: &[PathBuf]) -> Result<()> {
    let h = Hierarchy::detect()?;
    println!(
        "memory cgroups: {:?} under {}",
        h.version,
        h.parent.display()
    );
    let largest = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .max_by_key(|f| f.metadata().map_or(0, |m| m.len()))
        .context("the checkpoint has no safetensors shard")?;
    let disk = |when: &str| -> Result<()> {
        for depth in PROBE_DEPTHS {
            let (bytes, seconds) = direct_read(largest, 2 << 30, depth)?;
            println!(
                "disk, O_DIRECT sequential 8 MiB reads of {}, {depth} in flight ({when}): {:.2} GB/s",
                largest.display(),
                bytes as f64 / seconds / 1e9
            );
        }
        Ok(())
    };
    disk("before")?;
    let mut fingerprints: Vec<String> = Vec::new();
    for (budget, label) in &sweep.budgets {
        for &t in &sweep.threads {
            let mut rows: Vec<(Option<Run>, Run)> = Vec::new();
            for pair in 0..sweep.pairs {
                println!("budget {label}, {t} threads, pair {pair}:");
                let peer = match &engines.peer {
                    Some((bench, gguf)) => {
                        let mut c = Command::new(bench);
                        c.arg("-m").arg(gguf);
                        c.args([
                            "-p",
                            "0",
                            "-n",
                            &sweep.tokens.to_string(),
                            "-t",
                            &t.to_string(),
                        ]);
                        c.args(["-r", "1", "-o", "json", "--progress"]);
                        let run = run_one(&h, *budget, false, c, files, sweep.tokens)?;
                        println!("  {}", describe("llama.cpp", &run));
                        Some(run)
                    }
                    None => None,
                };
                let mut c = Command::new(&engines.ours);
                c.arg("--model").arg(model);
                c.args([
                    "--threads",
                    &t.to_string(),
                    "--steps",
                    &sweep.tokens.to_string(),
                    // The read probe's buffer would count against the group's budget.
                    "--probe-mb",
                    "0",
                ]);
                c.args(&engines.ours_args);
                let ours = run_one(&h, *budget, true, c, files, sweep.tokens)?;
                println!("  {}", describe("ours", &ours));
                if let Some(fp) = &ours.fingerprint {
                    fingerprints.push(fp.clone());
                }
                if let (Some(p), Some(o)) = (peer.as_ref().and_then(|p| p.seconds), ours.seconds) {
                    println!("  ours / llama.cpp tokens/s: {:.2}x", p / o);
                }
                rows.push((peer, ours));
            }
            let mut ratios: Vec<f64> = rows
                .iter()
                .filter_map(|(p, o)| Some(p.as_ref()?.seconds? / o.seconds?))
                .collect();
            // Per engine (false: llama.cpp, true: ours): s/token, GB from disk per timed
            // token, OOM kills.
            let engine = |ours: bool| {
                let runs: Vec<&Run> = rows
                    .iter()
                    .filter_map(|(p, o)| if ours { Some(o) } else { p.as_ref() })
                    .collect();
                let mut s: Vec<f64> = runs.iter().filter_map(|r| r.seconds).collect();
                let mut d: Vec<f64> = runs.iter().filter_map(|r| r.disk_per_token).collect();
                d.iter_mut().for_each(|b| *b /= 1e9);
                let ooms = runs.iter().filter(|r| r.outcome.oom_killed()).count();
                format!(
                    "s/token {}, GB from disk per token {} ({ooms} of {} runs OOM-killed)",
                    spread(&mut s, 4),
                    spread(&mut d, 3),
                    runs.len()
                )
            };
            println!("budget {label}, {t} threads, ours: {}", engine(true));
            if engines.peer.is_some() {
                println!("budget {label}, {t} threads, llama.cpp: {}", engine(false));
                println!(
                    "budget {label}, {t} threads, ours / llama.cpp tokens/s: {}",
                    spread(&mut ratios, 2)
                );
            }
        }
    }
    disk("after")?;
    fingerprints.sort();
    fingerprints.dedup();
    match fingerprints.len() {
        0 => println!("ours: no finished run to compare logits"),
        1 => println!(
            "ours: the same combined logits fingerprint {} in every finished run",
            fingerprints[0]
        ),
        _ => println!(
            "ours: logits DIFFER between runs: fingerprints {}",
            fingerprints.join(", ")
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
