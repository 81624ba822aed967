//! `Lines`: a growable run of f32 whose first value starts a 64-byte cache line.
//!
//! The MLA latent cache is read by the attention kernels in 8-value (32-byte) pieces. A
//! `Vec<f32>` starts wherever the allocator puts it (glibc: 16 bytes past a line for large
//! blocks), so every other piece straddled two lines and each such load cost two: on a Zen 3
//! core a mul-then-add loop fed from L1 ran 37–39 G multiply-adds/s from line-aligned rows and
//! 24–25 from rows 16 bytes off (PERFORMANCE.md phase 27). With the rows' widths multiples of
//! 16 values (K3: 512 and 64), every row of a `Lines` starts a line too.

use std::ops::{Deref, DerefMut};

/// 16 f32, aligned as a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

const ZERO: Line = Line([0.0; 16]);

/// A `Vec<f32>` whose values start on a 64-byte boundary (module docs). The values past
/// `len` in the last line are never read: an append overwrites them first.
#[derive(Default)]
pub(super) struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// `len` zeros.
    pub(super) fn zeros(len: usize) -> Self {
        Self {
            lines: vec![ZERO; len.div_ceil(16)],
            len,
        }
    }

    /// Appends `values`; storage grows as a `Vec`'s does (amortised doubling).
    pub(super) fn extend_from_slice(&mut self, values: &[f32]) {
        let at = self.len;
        self.len += values.len();
        self.lines.resize(self.len.div_ceil(16), ZERO);
        self[at..].copy_from_slice(values);
    }

    /// Keeps the first `len` values (no change if it holds fewer); the memory stays.
    pub(super) fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.lines.truncate(len.div_ceil(16));
        }
    }

    /// `len` zeros, reusing the memory.
    pub(super) fn set_zeros(&mut self, len: usize) {
        self.lines.clear();
        self.lines.resize(len.div_ceil(16), ZERO);
        self.len = len;
    }

    /// Empties it, keeping the memory.
    pub(super) fn clear(&mut self) {
        self.truncate(0);
    }
}

impl Clone for Lines {
    fn clone(&self) -> Self {
        Self {
            lines: self.lines.clone(),
            len: self.len,
        }
    }

    /// `source`'s values, reusing this one's memory where it is large enough (a restored
    /// session's caches take the snapshot's this way).
    fn clone_from(&mut self, source: &Self) {
        self.lines.clone_from(&source.lines);
        self.len = source.len;
    }
}

impl From<Vec<f32>> for Lines {
    fn from(values: Vec<f32>) -> Self {
        let mut lines = Lines::default();
        lines.extend_from_slice(&values);
        lines
    }
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` over `[f32; 16]` (size 64, no padding), so `lines` is
        // `16 * lines.len()` initialised f32 in a row, and `len <= 16 * lines.len()`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values go in and out as a `Vec<f32>`'s would, through appends, truncations and
    /// clears, and every non-empty run starts on a 64-byte boundary.
    #[test]
    fn lines_hold_values_as_a_vec_does_and_start_a_line() {
        let mut rng = fastrand::Rng::with_seed(3);
        let mut lines = Lines::default();
        let mut plain: Vec<f32> = Vec::new();
        for step in 0..400 {
            match rng.u8(0..10) {
                0 => {
                    let keep = rng.usize(0..=plain.len());
                    lines.truncate(keep);
                    plain.truncate(keep);
                }
                1 if step % 7 == 0 => {
                    lines.clear();
                    plain.clear();
                }
                _ => {
                    let values: Vec<f32> = (0..rng.usize(0..70)).map(|_| rng.f32()).collect();
                    lines.extend_from_slice(&values);
                    plain.extend_from_slice(&values);
                }
            }
            assert_eq!(&*lines, &plain[..], "step {step}");
            if !lines.is_empty() {
                assert_eq!(lines.as_ptr() as usize % 64, 0, "step {step}");
            }
        }
        let mut zeros = lines.clone();
        zeros.set_zeros(37);
        assert_eq!(&*zeros, &[0.0f32; 37][..]);
        let mut copy = Lines::zeros(5);
        copy.clone_from(&lines);
        assert_eq!(&*copy, &*lines);
        assert_eq!(&*Lines::from(plain.clone()), &plain[..]);
        assert_eq!(&*Lines::zeros(20), &[0.0f32; 20][..]);
    }
}
