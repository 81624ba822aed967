//! Opening a snapshot file for reading: only a regular file, and never a wait (a FIFO in the
//! prompt cache's directory must not hold the server's start up, nor its shutdown).

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use expert_store::file::FileKind;

use super::error::FileError;

/// `path` opened for reading, with its length, if it is a regular file; anything else is
/// refused with [`FileError::NotRegular`], and nothing here can block: a path that names
/// something else already is not opened at all (opening a device may do things of its own),
/// and the open itself neither follows a link (`O_NOFOLLOW`) nor waits for a FIFO's writer
/// (`O_NONBLOCK`), for a path swapped between the look and the open; the descriptor's own
/// type (`fstat`) is what decides. `O_NONBLOCK` stays set: reads of a regular file ignore it.
pub(super) fn open_regular(path: &Path) -> Result<(File, u64), FileError> {
    let not_regular = |kind| FileError::NotRegular {
        path: path.to_owned(),
        kind,
    };
    let kind_at = || {
        std::fs::symlink_metadata(path)
            .ok()
            .and_then(|m| FileKind::of(m.file_type()))
    };
    if let Some(kind) = kind_at() {
        return Err(not_regular(kind));
    }
    let (file, meta) = open_descriptor(path).map_err(|source| match kind_at() {
        // A link (ELOOP), a socket (ENXIO), ...: say what is there now.
        Some(kind) => not_regular(kind),
        None => FileError::Io {
            path: path.to_owned(),
            source,
        },
    })?;
    match FileKind::of(meta.file_type()) {
        None => Ok((file, meta.len())),
        Some(kind) => Err(not_regular(kind)),
    }
}

/// `path` opened `O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`, whatever it is, and the
/// descriptor's own metadata (`fstat`).
fn open_descriptor(path: &Path) -> std::io::Result<(File, std::fs::Metadata)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    Ok((file, meta))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use k3_testkit::Scratch;

    use super::super::{Identity, load, read_header};
    use super::*;

    /// Each kind of thing that is not a regular file, made under `dir` (the socket's listener
    /// is returned to keep it bound).
    fn specials(dir: &Path) -> (Vec<(PathBuf, FileKind)>, std::os::unix::net::UnixListener) {
        let target = dir.join("regular");
        std::fs::write(&target, b"K3STATE\0 and more").unwrap();
        let fifo = dir.join("fifo");
        k3_testkit::make_fifo(&fifo);
        let socket = dir.join("socket");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let subdir = dir.join("subdir");
        std::fs::create_dir(&subdir).unwrap();
        let mut made = vec![
            (fifo, FileKind::Fifo),
            (socket, FileKind::Socket),
            (subdir, FileKind::Directory),
        ];
        for (name, to) in [
            ("to-regular", target.as_path()),
            ("to-dev-zero", Path::new("/dev/zero")),
            ("to-fifo", &dir.join("fifo")),
            ("dangling", &dir.join("missing")),
        ] {
            let link = dir.join(name);
            std::os::unix::fs::symlink(to, &link).unwrap();
            made.push((link, FileKind::Symlink));
        }
        if Path::new("/dev/null").exists() {
            made.push(("/dev/null".into(), FileKind::CharDevice));
        }
        (made, listener)
    }

    #[test]
    fn a_regular_file_opens_with_its_length() {
        let dir = Scratch::new("open-regular");
        let path = dir.path().join("state.k3state");
        std::fs::write(&path, b"0123456789").unwrap();
        let (file, len) = open_regular(&path).unwrap();
        assert_eq!(len, 10);
        let mut start = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut start, 0).unwrap();
        assert_eq!(&start, b"0123");
    }

    /// A FIFO, a socket, a directory, links (to a file, to `/dev/zero`, to the FIFO, to
    /// nothing) and a device: each refused at once, by kind, naming the path.
    #[test]
    fn anything_but_a_regular_file_is_refused_by_kind_without_blocking() {
        let dir = Scratch::new("open-specials");
        let (made, _listener) = specials(dir.path());
        for (path, kind) in made {
            let shown = path.display().to_string();
            let refused = k3_testkit::promptly(&shown, Duration::from_secs(5), {
                let path = path.clone();
                move || open_regular(&path).map(|_| ())
            });
            let e = refused.expect_err(&shown);
            let message = e.to_string();
            assert!(
                matches!(&e, FileError::NotRegular { path: p, kind: k } if *p == path && *k == kind),
                "{shown}: {e:?}, expected it refused as {kind}"
            );
            assert!(
                message.contains(&shown) && message.contains(&kind.to_string()),
                "{message}"
            );
        }
        let missing = dir.path().join("missing");
        match open_regular(&missing) {
            Err(FileError::Io { path, source }) => {
                assert_eq!(path, missing);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
    }

    /// The open itself, for a path swapped after the look: a FIFO opens at once and the
    /// descriptor says FIFO, a link is not followed (ELOOP), a socket is not opened (ENXIO).
    #[test]
    fn the_open_itself_neither_waits_nor_follows() {
        let dir = Scratch::new("open-descriptor");
        let (made, _listener) = specials(dir.path());
        for (path, kind) in made {
            let shown = path.display().to_string();
            let opened = k3_testkit::promptly(&shown, Duration::from_secs(5), {
                let path = path.clone();
                move || open_descriptor(&path).map(|(_, meta)| FileKind::of(meta.file_type()))
            });
            match (kind, opened) {
                (FileKind::Symlink, Err(e)) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{shown}")
                }
                (FileKind::Socket, Err(e)) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENXIO), "{shown}")
                }
                (_, Ok(found)) => assert_eq!(found, Some(kind), "{shown}"),
                (_, Err(e)) => panic!("{shown}: {e}"),
            }
        }
    }

    /// What callers use: reading a FIFO's header, or loading it, is refused at once.
    #[test]
    fn read_header_and_load_refuse_a_fifo_at_once() {
        let dir = Scratch::new("open-fifo-read");
        let fifo = dir.path().join("0123456789abcdef-10.k3state");
        k3_testkit::make_fifo(&fifo);
        let identity = Identity {
            engine: "k3-model test".into(),
            checkpoint: 1,
        };
        let header = k3_testkit::promptly("read_header", Duration::from_secs(5), {
            let fifo = fifo.clone();
            move || read_header(&fifo).map(|_| ())
        });
        let loaded = k3_testkit::promptly("load", Duration::from_secs(5), {
            let fifo = fifo.clone();
            move || load(&fifo, &identity).map(|_| ())
        });
        for result in [header, loaded] {
            assert!(
                matches!(&result, Err(FileError::NotRegular { path, kind: FileKind::Fifo }) if *path == fifo),
                "{result:?}"
            );
        }
    }
}
