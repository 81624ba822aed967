//! Packed BF16 against BF16: every tier's packed matmul has the bits of its BF16 matmul on the
//! values packed, for every token count and row range, exception blocks included; dequant
//! gives the BF16 values widened.

use k3_testkit::Rng;
use mxfp4_kernels::codes::bf16_to_f32;
use mxfp4_kernels::{Bf16Matrix, MAX_TOKENS, PackedBf16, WeightMatrix};
use proptest::prelude::{ProptestConfig, any, proptest};

use crate::common::*;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `[rows, cols]` BF16 bytes like trained weights (exponents within a few octaves of the
/// largest, any sign and mantissa), with every `wide`-th block spanning 24 exponents (an
/// exception) and some zeros and subnormals.
fn weights(rng: &mut Rng, rows: usize, cols: usize, wide: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols * 2);
    for i in 0..rows * cols {
        let r = rng.next_u64();
        let exponent = if (i / 32) % wide == wide - 1 {
            100 + (r % 24) as u16
        } else {
            match r % 97 {
                0 => 0,
                _ => 112 + ((r >> 8) % 10) as u16,
            }
        };
        let v = ((r >> 20) as u16 & 0x807F) | (exponent << 7);
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn check(seed: u64, rows: usize, blocks: usize, tokens: usize, start: usize, wide: usize) {
    let mut rng = Rng::new(seed);
    let cols = 32 * blocks;
    let raw = weights(&mut rng, rows, cols, wide);
    let packed = PackedBf16::pack(&raw, rows, cols).unwrap();
    let (p, b) = (packed.view(), Bf16Matrix::new(&raw, rows, cols).unwrap());
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
    let start = start.min(rows - 1);
    let n = rows - start;
    for k in tiers() {
        let act = k.prepare(&x, cols).unwrap();
        let mut want = vec![0.0; n * tokens];
        let mut got = vec![0.0; n * tokens];
        k.matmul_bf16(&b, &act, start..rows, &mut want).unwrap();
        k.matmul(&WeightMatrix::from(p), &act, start..rows, &mut got)
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{} [{rows}x{cols}] rows {start}.., {tokens} tokens, {} exceptions",
            k.tier(),
            packed.exception_count()
        );
        let mut widened = vec![0.0; n * cols];
        k.dequant(&WeightMatrix::from(p), start..rows, &mut widened)
            .unwrap();
        let expect: Vec<u32> = raw[start * cols * 2..]
            .chunks_exact(2)
            .map(|v| bf16_to_f32(u16::from_le_bytes([v[0], v[1]])).to_bits())
            .collect();
        assert_eq!(bits(&widened), expect, "{} dequant", k.tier());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn packed_matmul_has_the_bf16_bits(seed in any::<u64>(), rows in 1usize..14,
                                       blocks in 1usize..12, tokens in 1usize..=MAX_TOKENS,
                                       start in 0usize..14, wide in 2usize..9) {
        check(seed, rows, blocks, tokens, start, wide);
    }
}

/// K3's widths, where the GEMV runs 4-row blocks over long rows with exceptions scattered,
/// and GEMMs of 4 and 5 tokens (one group in registers: 3 rows per block), 8 (one group of 2
/// rows per block in the approximate tiers, two groups of 4 in `avx512`), 9 and 12 (two
/// groups), 13 and 16 (decoded rows through the BF16 GEMM, several buffers of rows at the
/// widest).
#[test]
fn packed_gemv_at_model_widths() {
    for (seed, cols) in [(1u64, 7168usize), (2, 2048)] {
        for tokens in [1, 4, 5, 8, 9, 12, 13, 16] {
            check(seed, 37, cols / 32, tokens, 3, 41);
        }
    }
    // 18,432 columns (the dense MLP's down projection): decoded rows in buffers of 16 rows,
    // so 34 rows run as 16, 16 and 2.
    check(3, 37, 18432 / 32, 13, 3, 41);
}

/// The widths the kernels have copies compiled for (`C`), and row counts past the GEMV's row
/// block (8 or 16 rows) with a tail, one token and several.
#[test]
fn packed_matmul_has_the_bf16_bits_at_compiled_widths() {
    for (seed, blocks) in [(1, 16), (2, 48)] {
        for tokens in [1, 5, 6, 7] {
            check(seed, 37, blocks, tokens, 3, 5);
        }
    }
}
