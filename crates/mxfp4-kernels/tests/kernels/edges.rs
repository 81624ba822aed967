//! Edge cases and bad input: E8M0 bytes 0x00/0x01/0x7F/0xFE/0xFF, -0 codes, row tails, every
//! code under every scale, the ggml layout round trip, and errors (never panics) for bad shapes.

use k3_testkit::Rng;
use mxfp4_kernels::codes::{E2M1_VALUES, E8M0_TO_F32, e8m0_to_f32};
use mxfp4_kernels::ggml::{BlockMxfp4, from_ggml, to_ggml};
use mxfp4_kernels::{Bf16Matrix, Error, Kernels, MAX_TOKENS, MxFp4Matrix, Tier};

use crate::common::*;

#[test]
fn e8m0_edges_follow_ocp_mx() {
    assert_eq!(e8m0_to_f32(0x00), 2f32.powi(-127)); // subnormal, not zero
    assert!(e8m0_to_f32(0x00) > 0.0 && !e8m0_to_f32(0x00).is_normal());
    assert_eq!(e8m0_to_f32(0x01), 2f32.powi(-126));
    assert_eq!(e8m0_to_f32(0x7F), 1.0);
    assert_eq!(e8m0_to_f32(0xFE), 2f32.powi(127));
    assert!(e8m0_to_f32(0xFF).is_nan());
    for s in 1..=254u8 {
        assert_eq!(
            E8M0_TO_F32[s as usize],
            2f64.powi(i32::from(s) - 127) as f32,
            "scale byte {s}"
        );
    }
}

#[test]
fn e2m1_table_is_the_spec_table() {
    let magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for code in 0..16 {
        let v = E2M1_VALUES[code];
        assert_eq!(v.abs(), magnitudes[code & 7]);
        assert_eq!(v.is_sign_negative(), code >= 8, "code {code}");
    }
}

/// Every code under every valid scale byte, decoded by each tier, equals code value x scale
/// (including -0 and the f32 overflow of 6 x 2^127 to infinity, identically in every tier).
#[test]
fn every_code_under_every_scale() {
    let rows = 255;
    let cols = 32;
    // Row s: scale byte s; codes 0..15 in columns 0..15 and again in 16..31 (in reverse).
    let mut packed = vec![0u8; rows * cols / 2];
    for row in 0..rows {
        for b in 0..16 {
            let (lo, hi) = if b < 8 {
                (2 * b, 2 * b + 1)
            } else {
                (31 - 2 * b, 30 - 2 * b)
            };
            packed[row * 16 + b] = (lo as u8 & 0xF) | ((hi as u8 & 0xF) << 4);
        }
    }
    let scales: Vec<u8> = (0..rows as u8).collect();
    let m = MxFp4Matrix::new(&packed, &scales, rows, cols).unwrap();
    let mut seen = [[false; 16]; 255];
    for k in tiers() {
        let mut out = vec![0.0; rows * cols];
        k.dequant_mxfp4(&m, 0..rows, &mut out).unwrap();
        for row in 0..rows {
            for c in 0..cols {
                let code = (packed[row * 16 + c / 2] >> (4 * (c % 2))) & 0xF;
                seen[row][code as usize] = true;
                let want = E2M1_VALUES[code as usize] * E8M0_TO_F32[row];
                assert_eq!(
                    out[row * cols + c].to_bits(),
                    want.to_bits(),
                    "{}: scale {row} code {code}",
                    k.tier()
                );
            }
        }
    }
    assert!(
        seen.iter().all(|codes| codes.iter().all(|&s| s)),
        "not every code/scale pair was covered"
    );
    // -0 stays -0 (equal to 0).
    let mut out = vec![0.0; cols];
    Kernels::scalar()
        .dequant_mxfp4(&m, 127..128, &mut out)
        .unwrap();
    assert!(out.iter().any(|v| v.to_bits() == (-0.0f32).to_bits()));
}

