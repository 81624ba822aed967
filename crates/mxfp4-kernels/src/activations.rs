//! Activation vectors prepared once per tier, in the layouts the kernels read.
//!
//! The kernels never shuffle weights into column order; instead each tier lays the activations
//! out in the order its weight decode produces (kt-kernel's idea: permute the activation, which
//! is small and shared by every row, not the weights).

use crate::codes::f32_to_bf16;
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::isa::Avx512;
use crate::kernels::Kernels;
use crate::tier::Tier;

/// The most activation vectors one call takes. More than 4 run as groups of 2-4 over
/// cache-sized stretches of rows, so a wider call costs no registers; it reads each weight from
/// memory once and lets a prefill chunk dispatch each layer once.
pub const MAX_TOKENS: usize = 64;

/// Columns are padded with zeros to a multiple of this, so every layout below has whole blocks.
pub(crate) const PAD: usize = 128;

/// One to [`MAX_TOKENS`] activation vectors of `cols` f32, prepared for one tier.
#[derive(Debug, Clone)]
pub struct Activations {
    tier: Tier,
    cols: usize,
    tokens: usize,
    /// The vectors as given, token-major (the scalar tier reads these).
    pub(crate) raw: Vec<f32>,
    /// Exact SIMD tiers (`avx512`, `avx2`): per 32 columns `[x0, x2, .., x30, x1, x3, .., x31]`, padded; stride `padded`.
    pub(crate) perm32: Vec<f32>,
    /// `avx2` tier, for its MXFP4 kernels: per 32 columns, with `j` a logical lane (the byte
    /// of the group whose low and high nibbles are columns `2j` and `2j + 1`), the low columns
    /// of lanes `[0..4, 8..12]`, their high columns, then the same for lanes `[4..8, 12..16]`:
    /// the order in which that tier's decode unpacks a group (`x86::avx2::mxfp4`).
    pub(crate) avx2_mx: Vec<f32>,
    /// BF16 tiers: BF16 of `x` in column order, padded (BF16 matrices).
    pub(crate) bf16_natural: Vec<u16>,
    /// BF16 tier: BF16 of `x`, per 64 columns `[A even, B even, A odd, B odd]` where A and B
    /// are the two 32-groups (MXFP4 matrices).
    pub(crate) bf16_mx: Vec<u16>,
    /// VNNI tier: per 128 columns (4 groups), 64 low-nibble partners then 64 high-nibble
    /// partners: byte `16*g + j` of each half pairs with column `32*g + 2*j` (+1 for high).
    pub(crate) q8: Vec<i8>,
    /// VNNI tier: per 128 columns, per `vpdpbusd` lane, `-12 * Σ q` over the lane's 8 bytes
    /// (the weights are stored offset by +12 to be unsigned).
    pub(crate) q8_correction: Vec<i32>,
    /// VNNI tier: per 128 columns, per lane, the int8 step `d` of the lane's group.
    pub(crate) q8_step: Vec<f32>,
}

impl Activations {
    pub(crate) fn new(kernels: &Kernels, x: &[f32], cols: usize) -> Result<Self> {
        let mut act = Self {
            tier: kernels.tier(),
            cols: 0,
            tokens: 0,
            raw: Vec::new(),
            perm32: Vec::new(),
            avx2_mx: Vec::new(),
            bf16_natural: Vec::new(),
            bf16_mx: Vec::new(),
            q8: Vec::new(),
            q8_correction: Vec::new(),
            q8_step: Vec::new(),
        };
        act.refill(kernels, x, cols)?;
        Ok(act)
    }

    /// Prepares new vectors into this value's buffers (no allocation once they are big enough).
    pub(crate) fn refill(&mut self, kernels: &Kernels, x: &[f32], cols: usize) -> Result<()> {
        let tier = kernels.tier();
        if cols == 0 || x.is_empty() || !x.len().is_multiple_of(cols) || x.len() / cols > MAX_TOKENS
        {
            return Err(Error::ActivationLength {
                cols,
                found: x.len(),
                max: MAX_TOKENS,
            });
        }
        self.tier = tier;
        self.cols = cols;
        self.tokens = x.len() / cols;
        self.raw.clear();
        self.raw.extend_from_slice(x);
        self.perm32.clear();
        self.avx2_mx.clear();
        self.q8_step.clear();
        self.bf16_natural.clear();
        self.bf16_mx.clear();
        self.q8.clear();
        self.q8_correction.clear();
        #[cfg(target_arch = "x86_64")]
        if let Some(token) = kernels.avx512() {
            // SAFETY: the token proves avx512f/bw/vl were detected on this CPU.
            unsafe { self.fill_avx512(token) };
            return Ok(());
        }
        self.fill();
        Ok(())
    }

    /// As [`Activations::new`] without the AVX-512 build of `fill` (same values), so tests can
    /// lay out any tier's activations on a CPU without AVX-512 (the kernel model, `x86::model`).
    #[cfg(test)]
    pub(crate) fn portable(tier: Tier, x: &[f32], cols: usize) -> Self {
        let mut act = Self::new(&Kernels::scalar(), x, cols).expect("valid test activations");
        act.tier = tier;
        act.fill();
        act
    }

