//! Snapshot files: a checksummed header naming the engine, the checkpoint and the tokens the
//! state covers, then the state's `f32`s (little-endian, layer by layer), then a checksum of
//! everything before it. Written with `O_DIRECT` where the filesystem takes it, to a temporary
//! file renamed over the target (a reader never sees half a file); read back only when the
//! magic, format, header checksum, engine version, checkpoint identity, length and payload
//! checksum all agree (a typed error names the first that does not). Only a regular file is
//! read: a FIFO, socket, device, directory or symbolic link is refused without blocking
//! ([`FileError::NotRegular`]).
//!
//! Layout: `magic (8) | format u32 | header length u32 | header | header checksum u64 |
//! payload | checksum u64`. The header: engine version (u16 length + UTF-8), checkpoint
//! identity u64, namespace (16 bytes, opaque: see [`FileHeader::namespace`]), position u64, token count u64 + one u32 per token, layer count u32, then per
//! layer a kind byte (0 none, 1 KDA, 2 MLA) and its arrays' lengths as u64 (KDA: window,
//! state; MLA: latent, k_pe). The payload: per KDA layer its three windows then its state,
//! per MLA layer its latent rows then its `k_pe` rows.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use expert_store::io::drop_page_cache;

use super::{LayerState, OwnedLayer, Snapshot};

mod error;
mod format;
mod identity;
mod open;
mod writer;

pub use crate::io::atomic::WriteReport;
pub use crate::io::checksum::Checksum;
pub use error::FileError;
pub use format::{ENGINE_VERSION, FORMAT_VERSION, MAGIC};
#[cfg(test)]
use identity::read_samples;
pub use identity::{Identity, checkpoint_identity, numerics};

use error::Result;
use format::{MAX_HEADER, PREFIX, READ_BLOCK};
use open::open_regular;
use writer::Writer;

/// A snapshot file's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    /// What the snapshot is valid for.
    pub identity: Identity,
    /// An opaque tag its writer stored with the state ([`save_in`]): k3-serve's prompt cache
    /// keeps the tenant's cache namespace there, so a file is only ever found again for the
    /// tenant that wrote it. Zeros from [`save`].
    pub namespace: [u8; 16],
    /// The tokens the state covers, in order (as many as the position).
    pub tokens: Vec<u32>,
    /// Bytes of the whole file.
    pub file_bytes: u64,
    layers: Vec<LayerSpec>,
    /// Offset of the payload.
    payload_at: u64,
}

/// A layer's kind and arrays' lengths (in `f32`s), as the header lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LayerSpec {
    Kda { window: u64, state: u64 },
    Mla { latent: u64, k_pe: u64 },
    Empty,
}

impl LayerSpec {
    /// Values of the layer's arrays (`decode_header` checked that they cannot overflow).
    fn values(self) -> u64 {
        self.checked_values()
            .expect("checked when the header was read")
    }

    fn checked_values(self) -> Option<u64> {
        match self {
            LayerSpec::Kda { window, state } => window.checked_mul(3)?.checked_add(state),
            LayerSpec::Mla { latent, k_pe } => latent.checked_add(k_pe),
            LayerSpec::Empty => Some(0),
        }
    }
}

/// Writes `snapshot`, which covers `tokens`, to `path` for `identity` (atomically: a
/// temporary file in the same directory, synced, then renamed over `path`), with a zero
/// namespace.
pub fn save(
    path: &Path,
    identity: &Identity,
    tokens: &[usize],
    snapshot: &Snapshot,
) -> Result<WriteReport> {
    save_in(path, identity, [0; 16], tokens, snapshot)
}

