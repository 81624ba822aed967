//! A portable model of the exact BF16 row kernel (`exact::bf16_block`) and the F16/F32 row
//! kernels (`float::float_block`), for CPUs without AVX-512: each intrinsic is emulated on
//! plain arrays as Intel documents it, the loaders are transcribed line by line with the
//! kernels' own constants and address arithmetic (`lanes`), and the row kernels run through
//! the real dispatch macros (`by_tokens_bf16!`, `run_rows!`) on activations laid out by the
//! real `Activations` code. Memory reads are bounds-checked, so a load past the matrix (an
//! unsound tail) panics instead of reading a neighbour.
//!
//! What this shows without the hardware: every loader's lane `j` of `even`/`odd` holds column
//! `32b + 2j`/`32b + 2j + 1` of its row (or zero past the row's end); the activations pair
//! with the same columns; an F32 matrix of BF16 values gives the BF16 kernel's lanes, FMA chain
//! and sums bit for bit; F16 gives its F32 twin's bits; and the row kernels match the scalar
//! oracle within the usual dot-product bound; `store_sums`'s shuffles (`hsum`, `hsum16`) sum
//! in the documented tree; the MXFP4 dequant's interleave restores column order. What it
//! cannot show: that the compiler lowers the intrinsics as documented (the disassembly shows
//! `vpermt2ps`, `vpmovdw`, `vcvtph2ps` with the tables of `lanes`), nor anything about the
//! MXFP4 decode tables, `vdpbf16ps` or the VNNI tier, which this model leaves out.

use std::ops::Range;

use super::lanes::{
    F32_EVEN_IDX, F32_ODD_IDX, HALF_BITS, HIGH_HALF, HSUM_LANE_ONE, HSUM_UPPER_HALF,
    HSUM_UPPER_QUARTER, HSUM16_EVEN_BLOCKS, HSUM16_EVEN_LANES, HSUM16_HIGH_BLOCKS,
    HSUM16_LOW_BLOCKS, HSUM16_ODD_BLOCKS, HSUM16_ODD_LANES, INTERLEAVE_FIRST, INTERLEAVE_SECOND,
    ODD_WORDS, block_offset, byte_mask64, f32_tail_masks, hsum16_input,
};
use super::{by_tokens, by_tokens_bf16, run_rows, width};
use crate::activations::Activations;
use crate::codes::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::tier::Tier;

/// 16 dword lanes (a `__m512` or `__m512i`) as bit patterns.
type Lanes = [u32; 16];

/// One byte of memory; a read outside `mem` is a bug the hardware might not report.
fn byte(mem: &[u8], at: usize) -> u8 {
    match mem.get(at) {
        Some(&b) => b,
        None => panic!(
            "load of byte {at} past the {} bytes of the matrix",
            mem.len()
        ),
    }
}

/// `_mm512_maskz_loadu_epi8(k, p)`: byte `i` is `p[i]` where bit `i` of `k` is set, else 0;
/// masked-off bytes are not accessed. `_mm512_loadu_si512` is the all-ones mask.
fn maskz_loadu_epi8(mem: &[u8], at: usize, k: u64) -> [u8; 64] {
    core::array::from_fn(|i| {
        if (k >> i) & 1 == 1 {
            byte(mem, at + i)
        } else {
            0
        }
    })
}

/// `_mm512_maskz_loadu_epi16(k, p)`: word `i` is loaded where bit `i` of `k` is set.
fn maskz_loadu_epi16(mem: &[u8], at: usize, k: u32) -> [u8; 64] {
    core::array::from_fn(|i| {
        if (k >> (i / 2)) & 1 == 1 {
            byte(mem, at + i)
        } else {
            0
        }
    })
}

/// `_mm512_maskz_loadu_ps(k, p)`: dword `i` is loaded where bit `i` of `k` is set.
fn maskz_loadu_ps(mem: &[u8], at: usize, k: u16) -> [u8; 64] {
    core::array::from_fn(|i| {
        if (k >> (i / 4)) & 1 == 1 {
            byte(mem, at + i)
        } else {
            0
        }
    })
}

