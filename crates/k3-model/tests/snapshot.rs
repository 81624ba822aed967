//! Session snapshots on the `tiny` preset: a session restored from a snapshot, fed the rest of
//! a prompt and then decoded, gives the same logits bits as a cold run over the whole prompt
//! (threads 1 and 2, a fake 2-domain pool, prefill chunks 1/7/64, inside a `decode_batch`);
//! the bytes held match the config's count; snapshot files round-trip and refuse a flipped
//! byte, a truncated file, another checkpoint and another engine version.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::Checkpoint;
use k3_model::config::K3Config;
use k3_model::model::snapshot::file::{self, Checksum, FileError, Identity};
use k3_model::model::{Model, Session, Snapshot, SnapshotError, fingerprint, state_bytes};
use k3_model::synth::{Preset, SynthOptions, generate, preset_config};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;
use numa_sched::PoolOptions;

fn tiny(dir: &Path, seed: u64, layers: Option<usize>) -> K3Config {
    let options = SynthOptions {
        seed,
        layers,
        ..SynthOptions::new(Preset::Tiny)
    };
    generate(dir, &options).unwrap().config
}

/// A prompt of `n` tokens inside the tiny vocabulary (a fixed pseudo-random walk).
fn prompt(n: usize, salt: usize) -> Vec<usize> {
    (0..n)
        .map(|i| (i * 389 + salt * 97 + i * i * 7) % 1000 + 1)
        .collect()
}

const PREFIX: usize = 70;
const PROMPT: usize = 90;
const DECODE: [usize; 4] = [5, 600, 42, 811];

/// Fingerprints of the logits after the prompt and after each decoded token.
fn continue_from(
    model: &Model<'_>,
    session: &mut Session,
    rest: &[usize],
    chunk: usize,
) -> Vec<u64> {
    let mut out = vec![fingerprint(&model.prefill(session, rest, chunk).unwrap())];
    for &t in &DECODE {
        out.push(fingerprint(&model.decode_step(session, t).unwrap()));
    }
    out
}

fn cold(model: &Model<'_>, tokens: &[usize], chunk: usize) -> Vec<u64> {
    continue_from(model, &mut model.session(), tokens, chunk)
}

/// Prefills `tokens[..PREFIX]` and snapshots there.
fn snapshot_at_prefix(model: &Model<'_>, tokens: &[usize], chunk: usize) -> Snapshot {
    let mut session = model.session();
    model
        .prefill(&mut session, &tokens[..PREFIX], chunk)
        .unwrap();
    let snap = session.snapshot();
    // The snapshot is a copy: the session going on does not change it.
    model.prefill(&mut session, &prompt(9, 3), chunk).unwrap();
    snap
}

#[test]
fn snapshot_bytes_are_the_configs_state_bytes() {
    let dir = Scratch::new("snapshot-bytes");
    let config = tiny(dir.path(), 1, None);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
    let mut session = model.session();
    let tokens = prompt(40, 0);
    let mut at = 0;
    for n in [0, 1, 7, 40] {
        model.prefill(&mut session, &tokens[at..n], 64).unwrap();
        at = n;
        let snap = session.snapshot();
        assert_eq!(snap.position(), n);
        assert_eq!(snap.bytes(), state_bytes(&config, n), "{n} tokens");
    }
    // The MLA part grows with the position, the KDA part does not.
    assert!(state_bytes(&config, 41) > state_bytes(&config, 40));
    for preset in [Preset::Tiny, Preset::K3_040B] {
        let config = K3Config::from_json(&preset_config(preset, None, None).to_string()).unwrap();
        for n in [0, 1000, 2000, 16_000] {
            println!("{preset}: {n} tokens: {} bytes", state_bytes(&config, n));
        }
    }
}