/// [`save`], with `namespace` stored in the header ([`FileHeader::namespace`]).
pub fn save_in(
    path: &Path,
    identity: &Identity,
    namespace: [u8; 16],
    tokens: &[usize],
    snapshot: &Snapshot,
) -> Result<WriteReport> {
    if tokens.len() != snapshot.position() {
        return Err(FileError::Tokens {
            tokens: tokens.len(),
            position: snapshot.position(),
        });
    }
    let header = encode_header(identity, namespace, tokens, snapshot)?;
    let tmp = temp_path(path);
    let io = |source| FileError::Io {
        path: tmp.clone(),
        source,
    };
    // A failure anywhere drops the writer, which removes its temporary file.
    let mut out = Writer::create(path, tmp.clone(), true).map_err(io)?;
    out.put(&header).map_err(io)?;
    for layer in snapshot.layers() {
        match layer {
            LayerState::Kda { windows, state } => {
                for w in windows {
                    out.put_f32s(w).map_err(io)?;
                }
                out.put_f32s(state).map_err(io)?;
            }
            LayerState::Mla { latent, k_pe } => {
                out.put_f32s(latent).map_err(io)?;
                out.put_f32s(k_pe).map_err(io)?;
            }
            LayerState::Empty => {}
        }
    }
    let sum = out.checksum.finish();
    out.put(&sum.to_le_bytes()).map_err(io)?;
    out.finish().map_err(|source| FileError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Reads and checks a file's header (magic, format, header checksum) without its payload.
pub fn read_header(path: &Path) -> Result<FileHeader> {
    let (mut file, len) = open_regular(path)?;
    header_of(&mut file, len).map_err(|e| e.at(path))
}

/// Reads `path`, refusing it unless it was written for `identity` and is whole and intact.
pub fn load(path: &Path, identity: &Identity) -> Result<(FileHeader, Snapshot)> {
    let io = |source| FileError::Io {
        path: path.to_owned(),
        source,
    };
    let (mut file, len) = open_regular(path)?;
    let header = header_of(&mut file, len).map_err(|e| e.at(path))?;
    if header.identity.engine != identity.engine {
        return Err(FileError::Engine {
            file: header.identity.engine,
            ours: identity.engine.clone(),
        });
    }
    if header.identity.checkpoint != identity.checkpoint {
        return Err(FileError::Checkpoint {
            file: header.identity.checkpoint,
            ours: identity.checkpoint,
        });
    }
    let payload: u64 = header.layers.iter().map(|l| l.values() * 4).sum();
    let expected = header.payload_at + payload + 8;
    if len < expected {
        return Err(FileError::Truncated {
            expected,
            found: len,
        });
    }
    if len > expected {
        return Err(FileError::Length {
            expected,
            found: len,
        });
    }
    // Re-read from the start: the checksum covers the header too.
    let mut reader = std::io::BufReader::with_capacity(READ_BLOCK, &file);
    let mut sum = Checksum::new();
    let mut head = vec![0u8; header.payload_at as usize];
    reader.read_exact(&mut head).map_err(io)?;
    sum.update(&head);
    let mut bytes = vec![0u8; READ_BLOCK];
    let mut read = |n: u64, sum: &mut Checksum| -> std::io::Result<Vec<f32>> {
        let mut values = Vec::with_capacity(n as usize);
        let mut left = n as usize * 4;
        while left > 0 {
            let part = &mut bytes[..left.min(READ_BLOCK)];
            reader.read_exact(part)?;
            sum.update(part);
            values.extend(
                part.chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
            );
            left -= part.len();
        }
        Ok(values)
    };
    let mut layers = Vec::with_capacity(header.layers.len());
    for spec in &header.layers {
        layers.push(match *spec {
            LayerSpec::Kda { window, state } => OwnedLayer::Kda {
                windows: [
                    read(window, &mut sum).map_err(io)?,
                    read(window, &mut sum).map_err(io)?,
                    read(window, &mut sum).map_err(io)?,
                ],
                state: read(state, &mut sum).map_err(io)?,
            },
            LayerSpec::Mla { latent, k_pe } => OwnedLayer::Mla {
                latent: read(latent, &mut sum).map_err(io)?,
                k_pe: read(k_pe, &mut sum).map_err(io)?,
            },
            LayerSpec::Empty => OwnedLayer::Empty,
        });
    }
    let mut stored = [0u8; 8];
    reader.read_exact(&mut stored).map_err(io)?;
    let (stored, computed) = (u64::from_le_bytes(stored), sum.finish());
    if stored != computed {
        return Err(FileError::Checksum {
            part: "payload",
            stored,
            computed,
        });
    }
    // The state now lives in our buffers (advice only).
    let _ = drop_page_cache(&file, 0, len);
    let snapshot = Snapshot::from_layers(header.tokens.len(), layers);
    Ok((header, snapshot))
}

impl FileError {
    /// An I/O error without a path gets `path`.
    fn at(self, path: &Path) -> Self {
        match self {
            FileError::Io { path: p, source } if p.as_os_str().is_empty() => FileError::Io {
                path: path.to_owned(),
                source,
            },
            e => e,
        }
    }
}

/// The header of an open file of `len` bytes, checked.
fn header_of(file: &mut File, len: u64) -> Result<FileHeader> {
    let io = |source| FileError::Io {
        path: PathBuf::new(),
        source,
    };
    let truncated = |expected: u64| FileError::Truncated {
        expected,
        found: len,
    };
    if len < PREFIX as u64 {
        return Err(truncated(PREFIX as u64));
    }
    let mut prefix = [0u8; PREFIX];
    file.read_exact_at(&mut prefix, 0).map_err(io)?;
    let magic: [u8; 8] = prefix[..8].try_into().expect("8 bytes");
    if magic != MAGIC {
        return Err(FileError::Magic { found: magic });
    }
    let format = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes"));
    if format != FORMAT_VERSION {
        return Err(FileError::Format { found: format });
    }
    let body_len = u32::from_le_bytes(prefix[12..16].try_into().expect("4 bytes")) as usize;
    if body_len > MAX_HEADER {
        return Err(FileError::Header {
            reason: format!("header of {body_len} bytes, the limit is {MAX_HEADER}"),
        });
    }
    let payload_at = (PREFIX + body_len + 8) as u64;
    if len < payload_at {
        return Err(truncated(payload_at));
    }
    let mut body = vec![0u8; body_len + 8];
    file.read_exact_at(&mut body, PREFIX as u64).map_err(io)?;
    let mut sum = Checksum::new();
    sum.update(&prefix);
    sum.update(&body[..body_len]);
    let stored = u64::from_le_bytes(body[body_len..].try_into().expect("8 bytes"));
    let computed = sum.finish();
    if stored != computed {
        return Err(FileError::Checksum {
            part: "header",
            stored,
            computed,
        });
    }
    decode_header(&body[..body_len], payload_at, len)
}

fn encode_header(
    identity: &Identity,
    namespace: [u8; 16],
    tokens: &[usize],
    snapshot: &Snapshot,
) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    let engine = identity.engine.as_bytes();
    let engine_len = u16::try_from(engine.len()).map_err(|_| FileError::Header {
        reason: format!(
            "engine version of {} bytes, the limit is 65535",
            engine.len()
        ),
    })?;
    body.extend_from_slice(&engine_len.to_le_bytes());
    body.extend_from_slice(engine);
    body.extend_from_slice(&identity.checkpoint.to_le_bytes());
    body.extend_from_slice(&namespace);
    body.extend_from_slice(&(snapshot.position() as u64).to_le_bytes());
    body.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for &token in tokens {
        let id = u32::try_from(token).map_err(|_| FileError::Token { token })?;
        body.extend_from_slice(&id.to_le_bytes());
    }
    let layers: Vec<LayerState<'_>> = snapshot.layers().collect();
    body.extend_from_slice(&(layers.len() as u32).to_le_bytes());
    for layer in layers {
        let (kind, a, b) = match layer {
            LayerState::Kda { windows, state } => (1u8, windows[0].len(), state.len()),
            LayerState::Mla { latent, k_pe } => (2, latent.len(), k_pe.len()),
            LayerState::Empty => (0, 0, 0),
        };
        body.push(kind);
        if kind != 0 {
            body.extend_from_slice(&(a as u64).to_le_bytes());
            body.extend_from_slice(&(b as u64).to_le_bytes());
        }
    }
    if body.len() > MAX_HEADER {
        return Err(FileError::Header {
            reason: format!("header of {} bytes, the limit is {MAX_HEADER}", body.len()),
        });
    }
    let mut out = Vec::with_capacity(PREFIX + body.len() + 8);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    let mut sum = Checksum::new();
    sum.update(&out);
    out.extend_from_slice(&sum.finish().to_le_bytes());
    Ok(out)
}

/// Parses a header body whose checksum matched.
fn decode_header(body: &[u8], payload_at: u64, file_bytes: u64) -> Result<FileHeader> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = at.checked_add(n).filter(|&e| e <= body.len());
        let end = end.ok_or_else(|| FileError::Header {
            reason: format!(
                "field of {n} bytes at {at} past the header's {}",
                body.len()
            ),
        })?;
        let field = &body[at..end];
        at = end;
        Ok(field)
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let engine_len = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes")) as usize;
    let engine = String::from_utf8(take(engine_len)?.to_vec()).map_err(|e| FileError::Header {
        reason: format!("engine version is not UTF-8: {e}"),
    })?;
    let checkpoint = u64_at(take(8)?);
    let namespace: [u8; 16] = take(16)?.try_into().expect("16 bytes");
    let position = u64_at(take(8)?);
    let count = u64_at(take(8)?);
    if count != position || count > (body.len() / 4) as u64 {
        return Err(FileError::Header {
            reason: format!("{count} tokens for position {position}"),
        });
    }
    let tokens = take(count as usize * 4)?
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let layer_count = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
    let mut layers = Vec::new();
    let mut values = 0u64;
    for _ in 0..layer_count {
        let kind = take(1)?[0];
        let spec = match kind {
            0 => LayerSpec::Empty,
            1 | 2 => {
                let (a, b) = (u64_at(take(8)?), u64_at(take(8)?));
                if kind == 1 {
                    LayerSpec::Kda {
                        window: a,
                        state: b,
                    }
                } else {
                    LayerSpec::Mla { latent: a, k_pe: b }
                }
            }
            k => {
                return Err(FileError::Header {
                    reason: format!("layer kind {k}, expected 0, 1 or 2"),
                });
            }
        };
        // Lengths whose sum overflows are refused here; ones longer than the file are
        // refused by `load` as a truncation, before anything is allocated.
        values = values
            .checked_add(spec.checked_values().unwrap_or(u64::MAX))
            .filter(|v| {
                v.checked_mul(4)
                    .and_then(|b| b.checked_add(payload_at + 8))
                    .is_some()
            })
            .ok_or_else(|| FileError::Header {
                reason: "layer array lengths overflow a 64-bit file size".into(),
            })?;
        layers.push(spec);
    }
    Ok(FileHeader {
        identity: Identity { engine, checkpoint },
        namespace,
        tokens,
        file_bytes,
        layers,
        payload_at,
    })
}