/// A 64-byte register read as 16 little-endian dwords.
fn dwords(v: [u8; 64]) -> Lanes {
    core::array::from_fn(|i| {
        u32::from_le_bytes([v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]])
    })
}

/// `x86::load_bytes64`: 64 bytes, or the first `n < 64` (the rest zero).
fn load_bytes64(mem: &[u8], at: usize, n: usize) -> [u8; 64] {
    if n >= 64 {
        maskz_loadu_epi8(mem, at, u64::MAX)
    } else {
        maskz_loadu_epi8(mem, at, byte_mask64(n))
    }
}

/// `_mm512_permutex2var_ps(a, idx, b)`: lane `i` is `(idx[i] bit 4 ? b : a)[idx[i] & 15]`
/// (`vpermt2ps`/`vpermi2ps`; higher index bits are ignored).
fn permutex2var_ps(a: Lanes, idx: &[i32; 16], b: Lanes) -> Lanes {
    core::array::from_fn(|i| {
        let j = idx[i] as u32;
        let source = if j & 16 != 0 { &b } else { &a };
        source[(j & 15) as usize]
    })
}

/// `_mm512_slli_epi32::<N>` (N < 32).
fn slli(v: Lanes, n: u32) -> Lanes {
    v.map(|x| x << n)
}

/// `_mm512_srli_epi32::<N>` (N < 32), a logical shift.
fn srli(v: Lanes, n: u32) -> Lanes {
    v.map(|x| x >> n)
}

/// `_mm512_and_si512` with a broadcast dword.
fn and(v: Lanes, m: u32) -> Lanes {
    v.map(|x| x & m)
}

/// `_mm512_cvtepi32_epi16` (`vpmovdw`): each dword truncated to its low word.
fn cvtepi32_epi16(v: Lanes) -> [u16; 16] {
    v.map(|x| x as u16)
}

/// `_mm512_cvtph_ps` (`vcvtph2ps`): each binary16 widened exactly (subnormals included, no
/// DAZ); a NaN keeps its payload and becomes quiet. Written independently of `codes`.
fn cvtph_ps(h: [u16; 16]) -> Lanes {
    h.map(|h| {
        let sign = u32::from(h & 0x8000) << 16;
        let exponent = u32::from((h >> 10) & 0x1F);
        let mantissa = u32::from(h & 0x3FF);
        match exponent {
            0 => sign | (mantissa as f32 * 2f32.powi(-24)).to_bits(),
            0x1F if mantissa != 0 => sign | 0x7FC0_0000 | (mantissa << 13),
            0x1F => sign | 0x7F80_0000,
            e => sign | ((e + 127 - 15) << 23) | (mantissa << 13),
        }
    })
}

/// The exact BF16 kernel's weight load (`exact::bf16_block`): `(even, odd)` of one block.
fn bf16_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
    if valid == 32 {
        (
            slli(dwords(maskz_loadu_epi8(mem, at, u64::MAX)), HALF_BITS),
            dwords(maskz_loadu_epi16(mem, at, ODD_WORDS)),
        )
    } else {
        let v = dwords(load_bytes64(mem, at, 2 * valid));
        (slli(v, HALF_BITS), and(v, HIGH_HALF))
    }
}

/// `float::load_f32_split`.
fn f32_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
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
fn f16_split(mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
    let v = dwords(load_bytes64(mem, at, 2 * valid));
    (
        cvtph_ps(cvtepi32_epi16(v)),
        cvtph_ps(cvtepi32_epi16(srli(v, HALF_BITS))),
    )
}

/// The weight loaders, by format.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Format {
    Bf16,
    F16,
    F32,
}

impl Format {
    fn elem(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::Bf16 | Format::F16 => 2,
        }
    }
    fn split(self, mem: &[u8], at: usize, valid: usize) -> (Lanes, Lanes) {
        match self {
            Format::Bf16 => bf16_split(mem, at, valid),
            Format::F16 => f16_split(mem, at, valid),
            Format::F32 => f32_split(mem, at, valid),
        }
    }
}

