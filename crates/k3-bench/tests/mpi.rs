//! Several ranks under `mpirun` (the `mpi` feature): the decode bench's logits are the bytes
//! of one process for 2 and 3 ranks (an uneven split), 1 and 2 threads per rank, over shared
//! memory and over forced TCP; a killed rank ends the job with an error naming it, within
//! 30 s; ranks that opened different checkpoints are refused with both values.
//!
//! Cargo builds the bench with the same features before these tests run
//! (`cargo test -p k3-bench --features mpi --test mpi -- --test-threads 1`, as `.ci/run`
//! does); they need Open MPI's `mpirun` (Debian: openmpi-bin). Run as root, hence
//! `--allow-run-as-root`.
#![cfg(feature = "mpi")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;

/// The bench, built by cargo for this test with the same features.
fn bench() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_teacher_forced_decode_bench"))
}

fn mpirun() -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "--allow-run-as-root"]);
    c
}

/// A synthetic checkpoint in a fresh directory.
fn checkpoint(preset: Preset, seed: u64) -> Scratch {
    let dir = Scratch::new("mpi-model");
    let mut options = SynthOptions::new(preset);
    options.seed = seed;
    generate(dir.path(), &options).expect("generating a checkpoint");
    dir
}

fn run(mut command: Command) -> Output {
    let output = command.output().expect("mpirun could not start");
    assert!(
        output.status.success(),
        "{command:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The bench's logits file for `ranks` processes (1: no mpirun) of `threads` threads each.
fn logits(model: &Path, ranks: usize, threads: usize, extra: &[&str]) -> (Vec<u8>, String) {
    logits_with(model, ranks, threads, extra, &[])
}

/// [`logits`] with `bench_extra` passed to the bench.
fn logits_with(
    model: &Path,
    ranks: usize,
    threads: usize,
    extra: &[&str],
    bench_extra: &[&str],
) -> (Vec<u8>, String) {
    let scratch = Scratch::new("mpi-logits");
    let out = scratch.path().join("logits.f32");
    let mut args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--steps",
        "6",
        "--threads",
        &threads.to_string(),
        "--probe-mb",
        "0",
        "--logits-out",
        &out.display().to_string(),
    ]
    .iter()
    .chain(bench_extra)
    .map(|s| s.to_string())
    .collect();
    let command = if ranks == 1 {
        let mut c = Command::new(bench());
        c.args(&args);
        c
    } else {
        let mut c = mpirun();
        c.args(extra).args(["-np", &ranks.to_string()]).arg(bench());
        c.args(args.drain(..));
        c
    };
    let output = run(command);
    let bytes = std::fs::read(&out).expect("the logits file");
    (
        bytes,
        String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr),
    )
}

#[test]
fn two_and_three_ranks_give_the_logits_of_one_process() {
    // `tiny` has every K3 feature: KDA and MLA layers, a dense layer, latent MoE with shared
    // experts, AttnRes blocks; its matrices are small, so a rank owns little of some of them.
    let model = checkpoint(Preset::Tiny, 1);
    let (reference, _) = logits(model.path(), 1, 2, &[]);
    assert!(!reference.is_empty());
    for (ranks, threads) in [(2, 1), (2, 2), (3, 1), (3, 2)] {
        let (got, text) = logits(model.path(), ranks, threads, &[]);
        assert!(
            text.contains(&format!("rank {} of {ranks}", ranks - 1)),
            "no startup line of the last rank: is the bench built with --features mpi?\n{text}"
        );
        assert!(
            got == reference,
            "{ranks} ranks x {threads} threads: logits differ from one process"
        );
        assert!(text.contains("collectives per token"), "{text}");
    }
}

/// A requantised trunk (`--trunk-format q8_0` and `mxfp4`) under two ranks gives one
/// process's logits (each rank multiplies its rows of the same requantised blocks), and they
/// are not the exact trunk's.
#[test]
fn a_requantised_trunk_under_two_ranks_gives_one_processs_logits() {
    let model = checkpoint(Preset::Tiny, 1);
    let (exact, _) = logits(model.path(), 1, 2, &[]);
    for format in ["q8_0", "mxfp4"] {
        let flags = ["--trunk-format", format, "--pack-cache", "off"];
        let (reference, text) = logits_with(model.path(), 1, 2, &[], &flags);
        assert!(text.contains(&format!("requantised to {format}")), "{text}");
        assert!(reference != exact, "{format} changed no logit");
        let (got, text) = logits_with(model.path(), 2, 1, &[], &flags);
        assert!(text.contains("rank 1 of 2"), "{text}");
        assert!(
            got == reference,
            "{format}, 2 ranks: logits differ from one process"
        );
    }
}

