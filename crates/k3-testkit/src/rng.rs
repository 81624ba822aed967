//! [`Rng`]: SplitMix64 and the draws the tests and benches make from it.

use std::ops::RangeInclusive;

/// A small deterministic generator (SplitMix64), so a failure reproduces from the seed in the
/// test's source, with no seed file and the same stream on every machine.
///
/// Each draw documents how many values it takes from the stream: a test whose expected values
/// depend on the exact sequence stays valid only while the draws it makes stay the same.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 bits of the stream.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (one draw, reduced modulo `n`; the bias is below 2^-50 for the sizes
    /// tests use). Panics when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [-1, 1), on a grid of 2^-23 (one draw, its top 24 bits).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A value of mixed sign and magnitude: a mantissa uniform in [-0.5, 0.5) on a grid of
    /// 2^-24, times 2^e with `e` uniform in `exponents` (two draws, mantissa first). Wide
    /// ranges make the order of a sum's additions show in its bits; a range down to 2^-12
    /// reaches F16's subnormals and zeros.
    pub fn mixed(&mut self, exponents: RangeInclusive<i32>) -> f32 {
        let (lo, hi) = exponents.into_inner();
        let mantissa = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        mantissa * 2f32.powi(lo + self.below((hi - lo + 1) as usize) as i32)
    }

    /// `n` random bytes, one draw each (its low byte).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// Fills `buf` with random bytes, eight per draw (little-endian): fast enough for the
    /// benches' buffers of hundreds of megabytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    /// The stream is SplitMix64's: the reference implementation's first outputs for seed 0,
    /// so the streams the tests were written against do not drift.
    #[test]
    fn the_stream_is_splitmix64() {
        let mut rng = Rng::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn draws_stay_in_their_ranges() {
        let mut rng = Rng::new(42);
        for _ in 0..10_000 {
            assert!(rng.below(7) < 7);
            assert!((-1.0..1.0).contains(&rng.unit()));
            let v = rng.mixed(-3..=3);
            assert!(v.abs() <= 0.5 * 8.0, "{v}");
        }
        let mut buf = [0u8; 13];
        rng.fill(&mut buf);
        assert_eq!(rng.bytes(5).len(), 5);
    }

    /// `fill` takes eight bytes from each draw, little-endian, and a short tail from one more.
    #[test]
    fn fill_takes_eight_bytes_a_draw() {
        let mut buf = [0u8; 12];
        Rng::new(3).fill(&mut buf);
        let mut rng = Rng::new(3);
        let first = rng.next_u64().to_le_bytes();
        let second = rng.next_u64().to_le_bytes();
        assert_eq!(buf[..8], first);
        assert_eq!(buf[8..], second[..4]);
    }
}
