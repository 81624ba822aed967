//! The modelled loaders (BF16, F16, F32 weights; the activations) and row kernel, transcribed from `exact::Bf16::block` and `float::float_block`, with `store_sums`'s horizontal sums.

use std::ops::Range;

use crate::activations::Activations;
use crate::x86::driver::{Avx512Gemm, Bf16Gemv, RowKernel, Rows, Tile, drive, width};
use crate::x86::lanes::{
    F32_EVEN_IDX, F32_ODD_IDX, HALF_BITS, HIGH_HALF, HSUM_LANE_ONE, HSUM_UPPER_HALF,
    HSUM_UPPER_QUARTER, HSUM16_EVEN_BLOCKS, HSUM16_EVEN_LANES, HSUM16_HIGH_BLOCKS,
    HSUM16_LOW_BLOCKS, HSUM16_ODD_BLOCKS, HSUM16_ODD_LANES, block_offset, f32_tail_masks,
    hsum16_input,
};

use super::intrinsics::*;

/// The exact BF16 kernel's weight load (`exact::Bf16::block`): `(even, odd)` of one block.
pub(super) fn bf16_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
    let v = dwords(load_bytes64(mem, at, 2 * valid));
    (slli(v, HALF_BITS), and(v, HIGH_HALF))
}

/// `float::load_f32_split`.
pub(super) fn f32_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
    let (low, high) = if valid >= 32 {
        (
            dwords(maskz_loadu_ps(mem, at, u16::MAX)),
            dwords(maskz_loadu_ps(mem, at + 64, u16::MAX)),
        )
    } else {
        let (low_mask, high_mask) = f32_tail_masks(valid);
        (
            dwords(maskz_loadu_ps(mem, at, low_mask)),
            dwords(maskz_loadu_ps(mem, at + 64, high_mask)),
        )
    };
    (
        permutex2var_ps(low, &F32_EVEN_IDX, high),
        permutex2var_ps(low, &F32_ODD_IDX, high),
    )
}

/// `float::load_f16_split`.
pub(super) fn f16_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
    let v = dwords(load_bytes64(mem, at, 2 * valid));
    (
        cvtph_ps(cvtepi32_epi16(v)),
        cvtph_ps(cvtepi32_epi16(srli(v, HALF_BITS))),
    )
}

/// The weight loaders, by format.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Format {
    Bf16,
    F16,
    F32,
}

impl Format {
    pub(super) fn elem(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::Bf16 | Format::F16 => 2,
        }
    }
    pub(super) fn split(self, mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
        match self {
            Format::Bf16 => bf16_split(mem, at, valid),
            Format::F16 => f16_split(mem, at, valid),
            Format::F32 => f32_split(mem, at, valid),
        }
    }
}

/// The activation loads of token `t` at block `block`: `perm32` (exact tier) or
/// `bf16_natural` widened by the shift and mask (`BF16_ACT`). Indexing panics past the end.
pub(super) fn act_split(
    act: &Activations,
    bf16_act: bool,
    t: usize,
    block: usize,
) -> (Lanes, Lanes) {
    let at = t * act.padded() + 32 * block;
    if bf16_act {
        let v: Lanes = core::array::from_fn(|j| {
            u32::from(act.bf16_natural[at + 2 * j])
                | u32::from(act.bf16_natural[at + 2 * j + 1]) << 16
        });
        (slli(v, HALF_BITS), and(v, HIGH_HALF))
    } else {
        (
            core::array::from_fn(|j| act.perm32[at + j].to_bits()),
            core::array::from_fn(|j| act.perm32[at + 16 + j].to_bits()),
        )
    }
}

/// `sums::hsum`, instruction by instruction (`movhlps` and `addss` on lanes 0..3).
pub(super) fn hsum_insns(v: Lanes) -> f32 {
    let s = add(v, shuffle_f32x4(v, v, HSUM_UPPER_HALF));
    let s = add(s, shuffle_f32x4(s, s, HSUM_UPPER_QUARTER));
    let x: [f32; 4] = core::array::from_fn(|i| f32::from_bits(s[i]));
    // movhlps x, x: lanes 0, 1 take lanes 2, 3 (lanes 2, 3 stay); addps.
    let y: [f32; 4] = core::array::from_fn(|i| x[i] + x[if i < 2 { i + 2 } else { i }]);
    // shufps y, y, imm: lane 0 takes lane imm[1:0]; addss adds lane 0 only.
    y[0] + y[(HSUM_LANE_ONE & 3) as usize]
}