/// The bytes a `resident trunk: X GB read ...` line of `text` says, one per line found.
fn resident_bytes(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| l.split("resident trunk: ").nth(1))
        .filter_map(|rest| rest.split(" GB").next()?.parse::<f64>().ok())
        .map(|gb| gb * 1e9)
        .collect()
}

/// `--pack-trunk` under 2 and 3 ranks: each rank holds only its rows of the packed trunk
/// (rank 0's line says so, with under 3/4 of one process's bytes), and
/// the logits are the bytes of one process reading the trunk through the mapping. A Q8_0
/// trunk read from its pack cache likewise: each rank reads its rows of the cached blocks.
#[test]
fn each_rank_holds_its_rows_of_the_packed_trunk_with_one_processs_logits() {
    let model = checkpoint(Preset::Tiny, 1);
    let (stored, _) = logits_with(model.path(), 1, 2, &[], &["--no-pack-trunk"]);
    let (one, text) = logits_with(model.path(), 1, 2, &[], &["--pack-trunk"]);
    assert!(text.contains("held packed (--pack-trunk)"), "{text}");
    assert!(one == stored, "the packed trunk changed the logits");
    let whole = resident_bytes(&text);
    assert_eq!(whole.len(), 1, "{text}");
    for ranks in [2, 3] {
        let (got, text) = logits_with(model.path(), ranks, 1, &[], &["--pack-trunk"]);
        assert!(
            got == stored,
            "{ranks} ranks, packed: logits differ from one process"
        );
        // Rank 0 prints the build's lines: its share alone (in `tiny` the small matrices'
        // rows, split at multiples of 16, fall mostly to the last rank).
        let held = resident_bytes(&text);
        assert_eq!(held.len(), 1, "rank 0's resident line: {text}");
        assert!(
            text.contains(&format!("rank 0 of {ranks}: its rows")),
            "{text}"
        );
        assert!(
            held[0] < 0.75 * whole[0],
            "rank 0 of {ranks} holds {} bytes against one process's {}",
            held[0],
            whole[0]
        );
    }
    let cache = Scratch::new("mpi-pack-cache");
    let dir = cache.path().display().to_string();
    let flags = ["--trunk-format", "q8_0", "--pack-cache", dir.as_str()];
    // The first run writes the cache; the ranks read their rows of it.
    let (reference, text) = logits_with(model.path(), 1, 2, &[], &flags);
    assert!(text.contains("written in"), "{text}");
    let (got, text) = logits_with(model.path(), 3, 1, &[], &flags);
    assert!(text.contains("read from the pack cache"), "{text}");
    assert!(text.contains("rank 0 of 3: its rows"), "{text}");
    assert!(
        got == reference,
        "q8_0 from the cache, 3 ranks: logits differ"
    );
}

