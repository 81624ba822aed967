//! Why a snapshot file was not written or not trusted, and what a path that is not a regular
//! file is.

use std::fs::FileType;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;

use super::format::{FORMAT_VERSION, MAGIC};

/// What a path that is not a regular file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Fifo,
    Socket,
    Directory,
    Symlink,
    CharDevice,
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

/// Why a snapshot file was not written or not trusted.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: FileKind },
    #[error("not a snapshot file: magic {found:02x?}, expected {MAGIC:02x?}")]
    Magic { found: [u8; 8] },
    #[error("snapshot format {found}, this engine reads format {FORMAT_VERSION}")]
    Format { found: u32 },
    #[error("truncated: {found} bytes, the header needs {expected}")]
    Truncated { expected: u64, found: u64 },
    #[error("{found} bytes, the header says {expected}")]
    Length { expected: u64, found: u64 },
    #[error("{part} checksum {computed:016x}, the file stores {stored:016x}")]
    Checksum {
        part: &'static str,
        stored: u64,
        computed: u64,
    },
    #[error("written by engine {file:?}, this is {ours:?}")]
    Engine { file: String, ours: String },
    #[error("made with checkpoint {file:016x}, this is {ours:016x}")]
    Checkpoint { file: u64, ours: u64 },
    #[error("bad header: {reason}")]
    Header { reason: String },
    #[error(
        "token {token} does not fit the file's 32-bit token ids (limit {})",
        u32::MAX
    )]
    Token { token: usize },
    #[error("{tokens} tokens given for a snapshot at position {position}")]
    Tokens { tokens: usize, position: usize },
}

pub(super) type Result<T, E = FileError> = std::result::Result<T, E>;
