//! E2M1 element codes and E8M0 block scales, with OCP MX v1.0 semantics.

/// E2M1 value of each 4-bit code: bit 3 is the sign, bits 2..0 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
/// Code 8 is -0.0 (kept as -0.0, which compares equal to 0).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 codes doubled, as exact signed integers (ggml's `kvalues_mxfp4`).
pub const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The E8M0 byte that means NaN; validation rejects it.
pub const E8M0_NAN: u8 = 0xFF;

/// Decodes an E8M0 scale byte: `s` in 1..=254 is 2^(s-127), 0 is 2^-127 (an f32 subnormal,
/// so the plain `s << 23` trick is wrong for it) and 0xFF is NaN.
#[inline]
pub const fn e8m0_to_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000), // 2^-127: mantissa bit 22 of a subnormal
        E8M0_NAN => f32::NAN,
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// `e8m0_to_f32` for every byte, built at compile time; kernels index it instead of branching.
pub static E8M0_TO_F32: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        table[s] = e8m0_to_f32(s as u8);
        s += 1;
    }
    table
};

/// Exact value of one MXFP4 element.
#[inline]
pub fn mxfp4_value(code: u8, scale: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize] * E8M0_TO_F32[scale as usize]
}

/// Rounds an f32 to BF16 (round to nearest, ties to even; NaN stays a quiet NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Widens a BF16 bit pattern to f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Quantises 32 values to MXFP4 the way compressed-tensors does: the E8M0 scale is
/// `2^(floor(log2(max|x|)) - 2)` (E2M1's largest magnitude 6 is about 2^2), clamped to the
/// valid bytes 0..=254; each value becomes the nearest E2M1 code of `x / scale` (ties to the
/// even code, magnitudes above 6 saturate). An all-zero group gets scale byte 0 and codes 0.
/// Returns the 16 packed bytes (low nibble = even element) and the scale byte.
pub fn quantize_group(values: &[f32; 32]) -> ([u8; 16], u8) {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale_byte = if amax > 0.0 && amax.is_finite() {
        (amax.log2().floor() as i32 - 2 + 127).clamp(0, 254) as u8
    } else {
        0
    };
    let scale = E8M0_TO_F32[scale_byte as usize];
    let mut packed = [0u8; 16];
    for (i, &v) in values.iter().enumerate() {
        let code = nearest_e2m1(v / scale);
        packed[i / 2] |= code << (4 * (i % 2));
    }
    (packed, scale_byte)
}

/// Weights per Q8_0 block (ggml's `QK8_0`).
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: the F16 step, then 32 int8 values (ggml's `block_q8_0`).
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// Quantises 32 values to one ggml `block_q8_0` the way ggml's `quantize_row_q8_0_ref` does,
/// so a matrix quantised here holds llama.cpp's Q8_0 bytes: the step `d = max|x| / 127` is
/// stored as F16 (round to nearest even), and each value becomes `round(x · (1/d))` (ties away
/// from zero; `1/d` from the f32 step, before its rounding to F16). An all-zero block gets
/// step 0 and values 0. Returns the block: the step's two bytes (little-endian), then the
/// values.
pub fn quantize_q8_0(values: &[f32; Q8_0_BLOCK]) -> [u8; Q8_0_BLOCK_BYTES] {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut block = [0u8; Q8_0_BLOCK_BYTES];
    block[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (q, &v) in block[2..].iter_mut().zip(values) {
        // `as` saturates; |v · (1/d)| rounds to at most 127 (one ulp above 127 at most).
        *q = ((v * inverse).round() as i8) as u8;
    }
    block
}

/// The E2M1 code nearest to `x` (ties to the code with an even mantissa bit), saturating.
fn nearest_e2m1(x: f32) -> u8 {
    let magnitude = x.abs();
    let mut best = 0usize;
    for (code, value) in E2M1_VALUES.iter().enumerate().take(8).skip(1) {
        let d_best = (E2M1_VALUES[best] - magnitude).abs();
        let d = (value - magnitude).abs();
        if d < d_best || (d == d_best && code % 2 == 0) {
            best = code;
        }
    }
    let sign = if x.is_sign_negative() && best != 0 {
        8
    } else {
        0
    };
    best as u8 | sign
}

/// Widens an IEEE binary16 (F16) bit pattern to f32 (exact: every F16 value, subnormals
/// included, is an f32; NaN payloads are kept in the high mantissa bits).
#[inline]
pub const fn f16_to_f32(h: u16) -> f32 {
    // `as` rather than `u32::from`, which is not const.
    let sign = ((h >> 15) as u32) << 31;
    let exponent = ((h >> 10) & 0x1F) as u32;
    let mantissa = (h & 0x3FF) as u32;
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        // Subnormal: mantissa x 2^-24, exact in f32.
        (0, m) => {
            let magnitude = (m as f32) * (1.0 / (1u32 << 24) as f32);
            return if sign != 0 { -magnitude } else { magnitude };
        }
        (0x1F, m) => sign | 0x7F80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// `f16_to_f32` of every F16 bit pattern (256 KiB), built at compile time. The SIMD Q8_0
/// kernels look a block's step up here and broadcast it straight from memory into their FMA
/// (`vfmadd231ps m32{1to16}`): no conversion instruction per row and block. A matrix's steps
/// span a few binades, so the entries it touches stay in L1/L2.
pub(crate) static F16_TO_F32: [f32; 1 << 16] = {
    let mut table = [0.0f32; 1 << 16];
    let mut h = 0;
    while h < table.len() {
        table[h] = f16_to_f32(h as u16);
        h += 1;
    }
    table
};

/// Rounds an f32 to IEEE binary16 (round to nearest, ties to even; overflow to infinity,
/// NaN stays a quiet NaN).
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return sign | 0x7E00;
    }
    // 65520 and up (half-way past the largest F16, 65504, with an odd mantissa) round to inf.
    if abs >= 0x477F_F000 {
        return sign | 0x7C00;
    }
    if abs >= 0x3880_0000 {
        // Normal (2^-14 and up): 23 mantissa bits to 10, ties to even; a carry moves into the
        // exponent, which is the right result.
        let exponent = (abs >> 23) + 15 - 127;
        let mantissa = abs & 0x7F_FFFF;
        let kept = mantissa >> 13;
        let rest = mantissa & 0x1FFF;
        let mut h = (exponent << 10) | kept;
        if rest > 0x1000 || (rest == 0x1000 && kept & 1 == 1) {
            h += 1;
        }
        return sign | h as u16;
    }
    // Subnormal or zero: a multiple of 2^-24 (f64 holds the product exactly).
    let units = (f64::from(f32::from_bits(abs)) * f64::from(1u32 << 24)).round_ties_even();
    sign | units as u16
}