/// `path` with a unique temporary suffix, in the same directory (so the rename is atomic).
fn temp_path(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{Preset, SynthOptions, generate};
    use expert_store::Checkpoint;

    /// The samples read from the files are the mapping's bytes, for every matrix (several
    /// per shard, at unaligned offsets), so the identity is the one the mapping would give.
    #[test]
    fn samples_read_from_the_files_are_the_mapped_bytes() {
        let dir = std::env::temp_dir().join(format!("k3-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate(&dir, &SynthOptions::new(Preset::Tiny)).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut samples = Vec::new();
        for name in ckpt.tensor_names() {
            let t = ckpt.tensor(name).unwrap();
            if t.shape.len() == 2 {
                // An odd length at an odd place: neither end on a page boundary.
                let start = t.bytes.len() / 3 + 1;
                let end = (start + 5000).min(t.bytes.len());
                samples.push((
                    name,
                    t.path,
                    t.offset + start..t.offset + end,
                    &t.bytes[start..end],
                ));
            }
        }
        assert!(samples.len() > 10, "{} matrices", samples.len());
        let (read, from_files) = read_samples(&samples);
        assert_eq!(from_files, samples.len());
        for (s, bytes) in samples.iter().zip(&read) {
            assert_eq!(bytes.as_slice(), s.3, "{}", s.0);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