/// The activation loads of token `t` at block `block`: `perm32` (exact tier) or
/// `bf16_natural` widened by the shift and mask (`BF16_ACT`). Indexing panics past the end.
fn act_split(act: &Activations, bf16_act: bool, t: usize, block: usize) -> (Lanes, Lanes) {
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

/// `_mm512_fmadd_ps(a, b, c)`: `a * b + c` rounded once, per lane.
fn fmadd(a: Lanes, b: Lanes, c: Lanes) -> Lanes {
    core::array::from_fn(|i| {
        f32::from_bits(a[i])
            .mul_add(f32::from_bits(b[i]), f32::from_bits(c[i]))
            .to_bits()
    })
}

/// `_mm512_add_ps`.
fn add(a: Lanes, b: Lanes) -> Lanes {
    core::array::from_fn(|i| (f32::from_bits(a[i]) + f32::from_bits(b[i])).to_bits())
}

/// `_mm512_shuffle_f32x4::<IMM>(a, b)` (`vshuff32x4`): 128-bit blocks 0, 1 of the result are
/// blocks `imm[1:0]`, `imm[3:2]` of `a`; blocks 2, 3 are blocks `imm[5:4]`, `imm[7:6]` of `b`.
fn shuffle_f32x4(a: Lanes, b: Lanes, imm: i32) -> Lanes {
    core::array::from_fn(|i| {
        let block = i / 4;
        let pick = ((imm >> (2 * block)) & 3) as usize;
        let source = if block < 2 { &a } else { &b };
        source[4 * pick + i % 4]
    })
}

/// `_mm512_shuffle_ps::<IMM>(a, b)` (`vshufps`): in each 128-bit block, lanes 0, 1 are lanes
/// `imm[1:0]`, `imm[3:2]` of `a`'s block, lanes 2, 3 lanes `imm[5:4]`, `imm[7:6]` of `b`'s.
fn shuffle_ps(a: Lanes, b: Lanes, imm: i32) -> Lanes {
    core::array::from_fn(|i| {
        let (block, lane) = (i / 4, i % 4);
        let pick = ((imm >> (2 * lane)) & 3) as usize;
        let source = if lane < 2 { &a } else { &b };
        source[4 * block + pick]
    })
}

/// `_mm512_unpacklo_pd` (`high` false) / `_mm512_unpackhi_pd` on f32 lanes: in each 128-bit
/// block, the low (high) qword of `a` then the low (high) qword of `b`.
fn unpack_pd(a: Lanes, b: Lanes, high: bool) -> Lanes {
    let q = if high { 2 } else { 0 };
    core::array::from_fn(|i| {
        let (block, lane) = (i / 4, i % 4);
        let source = if lane < 2 { &a } else { &b };
        source[4 * block + q + lane % 2]
    })
}

/// `x86::hsum`, instruction by instruction (`movhlps` and `addss` on lanes 0..3).
fn hsum_insns(v: Lanes) -> f32 {
    let s = add(v, shuffle_f32x4(v, v, HSUM_UPPER_HALF));
    let s = add(s, shuffle_f32x4(s, s, HSUM_UPPER_QUARTER));
    let x: [f32; 4] = core::array::from_fn(|i| f32::from_bits(s[i]));
    // movhlps x, x: lanes 0, 1 take lanes 2, 3 (lanes 2, 3 stay); addps.
    let y: [f32; 4] = core::array::from_fn(|i| x[i] + x[if i < 2 { i + 2 } else { i }]);
    // shufps y, y, imm: lane 0 takes lane imm[1:0]; addss adds lane 0 only.
    y[0] + y[(HSUM_LANE_ONE & 3) as usize]
}

/// `x86::hsum16`, instruction by instruction.
fn hsum16(v: &[Lanes; 16]) -> Lanes {
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

/// `x86::hsum`'s tree as its documentation states it: lanes 8 apart, then 4, 2, 1.
fn hsum(v: Lanes) -> f32 {
    let f = |i: usize| f32::from_bits(v[i]);
    let a: [f32; 8] = core::array::from_fn(|i| f(i) + f(i + 8));
    let b: [f32; 4] = core::array::from_fn(|i| a[i] + a[i + 4]);
    let c: [f32; 2] = core::array::from_fn(|i| b[i] + b[i + 2]);
    c[0] + c[1]
}

/// A matrix the model reads: its bytes, shape and loader (the `$m` of the dispatch macros).
struct Model<'a> {
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
    format: Format,
    bf16_act: bool,
}

impl Model<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * self.cols * self.format.elem()
    }
}