/// The first NaN scale is found wherever it lies: inside the scan's 64-byte chunks, on their
/// edges, in the tail after the last whole chunk, and before a second one.
#[test]
fn the_first_nan_scale_is_named_anywhere() {
    let (rows, groups) = (13, 29); // 377 scales: 5 whole chunks of 64 and a tail of 57
    let packed = vec![0u8; rows * groups * 16];
    for at in [0, 1, 63, 64, 127, 128, 200, 319, 320, 321, 376] {
        for second in [None, Some(at + 1), Some(376)] {
            let mut scales = vec![127u8; rows * groups];
            scales[at] = 0xFF;
            if let Some(b) = second.filter(|&b| b < scales.len()) {
                scales[b] = 0xFF;
            }
            assert_eq!(
                MxFp4Matrix::new(&packed, &scales, rows, groups * 32).unwrap_err(),
                Error::NanScale {
                    what: "mxfp4 matrix",
                    row: at / groups,
                    group: at % groups
                },
                "NaN at {at}, then {second:?}"
            );
        }
    }
}

#[test]
fn rejects_nan_scale_and_bad_lengths() {
    let packed = vec![0u8; 4 * 32];
    let mut scales = vec![127u8; 4 * 2];
    assert!(MxFp4Matrix::new(&packed, &scales, 4, 64).is_ok());
    scales[5] = 0xFF;
    assert_eq!(
        MxFp4Matrix::new(&packed, &scales, 4, 64).unwrap_err(),
        Error::NanScale {
            what: "mxfp4 matrix",
            row: 2,
            group: 1
        }
    );
    scales[5] = 0;
    assert!(matches!(
        MxFp4Matrix::new(&packed[1..], &scales, 4, 64),
        Err(Error::BufferLength {
            buffer: "weight_packed",
            expected: 128,
            found: 127,
            ..
        })
    ));
    assert!(matches!(
        MxFp4Matrix::new(&packed, &scales[1..], 4, 64),
        Err(Error::BufferLength {
            buffer: "weight_scale",
            expected: 8,
            found: 7,
            ..
        })
    ));
    assert!(matches!(
        MxFp4Matrix::new(&packed, &scales, 8, 48),
        Err(Error::ColsNotGroupMultiple { cols: 48, .. })
    ));
    assert!(matches!(
        MxFp4Matrix::new(&[], &[], 0, 32),
        Err(Error::BadShape { .. })
    ));
    assert!(matches!(
        MxFp4Matrix::new(&[], &[], usize::MAX, 64),
        Err(Error::BadShape { .. })
    ));
    let msg = MxFp4Matrix::with_name("layers.3.experts.7.w1", &packed, &scales[1..], 4, 64)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layers.3.experts.7.w1") && msg.contains("weight_scale") && msg.contains('8'),
        "{msg}"
    );
    assert!(matches!(
        Bf16Matrix::new(&[0u8; 10], 2, 3),
        Err(Error::BufferLength {
            expected: 12,
            found: 10,
            ..
        })
    ));
    assert!(matches!(
        Bf16Matrix::new(&[], usize::MAX, 4),
        Err(Error::BadShape { .. })
    ));
}

#[test]
fn kernels_reject_bad_calls_without_panicking() {
    let packed = vec![0x11u8; 4 * 16];
    let scales = vec![127u8; 4];
    let m = MxFp4Matrix::new(&packed, &scales, 4, 32).unwrap();
    for k in tiers() {
        let act = k.prepare(&[1.0; 32], 32).unwrap();
        let mut out = vec![0.0; 4];
        assert!(matches!(
            k.matmul_mxfp4(&m, &act, 2..5, &mut out[..3]),
            Err(Error::RowRange { .. })
        ));
        assert!(matches!(
            k.matmul_mxfp4(&m, &act, 0..4, &mut out[..3]),
            Err(Error::OutputLength { .. })
        ));
        let wide = k.prepare(&[1.0; 64], 64).unwrap();
        assert!(matches!(
            k.matmul_mxfp4(&m, &wide, 0..4, &mut out),
            Err(Error::ActivationCols { .. })
        ));
        assert!(matches!(
            k.dequant_mxfp4(&m, 0..4, &mut out),
            Err(Error::OutputLength { .. })
        ));
        assert!(matches!(
            k.prepare(&[1.0; 33], 32),
            Err(Error::ActivationLength { .. })
        ));
        assert!(matches!(
            k.prepare(&vec![1.0; (MAX_TOKENS + 1) * 32], 32),
            Err(Error::ActivationLength { .. })
        ));
        k.matmul_mxfp4(&m, &act, 0..4, &mut out).unwrap();
        assert_eq!(out, [16.0; 4]); // 32 x 0.5 x 1.0
    }
    let scalar_act = Kernels::scalar().prepare(&[1.0; 32], 32).unwrap();
    for tier in [Tier::Avx2, Tier::Avx512] {
        if let Ok(k) = Kernels::new(tier) {
            let mut out = vec![0.0; 4];
            assert!(matches!(
                k.matmul_mxfp4(&m, &scalar_act, 0..4, &mut out),
                Err(Error::TierMismatch { .. })
            ));
        }
    }
    assert_eq!("avx512-vnni".parse::<Tier>().unwrap(), Tier::Avx512Vnni);
    assert_eq!("avx2".parse::<Tier>().unwrap(), Tier::Avx2);
    assert!(matches!("sse2".parse::<Tier>(), Err(Error::UnknownTier(_))));
}

