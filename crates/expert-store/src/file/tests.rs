//! The file opener's refusals: each special kind at once, by name and kind; a cap by length;
//! a missing file and bad UTF-8 told apart.

use std::path::PathBuf;
use std::time::Duration;

use k3_testkit::{Scratch, make_fifo, promptly};

use super::*;

/// Each thing that is not a regular file, made under `dir`, reached directly and through a
/// link (the socket's listener is returned to keep it bound).
fn specials(dir: &Path) -> (Vec<(PathBuf, FileKind)>, std::os::unix::net::UnixListener) {
    let fifo = dir.join("fifo");
    make_fifo(&fifo);
    let socket = dir.join("socket");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let subdir = dir.join("subdir");
    std::fs::create_dir(&subdir).unwrap();
    let mut made = vec![
        (fifo.clone(), FileKind::Fifo),
        (socket, FileKind::Socket),
        (subdir, FileKind::Directory),
        ("/dev/zero".into(), FileKind::CharDevice),
    ];
    for (name, to, kind) in [
        ("to-fifo", fifo.as_path(), FileKind::Fifo),
        ("to-dev-zero", Path::new("/dev/zero"), FileKind::CharDevice),
        (
            "to-dev-urandom",
            Path::new("/dev/urandom"),
            FileKind::CharDevice,
        ),
    ] {
        let link = dir.join(name);
        std::os::unix::fs::symlink(to, &link).unwrap();
        made.push((link, kind));
    }
    (made, listener)
}

#[test]
fn a_regular_file_is_read_through_links_within_its_cap() {
    let dir = Scratch::new("file-regular");
    let path = dir.path().join("config.json");
    std::fs::write(&path, "{\"a\": 1}").unwrap();
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    for p in [&path, &link] {
        assert_eq!(read_regular_text(p, 8).unwrap(), "{\"a\": 1}");
        assert_eq!(open_regular(p).unwrap().1, 8);
        assert_eq!(kind_at(p).unwrap(), None);
    }
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").unwrap();
    assert_eq!(read_regular(&empty, 0).unwrap(), b"");
}

/// A FIFO, a socket, a directory, `/dev/zero`, and links to a FIFO, `/dev/zero` and
/// `/dev/urandom`: each refused at once by kind, naming the path, without a byte read.
#[test]
fn anything_but_a_regular_file_is_refused_by_kind_without_blocking() {
    let dir = Scratch::new("file-specials");
    let (made, _listener) = specials(dir.path());
    for (path, kind) in made {
        let shown = path.display().to_string();
        let refused = promptly(&shown, Duration::from_secs(5), {
            let path = path.clone();
            move || read_regular_text(&path, 1 << 20).map(|_| ())
        });
        let e = refused.expect_err(&shown);
        assert!(
            matches!(&e, ReadFileError::NotRegular { path: p, kind: k } if *p == path && *k == kind),
            "{shown}: {e:?}, expected it refused as {kind}"
        );
        let message = e.to_string();
        assert_eq!(message, format!("{shown} is {kind}, not a regular file"));
        assert_eq!(kind_at(&path).unwrap(), Some(kind), "{shown}");
    }
}

#[test]
fn a_file_over_its_cap_is_refused_by_its_length() {
    let dir = Scratch::new("file-cap");
    let path = dir.path().join("big");
    std::fs::write(&path, [b'x'; 100]).unwrap();
    assert_eq!(read_regular(&path, 100).unwrap().len(), 100);
    let e = read_regular(&path, 99).unwrap_err();
    assert!(
        matches!(
            e,
            ReadFileError::TooLarge {
                size: 100,
                limit: 99,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("100 bytes") && e.to_string().contains("99"));
}

#[test]
fn missing_and_non_utf8_files_say_so() {
    let dir = Scratch::new("file-errors");
    let missing = dir.path().join("missing");
    let e = read_regular(&missing, 10).unwrap_err();
    assert!(e.is_not_found(), "{e:?}");
    assert!(e.to_string().starts_with(&missing.display().to_string()));
    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(&missing, &dangling).unwrap();
    assert!(read_regular(&dangling, 10).unwrap_err().is_not_found());
    let binary = dir.path().join("binary");
    std::fs::write(&binary, b"ok\xff").unwrap();
    let e = read_regular_text(&binary, 10).unwrap_err();
    assert!(
        matches!(e, ReadFileError::NotUtf8 { offset: 2, .. }),
        "{e:?}"
    );
    assert!(!e.is_not_found());
}