/// `float::float_block` / `exact::bf16_block`, transcribed: rows `row0..row0+R`, tokens
/// `tok0..tok0+T`, sums stored as `store_sums` does.
#[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
fn model_block<const R: usize, const T: usize, const C: usize>(
    m: &Model<'_>,
    act: &Activations,
    tok0: usize,
    row0: usize,
    local0: usize,
    n: usize,
    out: &mut [f32],
) {
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

/// The model kernel over `rows` through the real dispatch (`by_tokens_bf16!`).
fn model_matmul(m: &Model<'_>, act: &Activations, rows: Range<usize>) -> Vec<f32> {
    let mut out = vec![f32::NAN; rows.len() * act.tokens()];
    let out_ref = &mut out[..];
    by_tokens_bf16!(model_block, m, act, rows, out_ref);
    out
}

/// A deterministic generator (64-bit LCG, high bits).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }
    /// A value of mixed sign and magnitude (about 2^-37..2^11: F16 normals, subnormals and zeros).
    fn value(&mut self) -> f32 {
        let mantissa = (self.next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        mantissa * 2f32.powi((self.next() % 25) as i32 - 12)
    }
}

/// One matrix's values in the three formats: BF16 values, the same widened to F32, their F16
/// rounding, and that widened to F32. Each buffer is exactly the matrix's size, so the
/// model's bounds-checked reads catch a tail load past the last row.
struct Twins {
    bf16: Vec<u8>,
    f32_of_bf16: Vec<u8>,
    f16: Vec<u8>,
    f32_of_f16: Vec<u8>,
    /// The BF16 values, row-major.
    values: Vec<f32>,
    /// The F16 values widened, row-major.
    halves: Vec<f32>,
}

impl Twins {
    fn new(rng: &mut Rng, len: usize) -> Self {
        let values: Vec<f32> = (0..len)
            .map(|_| bf16_to_f32(f32_to_bf16(rng.value())))
            .collect();
        let half_bits: Vec<u16> = values.iter().map(|&v| f32_to_f16(v)).collect();
        let halves: Vec<f32> = half_bits.iter().map(|&h| f16_to_f32(h)).collect();
        Self {
            bf16: values
                .iter()
                .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
                .collect(),
            f32_of_bf16: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            f16: half_bits.iter().flat_map(|h| h.to_le_bytes()).collect(),
            f32_of_f16: halves.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values,
            halves,
        }
    }
}

/// The column-order value a loader's lane must hold: `row[col]`, or +0 past the row's end.
fn expected(row: &[f32], col: usize) -> u32 {
    row.get(col).map_or(0, |v| v.to_bits())
}

/// The index tables and masks select what `lanes` says they do.
#[test]
fn f32_split_constants_select_even_and_odd_columns() {
    let low: Lanes = core::array::from_fn(|i| i as u32);
    let high: Lanes = core::array::from_fn(|i| 16 + i as u32);
    let even = permutex2var_ps(low, &F32_EVEN_IDX, high);
    let odd = permutex2var_ps(low, &F32_ODD_IDX, high);
    for j in 0..16 {
        assert_eq!(
            (even[j], odd[j]),
            (2 * j as u32, 2 * j as u32 + 1),
            "lane {j}"
        );
    }
    for valid in 1..=32usize {
        let (a, b) = f32_tail_masks(valid);
        assert_eq!(a.count_ones() as usize, valid.min(16), "valid {valid}");
        assert_eq!(
            b.count_ones() as usize,
            valid.saturating_sub(16),
            "valid {valid}"
        );
        assert_eq!(
            a.trailing_ones() + b.trailing_ones(),
            valid as u32,
            "valid {valid}"
        );
    }
    for n in 0..64 {
        assert_eq!(byte_mask64(n).trailing_ones(), n as u32);
        assert_eq!(byte_mask64(n).count_ones(), n as u32);
    }
    // Word lane i of the masked load is the high half of dword lane i / 2 when i is odd.
    for i in 0..32 {
        assert_eq!((ODD_WORDS >> i) & 1, i as u32 % 2, "word lane {i}");
    }
    assert_eq!(HIGH_HALF, u32::MAX << HALF_BITS);
}

/// `cvtph_ps`'s model agrees with `codes::f16_to_f32` on every non-NaN half, so the F16 checks
/// below rest on two independent conversions.
#[test]
fn cvtph_model_matches_codes() {
    for h in 0..=u16::MAX {
        let got = f32::from_bits(cvtph_ps([h; 16])[0]);
        let want = f16_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
        }
    }
}

