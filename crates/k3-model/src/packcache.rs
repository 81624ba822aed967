//! The pack cache: the trunk's BF16 matrices packed losslessly (`mxfp4_kernels::packed`: 49
//! bytes per 32 weights instead of 64), written once to a file beside the checkpoint (or in a
//! directory the caller gives where the checkpoint's is read-only), keyed by the checkpoint's
//! identity, so a memory plan's trunk stream reads 0.77x the bytes it would read as stored.
//!
//! The file: a header page (magic, version, the checkpoint identity, where the manifest lies
//! and its checksum, the file's length, the header's own checksum); each matrix's body at a
//! 4 KiB boundary, in checkpoint order (rows of a fixed stride, so a row block is one range);
//! then the manifest: the source files' sizes and modification times, and per matrix its name,
//! source, shape, body offset and checksum, exception blocks and row index. The exception
//! blocks and row indexes (0.2% of the bodies on k3-wide) are held in memory; the stream reads
//! the bodies with `O_DIRECT`.
//!
//! Opening checks the header, the file's length and the manifest before anything the file
//! states is allocated or used; the bodies are checked against their checksums as the build
//! first reads them (a resident load as it goes, [`PackCache::verify`] the rest), and a file
//! found damaged is written again: a corrupt file changes no logits. Anything but a regular
//! file in its place (a FIFO, a device) is not read, and not replaced.
//!
//! [`PackCache::verify`]: types::PackCache::verify
//!
//! The file is written under a temporary name with `O_DIRECT` (no page-cache copy against the
//! memory budget) and renamed into place once complete and synced, so a reader sees a whole
//! file or none. A file whose identity, sources (size, modification time) or matrices do not
//! match the checkpoint is stale and is written again. Writing fails cleanly (unwritable
//! directory, too little free space, an I/O error): the caller then streams the matrices as
//! stored.

mod format;
pub(crate) mod place;
mod read;
#[cfg(test)]
mod tests;
pub(crate) mod types;
mod verify;
mod write;
