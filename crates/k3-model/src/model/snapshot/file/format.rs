//! The snapshot file format's constants.

/// The first bytes of every snapshot file.
pub const MAGIC: [u8; 8] = *b"K3STATE\0";
/// The layout this code writes and reads (2: the namespace added; a format 1 file is refused
/// like any other foreign format).
pub const FORMAT_VERSION: u32 = 2;
/// The engine whose bits a snapshot holds: a state is only valid for the code that made it.
pub const ENGINE_VERSION: &str = concat!("k3-model ", env!("CARGO_PKG_VERSION"));
/// Largest header accepted (a corrupt length must not make us allocate gigabytes).
pub(super) const MAX_HEADER: usize = 256 << 20;
/// Bytes read per call.
pub(super) const READ_BLOCK: usize = 4 << 20;
/// Magic, format and header length.
pub(super) const PREFIX: usize = 16;