/// Each loader's lanes hold the right columns of the right row, for every row length up to
/// 200 and row blocks of 1..16 rows starting anywhere, reading only the matrix's bytes; the
/// activation layouts pair lane `j` with the same columns; and F32 of BF16 values loads the
/// BF16 kernel's bits, F16 its widened twin's bits.
#[test]
fn loaders_pick_each_columns_weight_and_activation() {
    let mut rng = Rng(0x5eed_0001);
    for cols in 1..=200usize {
        let rows = 3 + cols % 5;
        let twins = Twins::new(&mut rng, rows * cols);
        let x: Vec<f32> = (0..cols).map(|_| rng.value()).collect();
        let exact = Activations::portable(Tier::Avx512, &x, cols);
        let bf16_act = Activations::portable(Tier::Avx512Bf16, &x, cols);
        let x_bf16: Vec<f32> = x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect();
        for block in 0..cols.div_ceil(32) {
            let valid = (cols - 32 * block).min(32);
            let (xe, xo) = act_split(&exact, false, 0, block);
            let (be, bo) = act_split(&bf16_act, true, 0, block);
            for j in 0..16 {
                let (c_even, c_odd) = (32 * block + 2 * j, 32 * block + 2 * j + 1);
                assert_eq!(
                    xe[j],
                    expected(&x, c_even),
                    "perm32 cols {cols} col {c_even}"
                );
                assert_eq!(xo[j], expected(&x, c_odd), "perm32 cols {cols} col {c_odd}");
                assert_eq!(
                    be[j],
                    expected(&x_bf16, c_even),
                    "bf16 cols {cols} col {c_even}"
                );
                assert_eq!(
                    bo[j],
                    expected(&x_bf16, c_odd),
                    "bf16 cols {cols} col {c_odd}"
                );
            }
            for row0 in 0..rows {
                for r in 0..rows - row0 {
                    let row = row0 + r;
                    let values = &twins.values[row * cols..(row + 1) * cols];
                    let halves = &twins.halves[row * cols..(row + 1) * cols];
                    let load = |format: Format, bytes: &[u8]| {
                        let at = row0 * cols * format.elem()
                            + block_offset(r, cols, block, format.elem());
                        format.split(bytes, at, valid)
                    };
                    let bf16 = load(Format::Bf16, &twins.bf16);
                    let f32_bf16 = load(Format::F32, &twins.f32_of_bf16);
                    let f16 = load(Format::F16, &twins.f16);
                    let f32_f16 = load(Format::F32, &twins.f32_of_f16);
                    for j in 0..16 {
                        let (c_even, c_odd) = (32 * block + 2 * j, 32 * block + 2 * j + 1);
                        let cr = (cols, row, r);
                        assert_eq!(bf16.0[j], expected(values, c_even), "bf16 even {cr:?} {j}");
                        assert_eq!(bf16.1[j], expected(values, c_odd), "bf16 odd {cr:?} {j}");
                        assert_eq!(
                            f32_f16.0[j],
                            expected(halves, c_even),
                            "f32 even {cr:?} {j}"
                        );
                        assert_eq!(f32_f16.1[j], expected(halves, c_odd), "f32 odd {cr:?} {j}");
                    }
                    assert_eq!(f32_bf16, bf16, "cols {cols} row {row}: F32 of BF16 != BF16");
                    assert_eq!(f16, f32_f16, "cols {cols} row {row}: F16 != F32 of F16");
                }
            }
        }
    }
}

