//! The `avx2` tier: against scalar within `common::dot_bound` on ragged shapes with 1..=16
//! tokens, batch invariant bit for bit, and bit-identical to the `avx512` exact tier where the
//! CPU runs both (the determinism contract: an AVX2 host and an AVX-512 host give the same
//! logits).

use k3_testkit::Rng;
use mxfp4_kernels::codes::{f32_to_bf16, f32_to_f16};
use mxfp4_kernels::{Bf16Matrix, F16Matrix, F32Matrix, Kernels, MxFp4Matrix, Tier, WeightMatrix};

use crate::common::*;

/// One matrix of each format with the given shape (MXFP4 only where `cols` is a multiple of
/// 32), owned, with each format's exact f32 values for the bound.
struct Formats {
    rows: usize,
    cols: usize,
    mx: Option<OwnedMx>,
    bf16: Vec<u8>,
    f16: Vec<u8>,
    f32s: Vec<u8>,
}

impl Formats {
    fn random(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * 2.0).collect();
        Self {
            rows,
            cols,
            mx: cols
                .is_multiple_of(32)
                .then(|| OwnedMx::random(rng, rows, cols, 120, 130)),
            bf16: values
                .iter()
                .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
                .collect(),
            f16: values
                .iter()
                .flat_map(|&v| f32_to_f16(v).to_le_bytes())
                .collect(),
            f32s: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    fn matrices(&self) -> Vec<WeightMatrix<'_>> {
        let (rows, cols) = (self.rows, self.cols);
        let mut all: Vec<WeightMatrix<'_>> = vec![
            Bf16Matrix::new(&self.bf16, rows, cols).unwrap().into(),
            F16Matrix::new(&self.f16, rows, cols).unwrap().into(),
            F32Matrix::new(&self.f32s, rows, cols).unwrap().into(),
        ];
        if let Some(mx) = &self.mx {
            let m: MxFp4Matrix<'_> = mx.view();
            all.push(m.into());
        }
        all
    }
}

fn matmul(k: &Kernels, m: &WeightMatrix<'_>, x: &[f32], rows: std::ops::Range<usize>) -> Vec<f32> {
    let act = k.prepare(x, m.cols()).unwrap();
    let mut out = vec![f32::NAN; rows.len() * act.tokens()];
    k.matmul(m, &act, rows, &mut out).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Ragged shapes: rows that leave a tail of every row block, widths with a partial last block
/// of 32 (and MXFP4 widths of odd group counts), 1..=16 tokens.
fn ragged_shapes(rng: &mut Rng) -> Vec<(usize, usize, usize)> {
    let mut shapes = Vec::new();
    for tokens in 1..=16 {
        for cols in [32 * (1 + rng.below(9)), 1 + rng.below(290)] {
            shapes.push((1 + rng.below(19), cols, tokens));
        }
    }
    shapes
}

/// Every format against scalar within the proven bound, and each token's outputs equal to a
/// one-token call with that token alone (batch invariance), bit for bit.
#[test]
fn avx2_within_bound_and_batch_invariant_on_ragged_shapes() {
    let Ok(k) = Kernels::new(Tier::Avx2) else {
        eprintln!("skipped: this CPU lacks avx2, fma or f16c");
        return;
    };
    let scalar = Kernels::scalar();
    let mut rng = Rng::new(0xa7c2);
    for (rows, cols, tokens) in ragged_shapes(&mut rng) {
        let formats = Formats::random(&mut rng, rows, cols);
        let x = random_vec(&mut rng, tokens * cols);
        for m in formats.matrices() {
            let label = format!("{:?} [{rows}x{cols}], {tokens} tokens", m.format());
            let mut dense = vec![0.0; rows * cols];
            scalar.dequant(&m, 0..rows, &mut dense).unwrap();
            let got = matmul(&k, &m, &x, 0..rows);
            let want = matmul(&scalar, &m, &x, 0..rows);
            assert_within_bound(&label, Tier::Avx2, rows, (&dense, &x), (&got, &want));
            for t in 0..tokens {
                let one = matmul(&k, &m, &x[t * cols..(t + 1) * cols], 0..rows);
                assert_eq!(
                    bits(&got[t * rows..(t + 1) * rows]),
                    bits(&one),
                    "{label}: token {t} differs from its one-token call"
                );
            }
        }
    }
}

/// Where the CPU has both, the `avx2` tier gives the `avx512` tier's bits for every format,
/// shape and token count (including the hsum16 blocks and token groups past 4).
#[test]
fn avx2_equals_avx512_bitwise_where_both_exist() {
    let (Ok(avx2), Ok(avx512)) = (Kernels::new(Tier::Avx2), Kernels::new(Tier::Avx512)) else {
        eprintln!("skipped: this CPU does not run both the avx2 and the avx512 tier");
        return;
    };
    let mut rng = Rng::new(0xa7c3);
    let mut shapes = ragged_shapes(&mut rng);
    shapes.extend([
        (40, 3584, 1),
        (37, 1024, 1),
        (33, 7168, 1),
        (21, 512, 23),
        (9, 3072, 64),
    ]);
    for (rows, cols, tokens) in shapes {
        let formats = Formats::random(&mut rng, rows, cols);
        let x = random_vec(&mut rng, tokens * cols);
        for m in formats.matrices() {
            let label = format!("{:?} [{rows}x{cols}], {tokens} tokens", m.format());
            let start = rng.below(rows);
            assert_eq!(
                bits(&matmul(&avx2, &m, &x, start..rows)),
                bits(&matmul(&avx512, &m, &x, start..rows)),
                "{label}, rows {start}..{rows}"
            );
        }
    }
}
