//! The model's checks: each loader picks each column's weight and activation, the modelled kernels match BF16 and the scalar oracle, the shuffles sum in the documented tree.

use std::ops::Range;

use k3_testkit::Rng;

use crate::activations::Activations;
use crate::codes::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::tier::Tier;
use crate::x86::lanes::{
    F32_EVEN_IDX, F32_ODD_IDX, HALF_BITS, HIGH_HALF, INTERLEAVE_FIRST, INTERLEAVE_SECOND,
    block_offset, byte_mask64, f32_tail_masks,
};

use super::intrinsics::*;
use super::kernel::*;

/// A value of mixed sign and magnitude (about 2^-37..2^11: F16 normals, subnormals and zeros).
fn value(rng: &mut Rng) -> f32 {
    rng.mixed(-12..=12)
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
            .map(|_| bf16_to_f32(f32_to_bf16(value(rng))))
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
    let mut rng = Rng::new(0x5eed_0001);
    for cols in 1..=200usize {
        let rows = 3 + cols % 5;
        let twins = Twins::new(&mut rng, rows * cols);
        let x: Vec<f32> = (0..cols).map(|_| value(&mut rng)).collect();
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
    let mut rng = Rng::new(0x5eed_0002);
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
        let x: Vec<f32> = (0..tokens * cols).map(|_| value(&mut rng)).collect();
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
    let mut rng = Rng::new(0x5eed_0003);
    for _ in 0..500 {
        let v: [Lanes; 16] =
            core::array::from_fn(|_| core::array::from_fn(|_| value(&mut rng).to_bits()));
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