/// Special values (NaN, infinities, subnormals, signed zeros) load to the same lanes in F32
/// as in BF16 (NaN payloads included), and F16 to its F32 twin (NaNs as NaNs).
#[test]
fn loaders_agree_on_special_values() {
    let specials: Vec<u16> = vec![
        0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x0001, 0x807F, 0x0080, 0x7F7F,
        0xFF7F, 0x3F80, 0xBF80,
    ];
    for cols in [17usize, 32, 45, 64] {
        let bf16_bits: Vec<u16> = (0..cols)
            .map(|c| specials[(c * 5) % specials.len()])
            .collect();
        let bf16: Vec<u8> = bf16_bits.iter().flat_map(|h| h.to_le_bytes()).collect();
        let f32s: Vec<u8> = bf16_bits
            .iter()
            .flat_map(|&h| bf16_to_f32(h).to_le_bytes())
            .collect();
        let f16_specials: Vec<u16> = vec![
            0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF,
        ];
        let f16_bits: Vec<u16> = (0..cols)
            .map(|c| f16_specials[(c * 3) % f16_specials.len()])
            .collect();
        let f16: Vec<u8> = f16_bits.iter().flat_map(|h| h.to_le_bytes()).collect();
        let f16_wide: Vec<u8> = f16_bits
            .iter()
            .flat_map(|&h| f16_to_f32(h).to_le_bytes())
            .collect();
        for block in 0..cols.div_ceil(32) {
            let valid = (cols - 32 * block).min(32);
            let a = Format::Bf16.split(&bf16, block_offset(0, cols, block, 2), valid);
            let b = Format::F32.split(&f32s, block_offset(0, cols, block, 4), valid);
            assert_eq!(a, b, "cols {cols} block {block}");
            let h = Format::F16.split(&f16, block_offset(0, cols, block, 2), valid);
            let w = Format::F32.split(&f16_wide, block_offset(0, cols, block, 4), valid);
            for j in 0..16 {
                for (got, want) in [(h.0[j], w.0[j]), (h.1[j], w.1[j])] {
                    let (got, want) = (f32::from_bits(got), f32::from_bits(want));
                    assert!(
                        got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                        "cols {cols} block {block} lane {j}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The modelled row kernels through the real dispatch: F32 of BF16 values gives the BF16
/// kernel's bits and F16 its F32 twin's, in both activation layouts, for GEMVs (K3's and
/// k3-0.40b's widths, which select the width-specialised copies, and odd widths) and GEMMs of
/// 2..9 tokens (token groups, row blocks of 4 and their tails); every token's output equals
/// its GEMV's bits; and each result is within `dot_bound`'s error of the exact dot product.
#[test]
fn modelled_kernels_match_bf16_and_the_oracle() {
    let mut rng = Rng(0x5eed_0002);
    let shapes: &[(usize, usize, usize)] = &[
        // (rows, cols, tokens)
        (19, 256, 1),
        (9, 512, 1),
        (17, 1024, 1),
        (3, 1536, 1),
        (18, 7168, 1),
        (33, 40, 1),
        (21, 3000, 1),
        (7, 77, 3),
        (10, 33, 2),
        (13, 100, 5),
        (6, 130, 9),
        (5, 7168, 4),
    ];
    for &(rows, cols, tokens) in shapes {
        let twins = Twins::new(&mut rng, rows * cols);
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.value()).collect();
        for bf16_act in [false, true] {
            let tier = if bf16_act {
                Tier::Avx512Bf16
            } else {
                Tier::Avx512
            };
            let act = Activations::portable(tier, &x, cols);
            let model = |bytes: &[u8], format: Format, range: Range<usize>, act: &Activations| {
                let m = Model {
                    bytes,
                    rows,
                    cols,
                    format,
                    bf16_act,
                };
                model_matmul(&m, act, range)
            };
            let what = format!("{rows}x{cols}, {tokens} tokens, bf16 activations {bf16_act}");
            let f32_bf16 = model(&twins.f32_of_bf16, Format::F32, 0..rows, &act);
            let f32_f16 = model(&twins.f32_of_f16, Format::F32, 0..rows, &act);
            let f16 = model(&twins.f16, Format::F16, 0..rows, &act);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            if !bf16_act {
                // The exact BF16 kernel reads `perm32`; the approximate tier's BF16 kernel is
                // `vdpbf16ps`, not modelled here.
                let bf16 = model(&twins.bf16, Format::Bf16, 0..rows, &act);
                assert_eq!(bits(&f32_bf16), bits(&bf16), "F32 of BF16 vs BF16, {what}");
            }
            assert_eq!(bits(&f16), bits(&f32_f16), "F16 vs F32 of F16, {what}");
            // A row range not starting at 0 (outputs at the range's offsets).
            let split = rows / 3;
            let tail = model(&twins.f32_of_bf16, Format::F32, split..rows, &act);
            for t in 0..tokens {
                for (i, row) in (split..rows).enumerate() {
                    assert_eq!(
                        tail[t * (rows - split) + i].to_bits(),
                        f32_bf16[t * rows + row].to_bits(),
                        "row split at {split}, row {row} token {t}, {what}"
                    );
                }
            }
            for t in 0..tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let one = Activations::portable(tier, xt, cols);
                let gemv = model(&twins.f32_of_bf16, Format::F32, 0..rows, &one);
                let used: Vec<f32> = if bf16_act {
                    xt.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect()
                } else {
                    xt.to_vec()
                };
                for row in 0..rows {
                    let got = f32_bf16[t * rows + row];
                    assert_eq!(
                        got.to_bits(),
                        gemv[row].to_bits(),
                        "batch vs GEMV row {row} token {t}, {what}"
                    );
                    let w = &twins.values[row * cols..(row + 1) * cols];
                    let exact: f64 = w
                        .iter()
                        .zip(&used)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    let abs: f64 = w
                        .iter()
                        .zip(&used)
                        .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                        .sum();
                    // Recursive f32 summation of `cols` products (FMA chains then a tree):
                    // |error| <= gamma_(cols+2) * sum |w x|, gamma_k = k u / (1 - k u), u = 2^-24.
                    let k = (cols + 2) as f64 * f64::from(f32::EPSILON) / 2.0;
                    let bound = k / (1.0 - k) * abs + f64::from(f32::MIN_POSITIVE);
                    assert!(
                        (f64::from(got) - exact).abs() <= bound,
                        "row {row} token {t}: {got} vs exact {exact} (bound {bound}), {what}"
                    );
                }
            }
        }
    }
}

/// `hsum`'s and `hsum16`'s shuffles sum each vector's lanes in the documented tree: `hsum`
/// instruction by instruction equals the tree's bits, and `hsum16` puts `hsum(v[l])` in lane
/// `l` bit for bit, on values whose sums depend on the order of additions.
#[test]
fn hsum_shuffles_sum_in_the_documented_tree() {
    let mut rng = Rng(0x5eed_0003);
    for _ in 0..500 {
        let v: [Lanes; 16] =
            core::array::from_fn(|_| core::array::from_fn(|_| rng.value().to_bits()));
        let sums = hsum16(&v);
        for l in 0..16 {
            assert_eq!(
                hsum_insns(v[l]).to_bits(),
                hsum(v[l]).to_bits(),
                "hsum of vector {l}"
            );
            assert_eq!(sums[l], hsum(v[l]).to_bits(), "hsum16 lane {l}");
        }
    }
    // Order matters for these values: a different tree gives different bits.
    let v: Lanes = core::array::from_fn(|i| {
        if i == 0 {
            1.0f32
        } else if i == 8 {
            -1.0
        } else {
            2f32.powi(-25)
        }
        .to_bits()
    });
    let sequential = (0..16).fold(0.0f32, |s, i| s + f32::from_bits(v[i]));
    assert_ne!(hsum(v).to_bits(), sequential.to_bits());
}

/// The MXFP4 dequant's interleave turns a group's (even, odd) decode back into columns.
#[test]
fn interleave_restores_column_order() {
    let even: Lanes = core::array::from_fn(|j| 2 * j as u32);
    let odd: Lanes = core::array::from_fn(|j| 2 * j as u32 + 1);
    let first = permutex2var_ps(even, &INTERLEAVE_FIRST, odd);
    let second = permutex2var_ps(even, &INTERLEAVE_SECOND, odd);
    for c in 0..16 {
        assert_eq!(
            (first[c], second[c]),
            (c as u32, 16 + c as u32),
            "column {c}"
        );
    }
}
