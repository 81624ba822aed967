//! The pack cache on the tiny checkpoint: each matrix's body, exception blocks and row index
//! are what `pack_rows_into` makes of its BF16 bytes; a written file reopens; a file of
//! another checkpoint, a changed source or a damaged manifest is stale and written again; a
//! place that cannot take the file reports why.

use std::path::{Path, PathBuf};

use expert_store::Checkpoint;
use expert_store::io::IO_ALIGN;
use k3_testkit::Scratch;
use mxfp4_kernels::packed::{EXCEPTION_BYTES, packed_body_bytes};
use numa_sched::Pool;

use super::place::{Outcome, PackCachePlace, file_name};
use super::types::{PackCache, PackCacheError};
use crate::config::K3Config;
use crate::plan::WeightSizes;
use crate::synth::{Preset, SynthOptions, generate};

/// A fresh `tiny` checkpoint in its own directory (removed on drop).
struct Tiny(Scratch, K3Config);

impl Tiny {
    fn new(name: &str) -> Self {
        let dir = Scratch::new(&format!("packcache-{name}"));
        let config = generate(dir.path(), &SynthOptions::new(Preset::Tiny))
            .unwrap()
            .config;
        Self(dir, config)
    }

    fn sizes(&self) -> (Checkpoint, WeightSizes) {
        let ckpt = Checkpoint::open(self.0.path()).unwrap();
        let sizes = WeightSizes::new(&ckpt, &self.1).unwrap();
        (ckpt, sizes)
    }
}

fn pool() -> Pool {
    Pool::new(2).unwrap()
}

#[test]
fn each_matrix_is_held_as_pack_rows_into_makes_it_and_the_file_reopens() {
    let tiny = Tiny::new("holds");
    let (ckpt, sizes) = tiny.sizes();
    let want = sizes.packable();
    assert!(want.len() > 3, "the tiny trunk has BF16 matrices");
    let path = tiny.0.path().join("cache").join(file_name(7));
    // A writer killed mid-write left its temporary file (no process has that pid); one of a
    // live process (pid 1) is left alone.
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let abandoned = path.with_extension(format!("tmp{}", u32::MAX));
    let live = path.with_extension("tmp1");
    std::fs::write(&abandoned, b"partial").unwrap();
    std::fs::write(&live, b"partial").unwrap();
    let cache = PackCache::write(&path, 7, &want, &pool(), &[]).unwrap();
    assert!(!abandoned.exists() && live.exists());
    std::fs::remove_file(&live).unwrap();
    let file = std::fs::read(&path).unwrap();
    let mut exceptions_seen = 0;
    for t in &want {
        let held = cache.get(&t.name).unwrap();
        let cols = t.pack_cols.unwrap();
        assert_eq!((held.rows, held.cols), (t.rows, cols), "{}", t.name);
        assert!(held.body.is_multiple_of(IO_ALIGN), "{}", t.name);
        let bf16 = ckpt.require(&t.name).unwrap().bytes;
        let mut body = vec![0u8; packed_body_bytes(t.rows, cols)];
        let (mut exceptions, mut starts) = (Vec::new(), Vec::new());
        mxfp4_kernels::pack_rows_into(bf16, cols, &mut body, &mut exceptions, &mut starts);
        starts.push((exceptions.len() / EXCEPTION_BYTES) as u32);
        assert_eq!(
            &file[held.body..held.body + body.len()],
            &body[..],
            "{}",
            t.name
        );
        assert_eq!(held.exceptions, exceptions, "{}", t.name);
        assert_eq!(held.row_exceptions, starts, "{}", t.name);
        exceptions_seen += exceptions.len();
    }
    // The synthetic weights are Gaussian: nearly every block packs.
    let (body, bf16) = cache.body_bytes();
    assert!(body * 100 <= bf16 * 77, "{body} of {bf16}");
    assert_eq!(
        cache.side_bytes(),
        (exceptions_seen + want.iter().map(|t| 4 * (t.rows + 1)).sum::<usize>()) as u64
    );
    // Opened again: the same matrices; through open_or_write, no write.
    let again = PackCache::open(&path, 7, &want).unwrap().unwrap();
    assert_eq!(again.side_bytes(), cache.side_bytes());
    let dirs = [path.parent().unwrap().to_owned()];
    let (_, outcome) = PackCache::open_or_write(&dirs, 7, &want, &pool(), &[]).unwrap();
    assert_eq!(outcome, Outcome::Opened);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dirs[0])
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [std::ffi::OsString::from(file_name(7))]);
}

