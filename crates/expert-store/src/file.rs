//! Opening the files a checkpoint directory and the command line name (the config, the index,
//! the shards, the tokenizer's files, the usage file, a schema, a key file): only a regular
//! file, reached through links or not, and never a wait. A FIFO in their place would block
//! `open` until a writer came, a device such as `/dev/zero` would be read for ever; both are
//! refused by kind ([`FileKind`]) before anything is read, and a small file is read whole only
//! up to the cap its caller states ([`read_regular`]), so a giant file fails fast too.

use std::fs::{File, FileType};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What a path that is not a regular file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A named pipe: opening it to read would block until a writer comes.
    Fifo,
    /// A Unix domain socket.
    Socket,
    /// A directory.
    Directory,
    /// A symbolic link (seen only where links are not followed).
    Symlink,
    /// A character device (`/dev/zero`, a terminal): its reads may never end.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A type none of the others names.
    Other,
}

impl FileKind {
    /// The kind of `file_type`; `None` for a regular file.
    pub fn of(file_type: FileType) -> Option<Self> {
        if file_type.is_file() {
            None
        } else if file_type.is_fifo() {
            Some(FileKind::Fifo)
        } else if file_type.is_socket() {
            Some(FileKind::Socket)
        } else if file_type.is_dir() {
            Some(FileKind::Directory)
        } else if file_type.is_symlink() {
            Some(FileKind::Symlink)
        } else if file_type.is_char_device() {
            Some(FileKind::CharDevice)
        } else if file_type.is_block_device() {
            Some(FileKind::BlockDevice)
        } else {
            Some(FileKind::Other)
        }
    }
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileKind::Fifo => "a FIFO",
            FileKind::Socket => "a socket",
            FileKind::Directory => "a directory",
            FileKind::Symlink => "a symbolic link",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Other => "of an unknown type",
        })
    }
}

/// Why a file was not opened or read; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum ReadFileError {
    /// Looking at, opening or reading the file failed (it is missing, unreadable, ...).
    #[error("{path}: {source}")]
    Io {
        /// The path given.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The path names (or its links lead to) something other than a regular file; refused
    /// before it is read, and before it is opened at all when that is known in time.
    #[error("{path} is {kind}, not a regular file")]
    NotRegular {
        /// The path given.
        path: PathBuf,
        /// What it names.
        kind: FileKind,
    },
    /// The file holds more than its caller's cap.
    #[error("{path} is {size} bytes, more than the {limit} bytes this file may hold")]
    TooLarge {
        /// The path given.
        path: PathBuf,
        /// Its length (for a file that grew while it was read, the bytes read: `limit + 1`).
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// The file is not UTF-8 text.
    #[error("{path}: not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 {
        /// The path given.
        path: PathBuf,
        /// Where the first invalid byte is.
        offset: usize,
    },
}

impl ReadFileError {
    /// Whether nothing is at the path (a caller with an optional file reads that as absence).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReadFileError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// What `path` names, links followed: `None` for a regular file. Looks only (`stat`), so it
/// neither blocks on a FIFO nor opens a device.
pub fn kind_at(path: &Path) -> Result<Option<FileKind>, ReadFileError> {
    std::fs::metadata(path)
        .map(|meta| FileKind::of(meta.file_type()))
        .map_err(|source| ReadFileError::Io {
            path: path.to_owned(),
            source,
        })
}

/// `path` opened for reading, with its length, if it is (or its links lead to) a regular
/// file; anything else is [`ReadFileError::NotRegular`], and nothing here blocks. What the path
/// names is looked at first, so a device is never opened (opening one may act of its own: a
/// terminal, a tape); the open itself does not wait for a FIFO's writer (`O_NONBLOCK`), for a
/// path swapped between the look and the open, and the descriptor's own type (`fstat`) then
/// decides. `O_NONBLOCK` stays set: reads and maps of a regular file ignore it.
pub fn open_regular(path: &Path) -> Result<(File, u64), ReadFileError> {
    let not_regular = |kind| ReadFileError::NotRegular {
        path: path.to_owned(),
        kind,
    };
    let io = |source| ReadFileError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(kind) = kind_at(path)? {
        return Err(not_regular(kind));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    match FileKind::of(meta.file_type()) {
        None => Ok((file, meta.len())),
        Some(kind) => Err(not_regular(kind)),
    }
}

/// The bytes of the regular file at `path` ([`open_regular`]), at most `max_bytes` of them:
/// a longer file is [`ReadFileError::TooLarge`], told from its length before a byte is read
/// (and, for a file that grows meanwhile, by reading one byte past the cap, never more).
pub fn read_regular(path: &Path, max_bytes: u64) -> Result<Vec<u8>, ReadFileError> {
    let too_large = |size| ReadFileError::TooLarge {
        path: path.to_owned(),
        size,
        limit: max_bytes,
    };
    let (file, len) = open_regular(path)?;
    if len > max_bytes {
        return Err(too_large(len));
    }
    // `len` fits: it is at most the cap, which the caller sized to hold in memory.
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| ReadFileError::Io {
            path: path.to_owned(),
            source,
        })?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, max_bytes: u64) -> Result<String, ReadFileError> {
    String::from_utf8(read_regular(path, max_bytes)?).map_err(|e| ReadFileError::NotUtf8 {
        path: path.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })
}

#[cfg(test)]
mod tests;