#[test]
fn a_restored_session_continues_with_the_cold_runs_bits() {
    let dir = Scratch::new("snapshot-resume");
    let config = tiny(dir.path(), 2, None);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let kernels = Kernels::detect();
    let tokens = prompt(PROMPT, 1);
    let reference = cold(&Model::new(&ckpt, &config, kernels).unwrap(), &tokens, 64);
    for threads in [1, 2] {
        for fake_domains in [None, Some(2)] {
            let pool = PoolOptions {
                fake_domains,
                threads: Some(threads),
                ..PoolOptions::default()
            }
            .build()
            .unwrap();
            // Threshold 0: every projection and head group is split into tasks.
            let model = Model::new(&ckpt, &config, kernels)
                .unwrap()
                .with_pool(Arc::new(pool))
                .with_parallel_threshold(0);
            for chunk in [1, 7, 64] {
                let what = format!("{threads} threads, domains {fake_domains:?}, chunk {chunk}");
                assert_eq!(cold(&model, &tokens, chunk), reference, "{what}: cold");
                let snap = snapshot_at_prefix(&model, &tokens, chunk);
                let mut fresh = model.session();
                model.restore(&mut fresh, &snap).unwrap();
                assert_eq!(fresh.position(), PREFIX);
                let resumed = continue_from(&model, &mut fresh, &tokens[PREFIX..], chunk);
                assert_eq!(resumed, reference, "{what}: resumed");
                // Restoring into a used session (longer MLA caches) gives the same.
                let mut used = model.session();
                model
                    .prefill(&mut used, &prompt(PROMPT + 5, 4), chunk)
                    .unwrap();
                used.restore(&snap).unwrap();
                let again = continue_from(&model, &mut used, &tokens[PREFIX..], chunk);
                assert_eq!(again, reference, "{what}: restored over a used session");
            }
        }
    }
}

#[test]
fn a_restored_session_keeps_its_bits_inside_a_decode_batch() {
    let dir = Scratch::new("snapshot-batch");
    let config = tiny(dir.path(), 3, None);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let pool = PoolOptions {
        fake_domains: Some(2),
        threads: Some(2),
        ..PoolOptions::default()
    }
    .build()
    .unwrap();
    let model = Model::new(&ckpt, &config, Kernels::detect())
        .unwrap()
        .with_pool(Arc::new(pool))
        .with_parallel_threshold(0);
    let tokens = prompt(PROMPT, 2);
    let other = prompt(33, 5);
    let reference = cold(&model, &tokens, 7);
    let other_reference = cold(&model, &other, 7);
    let snap = snapshot_at_prefix(&model, &tokens, 7);
    let mut resumed = model.session();
    model.restore(&mut resumed, &snap).unwrap();
    let mut unrelated = model.session();
    let mut got = vec![fingerprint(
        &model.prefill(&mut resumed, &tokens[PREFIX..], 7).unwrap(),
    )];
    let mut other_got = vec![fingerprint(
        &model.prefill(&mut unrelated, &other, 7).unwrap(),
    )];
    for &t in &DECODE {
        let rows = model
            .decode_batch(&mut [(&mut unrelated, t), (&mut resumed, t)])
            .unwrap();
        other_got.push(fingerprint(&rows[0]));
        got.push(fingerprint(&rows[1]));
    }
    assert_eq!(got, reference, "the resumed sequence");
    assert_eq!(other_got, other_reference, "the unrelated sequence");
}

#[test]
fn a_snapshot_of_another_model_is_refused() {
    let (a, b) = (
        Scratch::new("snapshot-model-a"),
        Scratch::new("snapshot-model-b"),
    );
    let config_a = tiny(a.path(), 1, None);
    let config_b = tiny(b.path(), 1, Some(4));
    let (ckpt_a, ckpt_b) = (
        Checkpoint::open(a.path()).unwrap(),
        Checkpoint::open(b.path()).unwrap(),
    );
    let kernels = Kernels::detect();
    let model_a = Model::new(&ckpt_a, &config_a, kernels).unwrap();
    let model_b = Model::new(&ckpt_b, &config_b, kernels).unwrap();
    let mut session = model_b.session();
    model_b.prefill(&mut session, &prompt(5, 0), 64).unwrap();
    let mut target = model_a.session();
    let err = model_a
        .restore(&mut target, &session.snapshot())
        .unwrap_err();
    assert_eq!(
        err,
        SnapshotError::Layers {
            expected: config_a.layers.len(),
            found: 4
        }
    );
    assert_eq!(
        target.position(),
        0,
        "a refused restore leaves the session alone"
    );
}

