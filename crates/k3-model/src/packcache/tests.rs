//! The pack cache on the tiny checkpoint: each matrix's body, exception blocks and row index
//! are what `pack_rows_into` makes of its BF16 bytes; a written file reopens; a file of
//! another checkpoint, a changed source or a damaged manifest is stale and written again; a
//! place that cannot take the file reports why.

use std::os::unix::fs::FileTypeExt;
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

/// A written cache of `identity` for the tiny checkpoint: the file and the matrices it holds.
fn written(tiny: &Tiny, identity: u64) -> (PathBuf, Vec<crate::plan::StoredTensor>) {
    let (_ckpt, sizes) = tiny.sizes();
    let want: Vec<_> = sizes.packable().into_iter().cloned().collect();
    let path = tiny.0.path().join("cache").join(file_name(identity));
    PackCache::write(
        &path,
        identity,
        &want.iter().collect::<Vec<_>>(),
        &pool(),
        &[],
    )
    .unwrap();
    (path, want)
}

/// Why `open` finds the file at `path` stale (it must be).
fn stale(path: &Path, identity: u64, want: &[crate::plan::StoredTensor]) -> String {
    let want: Vec<_> = want.iter().collect();
    PackCache::open(path, identity, &want).unwrap().unwrap_err()
}

#[test]
fn a_header_that_does_not_fit_the_file_is_stale_and_nothing_is_allocated_for_it() {
    use super::format::{HEADER_BYTES, Header};
    let tiny = Tiny::new("header");
    let (path, want) = written(&tiny, 5);
    let good = std::fs::read(&path).unwrap();
    let header = Header::parse(&good, 5).unwrap();
    // One bit of the manifest's length flipped (the fuzzer's 4 TB allocation): the header's
    // checksum no longer matches.
    let mut bytes = good.clone();
    bytes[33] ^= 4;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(stale(&path, 5, &want), "its header is damaged");
    // Headers whose checksum matches but whose fields do not fit the file: refused before
    // the manifest's buffer is allocated (a length of 2^62 would abort the process).
    let size = good.len() as u64;
    for bad in [
        Header {
            manifest_len: 1 << 62,
            ..header
        },
        Header {
            manifest_len: u64::MAX,
            ..header
        },
        Header {
            manifest_at: u64::MAX - 4095,
            ..header
        },
        Header {
            manifest_at: 0,
            manifest_len: size - 4096,
            ..header
        },
        Header {
            manifest_at: header.manifest_at + 1,
            ..header
        },
    ] {
        let mut bytes = good.clone();
        bytes[..HEADER_BYTES].copy_from_slice(&bad.to_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let why = stale(&path, 5, &want);
        assert!(why.contains("outside its"), "{bad:?}: {why}");
    }
    // Treated as absent: written again, and then whole.
    let dirs = [path.parent().unwrap().to_owned()];
    let want_refs: Vec<_> = want.iter().collect();
    let (_, outcome) = PackCache::open_or_write(&dirs, 5, &want_refs, &pool(), &[]).unwrap();
    assert!(
        matches!(&outcome, Outcome::Written { why, .. } if why.contains("outside its")),
        "{outcome:?}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), good);
}

#[test]
fn a_file_cut_short_or_extended_is_stale() {
    let tiny = Tiny::new("length");
    let (path, want) = written(&tiny, 6);
    let good = std::fs::read(&path).unwrap();
    for bytes in [
        &good[..good.len() - 1],
        &good[..good.len() - IO_ALIGN],
        &[&good[..], &[0u8; IO_ALIGN]].concat()[..],
        &[&good[..], &[0u8; 1]].concat()[..],
    ] {
        std::fs::write(&path, bytes).unwrap();
        let why = stale(&path, 6, &want);
        assert!(
            why.contains("cut short or extended"),
            "{} bytes: {why}",
            bytes.len()
        );
    }
    std::fs::write(&path, &good[..40]).unwrap();
    assert_eq!(stale(&path, 6, &want), "its header is cut short");
}

#[test]
fn a_flipped_byte_in_a_body_is_found_before_it_is_used() {
    let tiny = Tiny::new("body");
    let (path, want) = written(&tiny, 8);
    let want_refs: Vec<_> = want.iter().collect();
    let cache = PackCache::open(&path, 8, &want_refs).unwrap().unwrap();
    cache.verify(&[], &[]).unwrap();
    let good = std::fs::read(&path).unwrap();
    // A byte of each matrix's body in turn: the open is cheap and does not see it, the check
    // names the matrix (and skips it where a resident load checked it already).
    for (k, t) in want.iter().enumerate() {
        let held = cache.get(&t.name).unwrap();
        let mut bytes = good.clone();
        bytes[held.body + held.body_bytes() / 2] ^= 0x04;
        std::fs::write(&path, &bytes).unwrap();
        let reopened = PackCache::open(&path, 8, &want_refs).unwrap().unwrap();
        let error = reopened.verify(&[], &[]).unwrap_err();
        assert!(
            matches!(&error, PackCacheError::Damaged { tensor, .. } if *tensor == t.name),
            "{error}"
        );
        let k = reopened.position(&t.name).unwrap_or(k);
        reopened.verify(&[k], &[]).unwrap();
    }
    // The exception blocks and row indexes are in the manifest, under its checksum.
    let mut bytes = good.clone();
    let at = u64::from_le_bytes(good[20..28].try_into().unwrap()) as usize;
    bytes[at + 200] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(stale(&path, 8, &want), "its manifest is damaged");
}

#[test]
fn a_fifo_in_the_files_place_is_neither_waited_on_nor_replaced() {
    let tiny = Tiny::new("fifo");
    let (_ckpt, sizes) = tiny.sizes();
    let want: Vec<_> = sizes.packable().into_iter().cloned().collect();
    let dir = tiny.0.path().join("cache");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(file_name(4));
    k3_testkit::make_fifo(&path);
    // A blocking open of a FIFO with no writer would never return: the test fails after 5 s.
    let (p, w) = (path.clone(), want.clone());
    let (opened, written) = k3_testkit::promptly(
        "the open of a FIFO in the pack cache's place",
        std::time::Duration::from_secs(5),
        move || {
            let w: Vec<_> = w.iter().collect();
            let opened = PackCache::open(&p, 4, &w).map(|r| r.map(|_| ()));
            let written = PackCache::open_or_write(
                std::slice::from_ref(&p.parent().unwrap().to_owned()),
                4,
                &w,
                &pool(),
                &[],
            );
            (opened, written.map(|_| ()))
        },
    );
    let why = opened.unwrap().unwrap_err();
    assert!(why.contains("not a regular file"), "{why}");
    let errors = written.unwrap_err();
    assert!(
        errors[0].to_string().contains("left as it is"),
        "{errors:?}"
    );
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_fifo()
    );
}
