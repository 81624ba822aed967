//! Issue 18, acceptance 4: with `--prompt-cache-dir`, snapshots survive a restart (turn two
//! replayed on a new server resumes from the files and answers as cold), a snapshot file
//! with a flipped byte is ignored with a warning in the log and the turn is prefilled cold,
//! and files another checkpoint wrote (another seed; or the same vectors with one matrix
//! changed) are ignored with a warning rather than restored.

use std::path::{Path, PathBuf};

use k3_serve::engine::PromptCacheOptions;
use k3_serve::server::AppState;
use k3_testkit::Scratch;
use serde_json::Value;

use super::{
    PLAIN, cached_tokens, chat, cold, logged, outcome, server_on, synthetic, turn_one, turn_two,
};

/// A server over `model_dir` spilling to `dir`.
fn spilling(model_dir: PathBuf, dir: &Path) -> AppState {
    server_on(
        model_dir,
        PLAIN,
        PromptCacheOptions {
            budget_bytes: 1 << 30,
            dir: Some(dir.to_path_buf()),
        },
    )
}

/// The snapshot files in `dir`, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

/// The cold server's turn one and turn two (as messages, and its answer).
async fn cold_turns() -> (Value, Value, Value) {
    let first = chat(cold(), &turn_one()).await;
    let second = turn_two(&first);
    let answer = chat(cold(), &second).await;
    (first, second, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_snapshots_survive_a_restart() {
    let dir = Scratch::new("cache-e2e-restart");
    let (first, second, expected) = cold_turns().await;
    {
        let before = spilling(super::tiny(), dir.path());
        assert_eq!(outcome(&chat(&before, &turn_one()).await), outcome(&first));
    }
    assert!(
        !files(dir.path()).is_empty(),
        "turn one's snapshots were spilled"
    );
    // A restart over the same directory: turn two resumes from the files.
    let after = spilling(super::tiny(), dir.path());
    let replayed = chat(&after, &second).await;
    assert!(cached_tokens(&replayed) > 0, "{replayed}");
    assert_eq!(outcome(&replayed), outcome(&expected));
    assert!(
        logged(&dir.path().display().to_string()).is_empty(),
        "nothing to warn about"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_a_snapshot_file_is_ignored_with_a_warning() {
    let dir = Scratch::new("cache-e2e-flipped");
    let (_, second, expected) = cold_turns().await;
    {
        let before = spilling(super::tiny(), dir.path());
        chat(&before, &turn_one()).await;
    }
    // The last payload byte of every file: each header still reads, so the files are
    // listed at the restart and found on a lookup, where the payload's checksum fails.
    let spilled = files(dir.path());
    assert!(!spilled.is_empty());
    for path in &spilled {
        let mut bytes = std::fs::read(path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(path, bytes).unwrap();
    }
    let corrupt = spilling(super::tiny(), dir.path());
    let replayed = chat(&corrupt, &second).await;
    assert_eq!(cached_tokens(&replayed), 0, "no corrupt file is trusted");
    assert_eq!(outcome(&replayed), outcome(&expected));
    let warnings = logged(&dir.path().display().to_string());
    assert!(
        !warnings.is_empty(),
        "the corrupt files were ignored without a warning"
    );
    for line in &warnings {
        assert!(
            line.starts_with("WARN prompt cache: ignoring") && line.contains("checksum"),
            "{line}"
        );
    }
    // Every file turn two's lookup tried (its prefixes: the system block and turn one's
    // prompt) is named by a warning of its own.
    let named = |path: &PathBuf| {
        warnings
            .iter()
            .any(|l| l.contains(&*path.to_string_lossy()))
    };
    assert!(
        spilled.iter().filter(|p| named(p)).count() >= 2,
        "{warnings:?}"
    );
}

/// Snapshot files the checkpoint in `other` wrote for turn one and two are ignored by a server
/// over `tiny` (with a warning naming each when it reads the directory): turn two prefills
/// cold and answers as cold.
async fn files_of_another_checkpoint_are_ignored(other: &Path, tag: &str) {
    let dir = Scratch::new(&format!("cache-e2e-{tag}"));
    let (first, second, expected) = cold_turns().await;
    {
        let foreign = spilling(other.to_path_buf(), dir.path());
        let answer = chat(&foreign, &turn_one()).await;
        assert_ne!(
            outcome(&answer),
            outcome(&first),
            "the other checkpoint must answer otherwise for this test to mean anything"
        );
        chat(&foreign, &second).await;
    }
    let written = files(dir.path());
    assert!(written.len() >= 3, "{written:?}");
    // Turn two's prefixes on file: the system block and turn one's prompt, the other
    // checkpoint's.
    let ours = spilling(super::tiny(), dir.path());
    let replayed = chat(&ours, &second).await;
    assert_eq!(cached_tokens(&replayed), 0, "a foreign file was trusted");
    assert_eq!(outcome(&replayed), outcome(&expected));
    let warnings = logged(&dir.path().display().to_string());
    for path in &written {
        assert!(
            warnings.iter().any(|l| l.contains(&*path.to_string_lossy())
                && l.contains("ignoring")
                && l.contains("checkpoint")),
            "no warning for {}: {warnings:?}",
            path.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_files_of_another_seed_are_ignored() {
    // Same shapes and tokenizer, other weights: its snapshots of the same tokens would
    // restore without complaint, and give other answers.
    let other = synthetic("other-seed", 1);
    files_of_another_checkpoint_are_ignored(&other, "foreign-seed").await;
    let _ = std::fs::remove_dir_all(&other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_files_of_a_checkpoint_differing_only_in_a_matrix_are_ignored() {
    // `tiny` with one projection of layer 0 negated (every BF16 sign bit flipped), as a merged
    // adapter or a fine-tune that leaves the norms and other vectors alone would change it.
    let tuned = Scratch::new("cache-e2e-tuned-model");
    for entry in std::fs::read_dir(super::tiny()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tuned.path().join(path.file_name().unwrap())).unwrap();
    }
    let (path, range) = {
        let ckpt = expert_store::Checkpoint::open(tuned.path()).unwrap();
        let t = ckpt
            .tensor("model.layers.0.self_attn.v_proj.weight")
            .expect("tiny has this projection");
        assert_eq!((t.shape.len(), t.dtype), (2, expert_store::Dtype::BF16));
        (t.path.to_path_buf(), t.offset..t.offset + t.bytes.len())
    };
    let mut bytes = std::fs::read(&path).unwrap();
    for high in bytes[range].iter_mut().skip(1).step_by(2) {
        *high ^= 0x80;
    }
    std::fs::write(&path, bytes).unwrap();
    files_of_another_checkpoint_are_ignored(tuned.path(), "foreign-tuned").await;
}
