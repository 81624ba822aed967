//! Why a snapshot file was not written or not trusted.

use std::path::PathBuf;

use expert_store::file::FileKind;

use super::format::{FORMAT_VERSION, MAGIC};

/// Why a snapshot file was not written or not trusted.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// Opening, reading, writing, syncing or renaming failed.
    #[error("{path}: {source}")]
    Io {
        /// The file (on a write, the temporary file until the rename).
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The path names something other than a regular file; refused before it is opened.
    #[error("{path} is {kind}, not a regular file")]
    NotRegular {
        /// The path given.
        path: PathBuf,
        /// What it names.
        kind: FileKind,
    },
    /// The file does not start with [`MAGIC`]: not a snapshot file.
    #[error("not a snapshot file: magic {found:02x?}, expected {MAGIC:02x?}")]
    Magic {
        /// The file's first 8 bytes.
        found: [u8; 8],
    },
    /// A snapshot file of another layout than [`FORMAT_VERSION`].
    #[error("snapshot format {found}, this engine reads format {FORMAT_VERSION}")]
    Format {
        /// The format the file declares.
        found: u32,
    },
    /// The file ends before its header, or before the payload its header describes.
    #[error("truncated: {found} bytes, the header needs {expected}")]
    Truncated {
        /// Bytes the header implies.
        expected: u64,
        /// Bytes of the file.
        found: u64,
    },
    /// The file is longer than its header describes.
    #[error("{found} bytes, the header says {expected}")]
    Length {
        /// Bytes the header implies.
        expected: u64,
        /// Bytes of the file.
        found: u64,
    },
    /// The header's or the payload's checksum does not match: the file is damaged.
    #[error("{part} checksum {computed:016x}, the file stores {stored:016x}")]
    Checksum {
        /// `"header"` or `"payload"`.
        part: &'static str,
        /// The checksum the file stores.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// Written by another engine version, whose state bits this one may not reproduce.
    #[error("written by engine {file:?}, this is {ours:?}")]
    Engine {
        /// The engine version in the file.
        file: String,
        /// This engine's ([`ENGINE_VERSION`](super::ENGINE_VERSION)).
        ours: String,
    },
    /// Computed with another checkpoint ([`checkpoint_identity`](super::checkpoint_identity)).
    #[error("made with checkpoint {file:016x}, this is {ours:016x}")]
    Checkpoint {
        /// The checkpoint identity in the file.
        file: u64,
        /// The identity of the checkpoint loaded.
        ours: u64,
    },
    /// The header's checksum matched but its content does not parse (or, on a write, would
    /// not fit the format).
    #[error("bad header: {reason}")]
    Header {
        /// What is wrong, with the value and the limit.
        reason: String,
    },
    /// A token id to save exceeds the format's 32-bit ids.
    #[error(
        "token {token} does not fit the file's 32-bit token ids (limit {})",
        u32::MAX
    )]
    Token {
        /// The token id.
        token: usize,
    },
    /// The tokens given to save are not as many as the snapshot's position.
    #[error("{tokens} tokens given for a snapshot at position {position}")]
    Tokens {
        /// Tokens given.
        tokens: usize,
        /// The snapshot's position.
        position: usize,
    },
}

pub(super) type Result<T, E = FileError> = std::result::Result<T, E>;