    /// `fill`, compiled for AVX-512 so the same code vectorises (rounding, BF16 conversion);
    /// every operation is exactly rounded, so the values are those of the portable build.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bw and avx512vl: the token says it has.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn fill_avx512(&mut self, _: Avx512) {
        self.fill();
    }

    #[inline(always)]
    fn fill(&mut self) {
        let padded = padded_cols(self.cols);
        let mut v = vec![0.0f32; padded];
        for t in 0..self.tokens {
            v[..self.cols].copy_from_slice(&self.raw[t * self.cols..(t + 1) * self.cols]);
            match self.tier {
                Tier::Scalar => {}
                Tier::Avx512 => permute32(&v, &mut self.perm32),
                Tier::Avx2 => {
                    permute32(&v, &mut self.perm32);
                    permute_avx2_mx(&v, &mut self.avx2_mx);
                }
                Tier::Avx512Bf16 | Tier::Avx512Vnni => {
                    self.bf16_natural.extend(v.iter().map(|&a| f32_to_bf16(a)));
                    if self.tier == Tier::Avx512Bf16 {
                        permute64(&v, &mut self.bf16_mx);
                    } else {
                        self.push_q8(&v);
                    }
                }
            }
        }
    }

    /// The tier these were prepared for; only its kernels take them.
    pub fn tier(&self) -> Tier {
        self.tier
    }
    /// Columns of one vector (the matrix width they multiply).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// How many vectors (tokens), 1..=[`MAX_TOKENS`].
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Vector `t` as given.
    pub fn token(&self, t: usize) -> &[f32] {
        &self.raw[t * self.cols..(t + 1) * self.cols]
    }
    /// Columns after zero padding (the stride of the prepared layouts).
    pub(crate) fn padded(&self) -> usize {
        padded_cols(self.cols)
    }

    /// Quantises one padded vector to int8 per 32-group (`d = max|x| / 127`, round half to
    /// even) and appends it in the VNNI layout.
    #[inline(always)]
    fn push_q8(&mut self, v: &[f32]) {
        for block in v.chunks_exact(PAD) {
            let mut q = [0i8; PAD];
            let mut steps = [0.0f32; 4];
            for (g, group) in block.chunks_exact(32).enumerate() {
                let amax = group.iter().fold(0.0f32, |m, a| m.max(a.abs()));
                let step = amax / 127.0;
                steps[g] = step;
                for (j, &a) in group.iter().enumerate() {
                    let scaled = if step > 0.0 {
                        (a / step).round_ties_even()
                    } else {
                        0.0
                    };
                    q[32 * g + j] = scaled.clamp(-127.0, 127.0) as i8;
                }
            }
            let mut lo = [0i8; 64];
            let mut hi = [0i8; 64];
            for g in 0..4 {
                for j in 0..16 {
                    lo[16 * g + j] = q[32 * g + 2 * j];
                    hi[16 * g + j] = q[32 * g + 2 * j + 1];
                }
            }
            for lane in 0..16 {
                let sum: i32 = (4 * lane..4 * lane + 4)
                    .map(|i| i32::from(lo[i]) + i32::from(hi[i]))
                    .sum();
                self.q8_correction.push(-12 * sum);
                self.q8_step.push(steps[lane / 4]);
            }
            self.q8.extend_from_slice(&lo);
            self.q8.extend_from_slice(&hi);
        }
    }
}

pub(crate) fn padded_cols(cols: usize) -> usize {
    cols.div_ceil(PAD) * PAD
}

/// Per 32 columns: even columns then odd columns (the order of low then high nibbles).
#[inline(always)]
fn permute32(v: &[f32], out: &mut Vec<f32>) {
    for block in v.chunks_exact(32) {
        out.extend((0..16).map(|j| block[2 * j]));
        out.extend((0..16).map(|j| block[2 * j + 1]));
    }
}

/// Per 32 columns, the `avx2` MXFP4 order (see `Activations::avx2_mx`).
#[inline(always)]
fn permute_avx2_mx(v: &[f32], out: &mut Vec<f32>) {
    const LANES: [[usize; 8]; 2] = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]];
    for block in v.chunks_exact(32) {
        for lanes in LANES {
            out.extend(lanes.iter().map(|&j| block[2 * j]));
            out.extend(lanes.iter().map(|&j| block[2 * j + 1]));
        }
    }
}

/// Per 64 columns (groups A, B): A even, B even, A odd, B odd, rounded to BF16.
#[inline(always)]
fn permute64(v: &[f32], out: &mut Vec<u16>) {
    for block in v.chunks_exact(64) {
        for parity in 0..2 {
            for group in 0..2 {
                out.extend((0..16).map(|j| f32_to_bf16(block[32 * group + 2 * j + parity])));
            }
        }
    }
}