/// The bench's output for `ranks` processes (1: no mpirun) of one thread, given `args`.
fn bench_text(model: &Path, ranks: usize, args: &[&str]) -> String {
    let mut command = if ranks == 1 {
        Command::new(bench())
    } else {
        let mut c = mpirun();
        c.args(["-np", &ranks.to_string()]).arg(bench());
        c
    };
    command.args(["--model", &model.display().to_string()]);
    command
        .args(["--threads", "1", "--probe-mb", "0"])
        .args(args);
    let output = run(command);
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

/// Every rank computes its share of the MLA heads on its own mirror of each sequence's latent
/// cache. At depth (the cache filled by a chunked prefill first) the decode steps' logits
/// are one process's bytes for 2 and 3 ranks (`tiny` has 2 MLA heads: with 3 ranks one rank
/// has none). A timed prompt after the depth runs five times, each on a fresh copy of the
/// depth session that the other ranks do not hold yet (rank 0 sends its caches whole, and
/// the dropped copies' mirrors go): its last logits are one process's too.
#[test]
fn attention_split_over_ranks_gives_one_processs_logits_at_depth() {
    let model = checkpoint(Preset::Tiny, 5);
    let depth = ["--depth", "150", "--depth-chunk", "32"];
    let (reference, text) = logits_with(model.path(), 1, 1, &[], &depth);
    assert!(text.contains("at depth 150"), "{text}");
    for ranks in [2, 3] {
        let (got, text) = logits_with(model.path(), ranks, 1, &[], &depth);
        assert!(
            text.contains(&format!("rank {} of {ranks}", ranks - 1)),
            "{text}"
        );
        assert!(
            got == reference,
            "{ranks} ranks at depth 150: logits differ from one process"
        );
    }
    let prompt = [
        "--depth",
        "120",
        "--prefill",
        "9",
        "--prefill-chunk",
        "4",
        "--steps",
        "9",
    ];
    let fingerprint = |text: &str| -> String {
        let at = text
            .find("last logits fingerprint ")
            .unwrap_or_else(|| panic!("no prefill line:\n{text}"));
        text[at..]
            .split_whitespace()
            .nth(3)
            .unwrap_or("")
            .to_string()
    };
    let one = fingerprint(&bench_text(model.path(), 1, &prompt));
    for ranks in [2, 3] {
        let got = fingerprint(&bench_text(model.path(), ranks, &prompt));
        assert_eq!(
            got, one,
            "{ranks} ranks: the prompt after depth 120 differs"
        );
    }
}

/// Open MPI's flag that forbids shared memory between ranks, when this is Open MPI.
fn tcp_only() -> Option<[&'static str; 3]> {
    let version = Command::new("mpirun").arg("--version").output().ok()?;
    String::from_utf8_lossy(&version.stdout)
        .contains("Open MPI")
        .then_some(["--mca", "btl", "tcp,self"])
}

#[test]
fn ranks_over_forced_tcp_give_the_logits_of_one_process() {
    let Some(tcp) = tcp_only() else {
        eprintln!("skipped: not Open MPI, no `--mca btl tcp,self`");
        return;
    };
    let model = checkpoint(Preset::Tiny, 2);
    let (reference, _) = logits(model.path(), 1, 1, &[]);
    let (got, _) = logits(model.path(), 2, 1, &tcp);
    assert!(got == reference, "over TCP: logits differ from one process");
}

#[test]
fn ranks_with_different_checkpoints_are_refused_with_both_values() {
    let a = checkpoint(Preset::Tiny, 3);
    let b = checkpoint(Preset::Tiny, 4);
    let mut c = mpirun();
    for dir in [a.path(), b.path()] {
        if dir != a.path() {
            c.arg(":");
        }
        c.args(["-np", "1"]).arg(bench()).args([
            "--model",
            &dir.display().to_string(),
            "--steps",
            "2",
            "--probe-mb",
            "0",
        ]);
    }
    let output = c.output().expect("mpirun could not start");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "different checkpoints were accepted"
    );
    assert!(
        stderr.contains("the checkpoint")
            && stderr.contains("differs between ranks")
            && stderr.contains("rank 1"),
        "{stderr}"
    );
    // Both values, as hex words.
    assert!(stderr.matches("0x").count() >= 4, "{stderr}");
}

#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let model = checkpoint(Preset::Tiny, 5);
    let mut c = mpirun();
    c.args(["-np", "2"]).arg(bench()).args([
        "--model",
        &model.path().display().to_string(),
        "--steps",
        "100000",
        "--threads",
        "1",
        "--probe-mb",
        "0",
    ]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("mpirun could not start");
    // Wait for decoding to be under way (rank 0 prints its steps).
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("step    3") {
                let _ = tx.send(());
            }
        }
    });
    let stderr = child.stderr.take().expect("stderr");
    let (etx, erx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            text.push_str(&line);
            text.push('\n');
        }
        let _ = etx.send(text);
    });
    if rx.recv_timeout(Duration::from_secs(300)).is_err() {
        let _ = child.kill();
        panic!("decoding did not start: {}", erx.recv().unwrap_or_default());
    }
    let victim = rank_pid(1, model.path()).expect("rank 1's process");
    // SAFETY: kill(2) on a pid read from /proc; no memory is involved.
    unsafe { libc::kill(victim, libc::SIGKILL) };
    let killed = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job did not end within 30 s of rank 1's death");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = erx
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_default();
    assert!(!status.success(), "the job ended well after a rank died");
    assert!(
        text.contains("rank 1"),
        "the error does not name rank 1:\n{text}"
    );
    eprintln!(
        "job ended {:.1} s after rank 1 was killed",
        killed.elapsed().as_secs_f64()
    );
}

/// The pid of the bench process on `model` that MPI started as `rank`.
fn rank_pid(rank: usize, model: &Path) -> Option<i32> {
    let wanted = format!("OMPI_COMM_WORLD_RANK={rank}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if !cmd.contains("teacher_forced_decode_bench") || !cmd.contains(&*model.to_string_lossy())
        {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|v| v == wanted.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn the_expert_store_is_refused_with_several_ranks() {
    let model = checkpoint(Preset::Tiny, 6);
    let mut c = mpirun();
    c.args(["-np", "2"]).arg(bench()).args([
        "--model",
        &model.path().display().to_string(),
        "--steps",
        "2",
        "--probe-mb",
        "0",
        "--expert-cache",
        "2",
    ]);
    let output = c.output().expect("mpirun could not start");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the store was accepted");
    assert!(
        stderr.contains("the expert store") && stderr.contains("not supported with several ranks"),
        "{stderr}"
    );
}