/// A tiny model with its identity, and a file holding its snapshot after `tokens`.
struct Saved {
    _dir: Scratch,
    files: Scratch,
    config: K3Config,
    ckpt: Checkpoint,
    tokens: Vec<usize>,
    path: PathBuf,
}

fn saved(tag: &str) -> Saved {
    let dir = Scratch::new(&format!("snapshot-{tag}-ckpt"));
    let files = Scratch::new(&format!("snapshot-{tag}-files"));
    let config = tiny(dir.path(), 4, None);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let tokens = prompt(PREFIX, 6);
    let path = files.path().join("state.k3state");
    {
        let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
        let mut session = model.session();
        model.prefill(&mut session, &tokens, 7).unwrap();
        let report = file::save(
            &path,
            &Identity::of(&ckpt, &config),
            &tokens,
            &session.snapshot(),
        )
        .unwrap();
        println!("{report:?}");
        assert_eq!(report.bytes, std::fs::metadata(&path).unwrap().len());
    }
    Saved {
        _dir: dir,
        files,
        config,
        ckpt,
        tokens,
        path,
    }
}

#[test]
fn a_snapshot_file_round_trips_to_the_same_bits() {
    let s = saved("roundtrip");
    let identity = Identity::of(&s.ckpt, &s.config);
    let model = Model::new(&s.ckpt, &s.config, Kernels::detect()).unwrap();
    let rest = prompt(PROMPT, 6)[PREFIX..].to_vec();
    let mut whole = s.tokens.clone();
    whole.extend(&rest);
    let reference = cold(&model, &whole, 64);
    let header = file::read_header(&s.path).unwrap();
    assert_eq!(header.identity, identity);
    let (loaded_header, snap) = file::load(&s.path, &identity).unwrap();
    assert_eq!(loaded_header, header);
    let tokens: Vec<usize> = header.tokens.iter().map(|&t| t as usize).collect();
    assert_eq!(tokens, s.tokens);
    assert_eq!(snap.bytes(), state_bytes(&s.config, PREFIX));
    let mut session = model.session();
    model.restore(&mut session, &snap).unwrap();
    assert_eq!(continue_from(&model, &mut session, &rest, 1), reference);
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(s.files.path()).unwrap().collect();
    assert_eq!(names.len(), 1);
}

#[test]
fn a_flipped_byte_anywhere_is_refused() {
    let s = saved("flip");
    let identity = Identity::of(&s.ckpt, &s.config);
    let good = std::fs::read(&s.path).unwrap();
    let len = good.len();
    // In the header (a token id), in the payload, in the final checksum.
    for (at, part) in [(60, "header"), (len / 2, "payload"), (len - 1, "payload")] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        std::fs::write(&s.path, &bad).unwrap();
        match file::load(&s.path, &identity) {
            Err(FileError::Checksum { part: p, .. }) => assert_eq!(p, part, "byte {at}"),
            other => panic!("byte {at}: {other:?}"),
        }
    }
    // The magic and the format are named as such.
    let mut bad = good.clone();
    bad[0] ^= 1;
    std::fs::write(&s.path, &bad).unwrap();
    assert!(matches!(
        file::load(&s.path, &identity),
        Err(FileError::Magic { .. })
    ));
    let mut bad = good.clone();
    bad[8] = 9;
    std::fs::write(&s.path, &bad).unwrap();
    assert!(matches!(
        file::load(&s.path, &identity),
        Err(FileError::Format { found: 9 })
    ));
}

