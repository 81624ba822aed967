//! The packed kernels against the BF16 kernels, bit for bit.

use k3_testkit::Rng;

use super::*;
use crate::packed::PackedBf16;
use crate::view::Bf16Matrix;
use crate::{Kernels, Tier};

fn avx512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

/// `vpermb`'s decode gives the `avx2` decode's 32 words for every base byte and random
/// sign/mantissa and code bytes (every code, the high exponents that reach 255 included).
#[test]
fn vbmi_decode_gives_the_avx2_decodes_words() {
    if !(avx512() && has_vbmi()) {
        eprintln!("note: no avx512vbmi here; its decode is not tested");
        return;
    }
    let mut rng = Rng::new(7);
    let mut block = [0u8; 64];
    for base in 1..=255u8 {
        for _ in 0..64 {
            for b in &mut block {
                *b = rng.next_u64() as u8;
            }
            block[BASE_AT] = base;
            // SAFETY: avx512f/bw/vl and vbmi were detected (which imply avx2, fma and
            // f16c); `block` is 49 readable bytes.
            let (got, want) = unsafe {
                let (offsets, not_first) = tables();
                let (first, second) = decode_words(block.as_ptr(), offsets, not_first);
                (
                    [false, true].map(|whole| {
                        std::mem::transmute::<__m512i, [u16; 32]>(decode_words_vbmi(
                            block.as_ptr(),
                            base,
                            whole,
                            vbmi_tables(),
                        ))
                    }),
                    std::mem::transmute::<[__m256i; 2], [u16; 32]>([first, second]),
                )
            };
            // A whole 64-byte load sees the 15 bytes after the block, which never count.
            assert_eq!(got, [want; 2], "base {base}, block {block:?}");
        }
    }
}

/// Runs the `avx2` decode's or the `vpermb` decode's kernel over `rows` of `m` for `act`'s
/// tokens: the exact one, or with `dot` the approximate tiers' (`vdpbf16ps`).
///
/// # Safety
/// avx512f/bw/vl, avx512vbmi where `vbmi`, avx512bf16 where `dot`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn run(
    (vbmi, dot): (bool, bool),
    m: &PackedBf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: by this function's contract (each callee's features).
    unsafe {
        match (vbmi, dot) {
            (true, false) => matmul_packed_bf16_vbmi(m, act, rows, out),
            (false, false) => drive::<_, Packed>(m, act, rows, out),
            (true, true) => matmul_packed_bf16_dot_vbmi(m, act, rows, out),
            (false, true) => run_dot(m, act, rows, out),
        }
    }
}

/// # Safety
/// avx512f/bw/vl and avx512bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn run_dot(m: &PackedBf16Matrix<'_>, act: &Activations, r: Range<usize>, o: &mut [f32]) {
    // SAFETY: this function has `PackedDot`'s target features.
    unsafe { drive::<_, PackedDot>(m, act, r, o) }
}

/// Both decodes' kernels give the BF16 kernel's bits, the exact ones `avx512`'s and the
/// `vdpbf16ps` ones `avx512-bf16`'s (where the CPU has it): compiled widths and others,
/// 1-6 tokens, row ranges with tails, exception blocks (every seventh block spans 40
/// exponents), zeros, subnormals, and in every third row blocks of exponents up to 254
/// (sums that overflow).
/// Not exponent 255: which NaN payload an FMA of two NaNs keeps depends on the operand
/// order the compiler picks for each kernel, not on the decode; the decode test above
/// covers those words.
#[test]
fn both_decodes_have_the_bf16_kernels_bits() {
    if !avx512() {
        eprintln!("note: no avx512 here; its packed kernels are not tested");
        return;
    }
    let mut tiers = vec![(Kernels::new(Tier::Avx512).unwrap(), false)];
    tiers.extend(Kernels::new(Tier::Avx512Bf16).ok().map(|k| (k, true)));
    let mut rng = Rng::new(11);
    for (rows, cols) in [(13, 512), (9, 1536), (6, 320), (5, 7168)] {
        let bf16: Vec<u8> = (0..rows * cols)
            .flat_map(|i| {
                let r = rng.next_u64() as u16;
                let e = match ((i / 32) % 7, r % 53) {
                    (6, _) => 90 + (r >> 10) % 40,
                    (5, _) if (i / cols) % 3 == 0 => 240 + (r >> 10) % 15,
                    (_, 0) => 0,
                    _ => 115 + (r >> 10) % 9,
                };
                ((r & 0x807F) | (e << 7)).to_le_bytes()
            })
            .collect();
        let packed = PackedBf16::pack(&bf16, rows, cols).unwrap();
        assert!(packed.exception_count() > 0, "the test has exceptions");
        let (m, b) = (packed.view(), Bf16Matrix::new(&bf16, rows, cols).unwrap());
        for tokens in 1..=6 {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
                .collect();
            for (k, dot) in &tiers {
                let act = k.prepare(&x, cols).unwrap();
                for range in [0..rows, 1..rows, rows - 1..rows] {
                    let mut want = vec![0f32; range.len() * tokens];
                    k.matmul_bf16(&b, &act, range.clone(), &mut want).unwrap();
                    for vbmi in [false, true] {
                        if vbmi && !has_vbmi() {
                            continue;
                        }
                        let mut got = vec![f32::NAN; range.len() * tokens];
                        // SAFETY: avx512f/bw/vl detected, vbmi where asked, avx512bf16
                        // where `dot` (its tier was available); the range lies in the
                        // matrix and `got` holds its rows for every token.
                        unsafe { run((vbmi, *dot), &m, &act, range.clone(), &mut got) };
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{}, vbmi {vbmi}, [{rows}x{cols}] rows {range:?}, {tokens} tokens",
                            k.tier()
                        );
                    }
                }
            }
        }
    }
}

/// The `vpermb` row decode gives the portable decode's bytes (`check_row_decode`).
#[test]
fn vbmi_row_decode_gives_the_bf16_bytes() {
    if !(avx512() && has_vbmi()) {
        eprintln!("note: no avx512vbmi here; its row decode is not tested");
        return;
    }
    // SAFETY: avx512f/bw/vl and avx512vbmi were detected above.
    crate::x86::avx2::packed::tests::check_row_decode(|m, rows, out| unsafe {
        decode_rows_bf16_vbmi(m, rows, out)
    });
}
