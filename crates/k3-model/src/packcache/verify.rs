//! The pack cache's bodies checked against their checksums: those a resident load did not
//! read whole (and check as it went), read once with `O_DIRECT` a chunk ahead and hashed as
//! they land, so a damaged file is never used.

use std::collections::HashSet;
use std::sync::Arc;

use crate::io::checksum::Checksum;
use crate::io::chunks::{read_chunks, reader};

use super::types::{PackCache, PackCacheError};

/// Bytes read at a time.
const CHUNK: usize = 32 << 20;

impl PackCache {
    /// Checks the body of every matrix but those at the indices in `checked` (read whole by a
    /// resident load, which checked them) against its checksum, reading on an I/O thread on
    /// `io_cpus`. [`PackCacheError::Damaged`] names the first that does not match.
    pub fn verify(&self, checked: &[usize], io_cpus: &[usize]) -> Result<(), PackCacheError> {
        let checked: HashSet<usize> = checked.iter().copied().collect();
        let mut readers = Vec::new();
        let file = reader(&mut readers, &self.path)?;
        // Per piece: the file, its body's offset and bytes per "row" (one: chunks of bytes).
        let mut sources = Vec::new();
        let mut chunks = Vec::new();
        let mut of_piece = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let len = t.body_bytes();
            if checked.contains(&i) || len == 0 {
                continue;
            }
            for first in (0..len).step_by(CHUNK) {
                chunks.push((sources.len(), first, (first + CHUNK).min(len)));
            }
            sources.push((Arc::clone(&file), t.body, 1));
            of_piece.push((i, len));
        }
        // The chunks come in order, a piece's after the one before.
        let mut sum = Checksum::new();
        read_chunks(sources, &chunks, io_cpus, |piece, _, last, bytes| {
            sum.update(bytes);
            let (i, len) = of_piece[piece];
            if last == len {
                let t = &self.tensors[i];
                if std::mem::take(&mut sum).finish() != t.sum {
                    return Err(PackCacheError::Damaged {
                        path: self.path.clone(),
                        tensor: t.name.clone(),
                    });
                }
            }
            Ok(())
        })
    }
}