#[test]
fn ggml_round_trip_is_lossless_and_same_values() {
    let mut rng = Rng::new(3);
    let m = OwnedMx::random(&mut rng, 7, 96, 0, 254);
    let blocks = to_ggml(&m.view());
    assert_eq!(blocks.len(), 7 * 3);
    assert_eq!(
        bytemuck::cast_slice::<BlockMxfp4, u8>(&blocks).len(),
        7 * 3 * 17
    );
    for (i, block) in blocks.iter().enumerate() {
        let (row, group) = (i / 3, i % 3);
        assert_eq!(block.e, m.scales[i]);
        for j in 0..32 {
            // Same value; ggml's doubled table has +0 where E2M1 code 8 is -0, so compare values.
            let ours = m.weight(row, 32 * group + j);
            assert!(
                block.value(j) == ours || (block.value(j).is_infinite() && ours.is_infinite()),
                "block {i} element {j}"
            );
            assert_eq!(
                block.value(j).to_bits() & !(1 << 31),
                ours.to_bits() & !(1 << 31),
                "block {i} element {j}"
            );
        }
        // ggml's nibble order: qs[j] = element j (low) | element j + 16 (high).
        for j in 0..16 {
            let code = |c: usize| (m.packed[row * 48 + 16 * group + c / 2] >> (4 * (c % 2))) & 0xF;
            assert_eq!(block.qs[j], code(j) | (code(j + 16) << 4));
        }
    }
    let (packed, scales) = from_ggml(&blocks, 7, 96).unwrap();
    assert_eq!(packed, m.packed);
    assert_eq!(scales, m.scales);
    assert!(matches!(
        from_ggml(&blocks[1..], 7, 96),
        Err(Error::BufferLength { .. })
    ));
    let mut bad = blocks.clone();
    bad[4].e = 0xFF;
    assert!(matches!(
        from_ggml(&bad, 7, 96),
        Err(Error::NanScale {
            row: 1,
            group: 1,
            ..
        })
    ));
}

/// Row tails (rows not a multiple of the row block) and column tails (BF16 cols not a multiple
/// of 32, MXFP4 groups not a multiple of 2 or 4) through every tier, against scalar.
#[test]
fn tails_against_scalar() {
    let mut rng = Rng::new(21);
    for &(rows, groups) in &[(1usize, 1usize), (7, 1), (9, 3), (17, 5), (3, 7)] {
        let cols = 32 * groups;
        let m = OwnedMx::random(&mut rng, rows, cols, 120, 130);
        let x = random_vec(&mut rng, cols);
        let dense: Vec<f32> = (0..rows * cols)
            .map(|i| m.weight(i / cols, i % cols))
            .collect();
        let s = Kernels::scalar();
        let mut want = vec![0.0; rows];
        s.matmul_mxfp4(&m.view(), &s.prepare(&x, cols).unwrap(), 0..rows, &mut want)
            .unwrap();
        for k in tiers() {
            let mut got = vec![0.0; rows];
            k.matmul_mxfp4(&m.view(), &k.prepare(&x, cols).unwrap(), 0..rows, &mut got)
                .unwrap();
            assert_within_bound("mxfp4 tails", k.tier(), rows, (&dense, &x), (&got, &want));
        }
    }
}