#[test]
fn a_stale_or_damaged_file_is_written_again() {
    let tiny = Tiny::new("stale");
    let (_ckpt, sizes) = tiny.sizes();
    let want = sizes.packable();
    let dir = tiny.0.path().join("cache");
    let path = dir.join(file_name(9));
    assert_eq!(
        PackCache::open(&path, 9, &want).unwrap().unwrap_err(),
        "none was there"
    );
    PackCache::write(&path, 9, &want, &pool(), &[]).unwrap();
    // Another checkpoint's identity.
    let why = PackCache::open(&path, 10, &want).unwrap().unwrap_err();
    assert!(why.contains("another checkpoint"), "{why}");
    // A source file touched since: stale, and written again by open_or_write.
    let source = std::fs::File::options()
        .write(true)
        .open(&want[0].path)
        .unwrap();
    source
        .set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(source);
    let why = PackCache::open(&path, 9, &want).unwrap().unwrap_err();
    assert!(why.contains("changed since it was written"), "{why}");
    let (_, outcome) =
        PackCache::open_or_write(std::slice::from_ref(&dir), 9, &want, &pool(), &[]).unwrap();
    assert!(
        matches!(&outcome, Outcome::Written { why, .. } if why.contains("changed")),
        "{outcome:?}"
    );
    assert!(PackCache::open(&path, 9, &want).unwrap().is_ok());
    // A flipped byte in the manifest (the file's last page holds its end).
    let mut bytes = std::fs::read(&path).unwrap();
    let header = &bytes[..64];
    let at = u64::from_le_bytes(header[20..28].try_into().unwrap()) as usize;
    bytes[at + 5] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let why = PackCache::open(&path, 9, &want).unwrap().unwrap_err();
    assert!(why.contains("damaged"), "{why}");
    // A matrix the file does not hold.
    PackCache::write(&path, 9, &want[1..], &pool(), &[]).unwrap();
    let why = PackCache::open(&path, 9, &want).unwrap().unwrap_err();
    assert!(why.contains("does not hold"), "{why}");
}

#[test]
fn a_place_that_cannot_take_the_file_says_why() {
    let tiny = Tiny::new("place");
    let (_ckpt, sizes) = tiny.sizes();
    let want = sizes.packable();
    // A directory under a regular file cannot be made (even by root).
    let blocker = tiny.0.path().join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let errors =
        PackCache::open_or_write(&[blocker.join("cache")], 3, &want, &pool(), &[]).unwrap_err();
    assert_eq!(errors.len(), 1);
    assert!(
        matches!(&errors[0], PackCacheError::Io { path, .. } if path.starts_with(&blocker)),
        "{errors:?}"
    );
    // The next place is tried.
    let good = tiny.0.path().join("good");
    let (cache, outcome) = PackCache::open_or_write(
        &[blocker.join("cache"), good.clone()],
        3,
        &want,
        &pool(),
        &[],
    )
    .unwrap();
    assert!(matches!(outcome, Outcome::Written { .. }), "{outcome:?}");
    assert!(cache.path().starts_with(&good));
}

#[test]
fn the_places_tried_follow_the_option() {
    let ckpt = Path::new("/models/k3");
    let user = PathBuf::from("/home/u/.cache/k3");
    assert_eq!(PackCachePlace::default().dirs(ckpt), [ckpt.to_owned()]);
    assert_eq!(
        PackCachePlace::Auto(Some(user.clone())).dirs(ckpt),
        [ckpt.to_owned(), user.clone()]
    );
    assert_eq!(PackCachePlace::Dir(user.clone()).dirs(ckpt), [user]);
    assert!(PackCachePlace::Off.dirs(ckpt).is_empty());
}