#[test]
fn a_truncated_or_extended_file_is_refused() {
    let s = saved("truncated");
    let identity = Identity::of(&s.ckpt, &s.config);
    let good = std::fs::read(&s.path).unwrap();
    let len = good.len() as u64;
    for cut in [0, 10, 40, good.len() / 2, good.len() - 1] {
        std::fs::write(&s.path, &good[..cut]).unwrap();
        match file::load(&s.path, &identity) {
            Err(FileError::Truncated { found, .. }) => assert_eq!(found, cut as u64),
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    let mut longer = good.clone();
    longer.push(0);
    std::fs::write(&s.path, &longer).unwrap();
    match file::load(&s.path, &identity) {
        Err(FileError::Length { expected, found }) => assert_eq!((expected, found), (len, len + 1)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn another_checkpoint_or_engine_is_refused() {
    let s = saved("foreign");
    let ours = Identity::of(&s.ckpt, &s.config);
    // The same preset with another seed: same shapes, other values.
    let other_dir = Scratch::new("snapshot-foreign-other");
    let other_config = tiny(other_dir.path(), 5, None);
    let other_ckpt = Checkpoint::open(other_dir.path()).unwrap();
    let theirs = Identity::of(&other_ckpt, &other_config);
    assert_ne!(theirs.checkpoint, ours.checkpoint);
    assert_eq!(theirs.engine, ours.engine);
    match file::load(&s.path, &theirs) {
        Err(FileError::Checkpoint { file, ours: o }) => {
            assert_eq!((file, o), (ours.checkpoint, theirs.checkpoint))
        }
        other => panic!("{other:?}"),
    }
    let newer = Identity {
        engine: "k3-model 9.9.9".into(),
        ..ours.clone()
    };
    match file::load(&s.path, &newer) {
        Err(FileError::Engine { file, ours: o }) => {
            assert_eq!(
                (file.as_str(), o.as_str()),
                (ours.engine.as_str(), "k3-model 9.9.9")
            )
        }
        other => panic!("{other:?}"),
    }
    // The identity is a pure function of the checkpoint: reopening gives the same.
    let reopened = Checkpoint::open(s._dir.path()).unwrap();
    assert_eq!(Identity::of(&reopened, &s.config), ours);
}

#[test]
fn saving_needs_the_tokens_the_snapshot_covers() {
    let s = saved("tokens");
    let identity = Identity::of(&s.ckpt, &s.config);
    let (_, snap) = file::load(&s.path, &identity).unwrap();
    let err = file::save(&s.path, &identity, &s.tokens[1..], &snap).unwrap_err();
    assert!(
        matches!(err, FileError::Tokens { tokens, position } if tokens == PREFIX - 1 && position == PREFIX)
    );
    // The file that was there is untouched.
    assert!(file::load(&s.path, &identity).is_ok());
}

#[test]
fn a_header_with_overflowing_lengths_is_refused_before_allocating() {
    let s = saved("lengths");
    let identity = Identity::of(&s.ckpt, &s.config);
    let mut bytes = std::fs::read(&s.path).unwrap();
    // The first layer's first array length follows the tokens and the layer count: make it
    // huge, then re-seal the header so only the lengths are wrong.
    let body_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    // Prefix, engine, checkpoint, namespace (16), position, token count, tokens, layer count.
    let first_layer = 16 + 2 + identity.engine.len() + 8 + 16 + 8 + 8 + 4 * PREFIX + 4;
    assert!(matches!(bytes[first_layer], 1 | 2), "a KDA or MLA layer");
    bytes[first_layer + 1..first_layer + 9].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let mut sum = Checksum::new();
    sum.update(&bytes[..16 + body_len]);
    bytes[16 + body_len..16 + body_len + 8].copy_from_slice(&sum.finish().to_le_bytes());
    std::fs::write(&s.path, &bytes).unwrap();
    match file::load(&s.path, &identity) {
        Err(FileError::Header { reason }) => assert!(reason.contains("overflow"), "{reason}"),
        other => panic!("{other:?}"),
    }
}