/// `sums::hsum16`, instruction by instruction.
pub(super) fn hsum16(v: &[Lanes; 16]) -> Lanes {
    let input = |j: usize| v[hsum16_input(j)];
    let halves: [Lanes; 8] = core::array::from_fn(|k| {
        let (a, b) = (input(2 * k), input(2 * k + 1));
        add(
            shuffle_f32x4(a, b, HSUM16_LOW_BLOCKS),
            shuffle_f32x4(a, b, HSUM16_HIGH_BLOCKS),
        )
    });
    let quarters: [Lanes; 4] = core::array::from_fn(|m| {
        let (c, d) = (halves[2 * m], halves[2 * m + 1]);
        add(
            shuffle_f32x4(c, d, HSUM16_EVEN_BLOCKS),
            shuffle_f32x4(c, d, HSUM16_ODD_BLOCKS),
        )
    });
    let pairs: [Lanes; 2] = core::array::from_fn(|p| {
        let (e, f) = (quarters[2 * p], quarters[2 * p + 1]);
        add(unpack_pd(e, f, false), unpack_pd(e, f, true))
    });
    add(
        shuffle_ps(pairs[0], pairs[1], HSUM16_EVEN_LANES),
        shuffle_ps(pairs[0], pairs[1], HSUM16_ODD_LANES),
    )
}

/// `sums::hsum`'s tree as its documentation states it: lanes 8 apart, then 4, 2, 1.
pub(super) fn hsum(v: Lanes) -> f32 {
    let f = |i: usize| f32::from_bits(v[i]);
    let a: [f32; 8] = core::array::from_fn(|i| f(i) + f(i + 8));
    let b: [f32; 4] = core::array::from_fn(|i| a[i] + a[i + 4]);
    let c: [f32; 2] = core::array::from_fn(|i| b[i] + b[i + 2]);
    c[0] + c[1]
}

/// A matrix the model reads: its bytes, shape and loader (the `$m` of the dispatch macros).
pub(super) struct Model<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) format: Format,
    pub(super) bf16_act: bool,
}

impl Rows for Model<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * self.cols * self.format.elem()
    }
}

/// The modelled row kernel, run by the real driver with the plans of the BF16 kernels it
/// models (`exact::Bf16`, `float::Float`).
pub(super) struct ModelKernel;

impl RowKernel<Model<'_>> for ModelKernel {
    type Gemv = Bf16Gemv;
    type Gemm = Avx512Gemm;

    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &Model<'_>,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    ) {
        model_block::<R, T, C>(m, act, tile, out);
    }
}

/// `float::float_block` / `exact::Bf16::block`, transcribed: rows `row0..row0+R`, tokens
/// `tok0..tok0+T`, sums stored as `store_sums` does.
#[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
fn model_block<const R: usize, const T: usize, const C: usize>(
    m: &Model<'_>,
    act: &Activations,
    tile: Tile,
    out: &mut [f32],
) {
    let Tile {
        tok0,
        row0,
        local0,
        n,
        part,
    } = tile;
    assert!(
        part.is_none(),
        "the modelled plan (`Avx512Gemm`) runs whole rows"
    );
    assert!(row0 + R <= m.rows);
    let cols = width::<C>(m.cols);
    let elem = m.format.elem();
    assert!(m.bytes.len() >= (row0 + R) * cols * elem);
    let base = row0 * cols * elem;
    let mut acc = [[[0u32; 16]; T]; R];
    for block in 0..cols.div_ceil(32) {
        let valid = (cols - 32 * block).min(32);
        let x: [(Lanes, Lanes); T] =
            core::array::from_fn(|t| act_split(act, m.bf16_act, tok0 + t, block));
        for r in 0..R {
            let at = base + block_offset(r, cols, block, elem);
            let (w_even, w_odd) = m.format.split(m.bytes, at, valid);
            for t in 0..T {
                acc[r][t] = fmadd(w_even, x[t].0, acc[r][t]);
                acc[r][t] = fmadd(w_odd, x[t].1, acc[r][t]);
            }
        }
    }
    // `store_sums`: blocks of 8 or 16 accumulators through `hsum16`, the rest one by one.
    if R * T == 16 || R * T == 8 {
        let mut flat = [[0u32; 16]; 16];
        for r in 0..R {
            for t in 0..T {
                flat[t * R + r] = acc[r][t];
            }
        }
        let sums = hsum16(&flat);
        for t in 0..T {
            for r in 0..R {
                out[(tok0 + t) * n + local0 + r] = f32::from_bits(sums[t * R + r]);
            }
        }
        return;
    }
    for r in 0..R {
        for t in 0..T {
            out[(tok0 + t) * n + local0 + r] = hsum_insns(acc[r][t]);
        }
    }
}

/// The model kernel over `rows` through the real driver (`drive`).
pub(super) fn model_matmul(m: &Model<'_>, act: &Activations, rows: Range<usize>) -> Vec<f32> {
    let mut out = vec![f32::NAN; rows.len() * act.tokens()];
    // SAFETY: the model kernel has no target features.
    unsafe { drive::<_, ModelKernel>(m, act, rows, &mut out) };
    out
}