#[test]
fn expert_and_situ_reject_mismatched_shapes() {
    let mut rng = Rng::new(31);
    let gate = OwnedMx::random(&mut rng, 64, 32, 120, 126);
    let up = OwnedMx::random(&mut rng, 64, 32, 120, 126);
    let down_ok = OwnedMx::random(&mut rng, 32, 64, 120, 126);
    let down_bad = OwnedMx::random(&mut rng, 32, 96, 120, 126);
    for k in tiers() {
        let z = k.prepare(&[0.5; 32], 32).unwrap();
        let mut scratch = mxfp4_kernels::ExpertScratch::default();
        let mut out = vec![0.0; 32];
        let situ = mxfp4_kernels::Situ::K3;
        k.expert_ffn(
            &gate.view(),
            &up.view(),
            &down_ok.view(),
            &situ,
            &z,
            &mut scratch,
            &mut out,
        )
        .unwrap();
        assert!(matches!(
            k.expert_ffn(
                &gate.view(),
                &up.view(),
                &down_bad.view(),
                &situ,
                &z,
                &mut scratch,
                &mut out
            ),
            Err(Error::ExpertShapes(_))
        ));
        assert!(matches!(
            k.expert_ffn(
                &gate.view(),
                &up.view(),
                &down_ok.view(),
                &situ,
                &z,
                &mut scratch,
                &mut out[..31]
            ),
            Err(Error::OutputLength {
                expected: 32,
                found: 31
            })
        ));
        assert!(matches!(
            situ.apply(&k, &[1.0; 4], &[1.0; 5], &mut [0.0; 4]),
            Err(Error::OutputLength {
                expected: 5,
                found: 4
            })
        ));
    }
}

#[test]
fn quantize_group_round_trips_representable_values_and_bounds_the_error() {
    use mxfp4_kernels::codes::{mxfp4_value, quantize_group};
    // Exactly representable: codes times 2^-3 come back unchanged.
    let mut exact = [0.0f32; 32];
    for (i, v) in exact.iter_mut().enumerate() {
        *v = E2M1_VALUES[i % 16] * 0.125;
    }
    let (packed, scale) = quantize_group(&exact);
    for i in 0..32 {
        let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
        assert_eq!(mxfp4_value(code, scale), exact[i], "element {i}");
    }
    // Random values: never scale 0xFF; within one scale of the value (half the largest gap
    // between E2M1 magnitudes, 4 to 6), or two for the group maximum, which can lie up to 8
    // scales and saturates at 6 (compressed-tensors' rule, floor(log2 max) - 2).
    let mut rng = Rng::new(17);
    for _ in 0..200 {
        let mut v = [0.0f32; 32];
        let magnitude = 2f32.powi(rng.below(40) as i32 - 20);
        v.iter_mut().for_each(|x| *x = rng.unit() * magnitude);
        let (packed, scale) = quantize_group(&v);
        assert_ne!(scale, 0xFF);
        let step = E8M0_TO_F32[scale as usize];
        for i in 0..32 {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
            let bound = if v[i].abs() > 6.0 * step { 2.0 } else { 1.0 } * step * 1.0001;
            assert!(
                (mxfp4_value(code, scale) - v[i]).abs() <= bound,
                "{} vs {}",
                mxfp4_value(code, scale),
                v[i]
            );
        }
    }
    assert_eq!(quantize_group(&[0.0; 32]), ([0; 16], 0));
}

/// ggml's `quantize_row_q8_0_ref` by hand: step `max|x| / 127` as F16, values rounded half away
/// from zero (so 2.5 gives 3, not the even 2), an all-zero block all zeros, and a step that F16
/// rounds (1/127 is 0x2008) while the values use the unrounded f32 step's inverse.
#[test]
fn quantize_q8_0_is_ggmls_reference_rule() {
    use mxfp4_kernels::codes::quantize_q8_0;
    let mut x = [0.0f32; 32];
    x[..6].copy_from_slice(&[127.0, -63.5, 0.5, 1.5, 2.5, -0.49]);
    let block = quantize_q8_0(&x);
    assert_eq!(u16::from_le_bytes([block[0], block[1]]), 0x3C00, "step 1.0");
    let q: Vec<i8> = block[2..].iter().map(|&b| b as i8).collect();
    assert_eq!(&q[..6], &[127, -64, 1, 2, 3, 0]);
    assert!(q[6..].iter().all(|&v| v == 0));
    assert_eq!(quantize_q8_0(&[0.0; 32]), [0u8; 34]);
    let mut y = [0.0f32; 32];
    y[0] = -1.0;
    y[1] = 0.5;
    y[2] = 0.25;
    let block = quantize_q8_0(&y);
    assert_eq!(u16::from_le_bytes([block[0], block[1]]), 0x2008);
    // 0.5 · 127 = 63.5 rounds away to 64; 0.25 · 127 = 31.75 to 32.
    assert_eq!(
        [block[2] as i8, block[3] as i8, block[4] as i8],
        [-127, 64, 32]
    );
}
