//! The `avx2` tier against the modelled `avx512` exact tier, bit for bit, on this CPU: BF16,
//! F16 and F32 through the instruction-level model (`kernel::model_matmul`), MXFP4 through a
//! lane model of `exact::Mxfp4::block` (decoded weights, 16 FMA chains, `hsum`'s tree).
//!
//! NaN results compare as equal whatever their payload: the model's `mul_add` may be a
//! software FMA off-target, which need not produce the hardware's default NaN.

use k3_testkit::Rng;

use crate::activations::Activations;
use crate::kernels::Kernels;
use crate::tier::Tier;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, MxFp4Matrix};

use super::intrinsics::Lanes;
use super::kernel::{Format, Model, hsum, hsum_insns, model_matmul};

/// Mixed signs and magnitudes (2^-20..2^20), so the order of additions shows in the bits.
fn value(rng: &mut Rng) -> f32 {
    rng.mixed(-20..=20)
}

/// The avx2 kernels, or `None` with a note where this CPU lacks avx2, fma or f16c.
fn avx2() -> Option<Kernels> {
    match Kernels::new(Tier::Avx2) {
        Ok(k) => Some(k),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn assert_same_bits(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{label}: output {i}: avx2 {g:e} ({:#010x}) vs modelled avx512 {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// `avx2::acc::hsum` of two halves gives the modelled `sums::hsum` of the 16 lanes (the documented
/// tree), on values where the order of additions shows in the last bits.
#[test]
fn avx2_hsum_is_the_avx512_tree() {
    if avx2().is_none() {
        return;
    }
    use core::arch::x86_64::_mm256_loadu_ps;
    let mut rng = Rng::new(0xa7c2_0003);
    for _ in 0..2000 {
        let lanes: [f32; 16] = core::array::from_fn(|_| value(&mut rng));
        // SAFETY: avx2 was detected (`avx2()` above); each load reads 8 of the 16 values.
        let got = unsafe {
            crate::x86::avx2::acc::hsum([
                _mm256_loadu_ps(lanes.as_ptr()),
                _mm256_loadu_ps(lanes.as_ptr().add(8)),
            ])
        };
        let want = hsum(lanes.map(f32::to_bits));
        assert_eq!(got.to_bits(), want.to_bits(), "{lanes:?}");
    }
}

/// Shapes that exercise every path: 1..=16 tokens (and two token groups past 16), row counts
/// that leave tails of every row block, ranges not starting at row 0, widths with and without
/// a partial last block of 32.
fn shapes(rng: &mut Rng, col_step: usize, max_cols: usize) -> Vec<(usize, usize, usize)> {
    let mut shapes = Vec::new();
    for tokens in (1..=16).chain([23, 64]) {
        for _ in 0..3 {
            let rows = 1 + rng.below(21);
            let cols = col_step * (1 + rng.below(max_cols / col_step));
            shapes.push((rows, cols, tokens));
        }
    }
    shapes
}

/// BF16, F16 and F32 matrices: the avx2 tier gives the modelled avx512 kernel's bits.
#[test]
fn avx2_float_formats_equal_modelled_avx512_bitwise() {
    let Some(k) = avx2() else { return };
    let mut rng = Rng::new(0xa7c2_0001);
    for (rows, cols, tokens) in shapes(&mut rng, 1, 300) {
        let values: Vec<f32> = (0..rows * cols).map(|_| value(&mut rng)).collect();
        let x: Vec<f32> = (0..tokens * cols).map(|_| value(&mut rng)).collect();
        let bf16: Vec<u8> = values
            .iter()
            .flat_map(|&v| crate::codes::f32_to_bf16(v).to_le_bytes())
            .collect();
        let f16: Vec<u8> = values
            .iter()
            .flat_map(|&v| crate::codes::f32_to_f16(v).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let act = k.prepare(&x, cols).unwrap();
        let modelled_act = Activations::portable(Tier::Avx512, &x, cols);
        let start = rng.below(rows);
        let range = start..rows;
        for (format, bytes) in [
            (Format::Bf16, &bf16),
            (Format::F16, &f16),
            (Format::F32, &f32s),
        ] {
            let model = Model {
                bytes,
                rows,
                cols,
                format,
                bf16_act: false,
            };
            let want = model_matmul(&model, &modelled_act, range.clone());
            let mut got = vec![f32::NAN; range.len() * tokens];
            match format {
                Format::Bf16 => {
                    let m = Bf16Matrix::new(bytes, rows, cols).unwrap();
                    k.matmul_bf16(&m, &act, range.clone(), &mut got)
                }
                Format::F16 => {
                    let m = F16Matrix::new(bytes, rows, cols).unwrap();
                    k.matmul_f16(&m, &act, range.clone(), &mut got)
                }
                Format::F32 => {
                    let m = F32Matrix::new(bytes, rows, cols).unwrap();
                    k.matmul_f32(&m, &act, range.clone(), &mut got)
                }
            }
            .unwrap();
            let label = format!("{format:?} [{rows}x{cols}] rows {range:?}, {tokens} tokens");
            assert_same_bits(&label, &got, &want);
        }
    }
}

/// `exact::Mxfp4::block`'s arithmetic for one (row, token): lane `j` takes, group by group,
/// `fma(w[32g + 2j], x[32g + 2j])` then `fma(w[32g + 2j + 1], x[32g + 2j + 1])`; the lanes
/// are summed in `hsum`'s tree (`store_sums` gives `hsum`'s bits for every block shape).
fn mxfp4_lane_model(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (wg, xg) in w.chunks_exact(32).zip(x.chunks_exact(32)) {
        for (j, lane) in acc.iter_mut().enumerate() {
            *lane = wg[2 * j].mul_add(xg[2 * j], *lane);
            *lane = wg[2 * j + 1].mul_add(xg[2 * j + 1], *lane);
        }
    }
    let lanes: Lanes = acc.map(f32::to_bits);
    let sum = hsum(lanes);
    assert_eq!(sum.to_bits(), hsum_insns(lanes).to_bits());
    sum
}

/// MXFP4 matrices, every code and the extreme scales (0x00: 2^-127, 0xFE: 2^127, whose
/// 4 x 2^127 and 6 x 2^127 overflow to infinity): the avx2 tier gives the lane model's bits,
/// and its dequant gives scalar's.
#[test]
fn avx2_mxfp4_equals_modelled_avx512_bitwise() {
    let Some(k) = avx2() else { return };
    let scalar = Kernels::scalar();
    let mut rng = Rng::new(0xa7c2_0002);
    for (case, (rows, cols, tokens)) in shapes(&mut rng, 32, 320).into_iter().enumerate() {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
        // Most cases keep the scales moderate, so sums are finite and rounding shows; some
        // draw every legal byte, with infinities and NaNs in the sums.
        let (lo, span) = if case % 4 == 0 { (0, 255) } else { (112, 30) };
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| (lo + rng.below(span)) as u8)
            .collect();
        let m = MxFp4Matrix::new(&packed, &scales, rows, cols).unwrap();
        let x: Vec<f32> = (0..tokens * cols).map(|_| value(&mut rng)).collect();
        let mut dense = vec![0.0f32; rows * cols];
        scalar.dequant_mxfp4(&m, 0..rows, &mut dense).unwrap();
        let mut decoded = vec![f32::NAN; rows * cols];
        k.dequant_mxfp4(&m, 0..rows, &mut decoded).unwrap();
        let label = format!("mxfp4 [{rows}x{cols}], {tokens} tokens");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decoded), bits(&dense), "{label}: dequant");
        let start = rng.below(rows);
        let range = start..rows;
        let act = k.prepare(&x, cols).unwrap();
        let mut got = vec![f32::NAN; range.len() * tokens];
        k.matmul_mxfp4(&m, &act, range.clone(), &mut got).unwrap();
        let mut want = vec![0.0f32; range.len() * tokens];
        for t in 0..tokens {
            for (i, r) in range.clone().enumerate() {
                want[t * range.len() + i] = mxfp4_lane_model(
                    &dense[r * cols..(r + 1) * cols],
                    &x[t * cols..(t + 1) * cols],
                );
            }
        }
        assert_same_bits(&format!("{label}, rows {range:?}"), &got, &want);
    }
}
