//! The checksum of the engine's own files (snapshot files, the pack cache's manifest): FNV-1a 64 run on 8 interleaved lanes of little-endian u64
//! words (lane `i` takes words `i, i + 8, ...`), the lanes, the tail bytes and the length then
//! folded by byte-wise FNV-1a 64. Byte-wise FNV-1a alone runs at about one byte per multiply
//! latency (~0.4 s for the release's 434 MB state); eight independent lanes of words keep the
//! multiplier busy (a few GB/s on one core). Any single changed byte changes the result: each
//! step `h = (h ^ w) * prime` is a bijection of `h` for a fixed `w` and of `w` for a fixed
//! `h` (the prime is odd). It guards against corruption, not against a forger.

const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;
const LANES: usize = 8;
const BLOCK: usize = LANES * 8;

/// A running checksum over a stream of bytes (pieces of any size give the same result).
#[derive(Debug, Clone)]
pub struct Checksum {
    lanes: [u64; LANES],
    pending: [u8; BLOCK],
    pending_len: usize,
    total: u64,
}

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum {
    /// An empty stream's state.
    pub fn new() -> Self {
        Self {
            lanes: std::array::from_fn(|i| OFFSET ^ i as u64),
            pending: [0; BLOCK],
            pending_len: 0,
            total: 0,
        }
    }

    /// Adds `bytes` to the stream.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.pending_len > 0 {
            let n = bytes.len().min(BLOCK - self.pending_len);
            self.pending[self.pending_len..self.pending_len + n].copy_from_slice(&bytes[..n]);
            self.pending_len += n;
            bytes = &bytes[n..];
            if self.pending_len < BLOCK {
                return;
            }
            let block = self.pending;
            self.block(&block);
            self.pending_len = 0;
        }
        let mut blocks = bytes.chunks_exact(BLOCK);
        for block in &mut blocks {
            self.block(block.try_into().expect("a whole block"));
        }
        let tail = blocks.remainder();
        self.pending[..tail.len()].copy_from_slice(tail);
        self.pending_len = tail.len();
    }

    #[inline(always)]
    fn block(&mut self, block: &[u8; BLOCK]) {
        for (lane, word) in self.lanes.iter_mut().zip(block.chunks_exact(8)) {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            *lane = (*lane ^ w).wrapping_mul(PRIME);
        }
    }

    /// The checksum of everything added so far (the stream may go on).
    pub fn finish(&self) -> u64 {
        let lanes = self.lanes.iter().flat_map(|l| l.to_le_bytes());
        let tail = self.pending[..self.pending_len].iter().copied();
        let total = self.total.to_le_bytes();
        lanes
            .chain(tail)
            .chain(total)
            .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(bytes: &[u8]) -> u64 {
        let mut c = Checksum::new();
        c.update(bytes);
        c.finish()
    }

    #[test]
    fn pieces_of_any_size_give_the_same_sum() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = of(&data);
        for piece in [1, 3, 63, 64, 65, 200] {
            let mut c = Checksum::new();
            data.chunks(piece).for_each(|p| c.update(p));
            assert_eq!(c.finish(), whole, "pieces of {piece}");
        }
    }

    #[test]
    fn every_single_byte_change_and_every_length_change_is_seen() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 31) as u8).collect();
        let whole = of(&data);
        for at in 0..data.len() {
            for flip in [1u8, 0x80, 0xff] {
                let mut bad = data.clone();
                bad[at] ^= flip;
                assert_ne!(of(&bad), whole, "byte {at} ^ {flip:#x}");
            }
        }
        assert_ne!(of(&data[..299]), whole);
        let mut longer = data.clone();
        longer.push(0);
        assert_ne!(of(&longer), whole);
    }
}
