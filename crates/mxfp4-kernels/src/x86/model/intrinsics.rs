//! The AVX-512 intrinsics the modelled kernels use, emulated on plain arrays as Intel documents them; memory reads are bounds-checked.

use crate::x86::lanes::byte_mask64;

/// 16 dword lanes (a `__m512` or `__m512i`) as bit patterns.
pub(super) type Lanes = [u32; 16];

/// One byte of memory; a read outside `mem` is a bug the hardware might not report.
pub(super) fn byte(mem: &[u8], at: usize) -> u8 {
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
pub(super) fn maskz_loadu_epi8(mem: &[u8], at: usize, k: u64) -> [u8; 64] {
    core::array::from_fn(|i| {
        if (k >> i) & 1 == 1 {
            byte(mem, at + i)
        } else {
            0
        }
    })
}

/// `_mm512_maskz_loadu_ps(k, p)`: dword `i` is loaded where bit `i` of `k` is set.
pub(super) fn maskz_loadu_ps(mem: &[u8], at: usize, k: u16) -> [u8; 64] {
    core::array::from_fn(|i| {
        if (k >> (i / 4)) & 1 == 1 {
            byte(mem, at + i)
        } else {
            0
        }
    })
}

/// A 64-byte register read as 16 little-endian dwords.
pub(super) fn dwords(v: [u8; 64]) -> Lanes {
    core::array::from_fn(|i| {
        u32::from_le_bytes([v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]])
    })
}

/// `loads::load_bytes64`: 64 bytes, or the first `n < 64` (the rest zero).
pub(super) fn load_bytes64(mem: &[u8], at: usize, n: usize) -> [u8; 64] {
    if n >= 64 {
        maskz_loadu_epi8(mem, at, u64::MAX)
    } else {
        maskz_loadu_epi8(mem, at, byte_mask64(n))
    }
}

/// `_mm512_permutex2var_ps(a, idx, b)`: lane `i` is `(idx[i] bit 4 ? b : a)[idx[i] & 15]`
/// (`vpermt2ps`/`vpermi2ps`; higher index bits are ignored).
pub(super) fn permutex2var_ps(a: Lanes, idx: &[i32; 16], b: Lanes) -> Lanes {
    core::array::from_fn(|i| {
        let j = idx[i] as u32;
        let source = if j & 16 != 0 { &b } else { &a };
        source[(j & 15) as usize]
    })
}

/// `_mm512_slli_epi32::<N>` (N < 32).
pub(super) fn slli(v: Lanes, n: u32) -> Lanes {
    v.map(|x| x << n)
}

/// `_mm512_srli_epi32::<N>` (N < 32), a logical shift.
pub(super) fn srli(v: Lanes, n: u32) -> Lanes {
    v.map(|x| x >> n)
}

/// `_mm512_and_si512` with a broadcast dword.
pub(super) fn and(v: Lanes, m: u32) -> Lanes {
    v.map(|x| x & m)
}

/// `_mm512_cvtepi32_epi16` (`vpmovdw`): each dword truncated to its low word.
pub(super) fn cvtepi32_epi16(v: Lanes) -> [u16; 16] {
    v.map(|x| x as u16)
}

/// `_mm512_cvtph_ps` (`vcvtph2ps`): each binary16 widened exactly (subnormals included, no
/// DAZ); a NaN keeps its payload and becomes quiet. Written independently of `codes`.
pub(super) fn cvtph_ps(h: [u16; 16]) -> Lanes {
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

/// `_mm512_fmadd_ps(a, b, c)`: `a * b + c` rounded once, per lane.
pub(super) fn fmadd(a: Lanes, b: Lanes, c: Lanes) -> Lanes {
    core::array::from_fn(|i| {
        f32::from_bits(a[i])
            .mul_add(f32::from_bits(b[i]), f32::from_bits(c[i]))
            .to_bits()
    })
}

/// `_mm512_add_ps`.
pub(super) fn add(a: Lanes, b: Lanes) -> Lanes {
    core::array::from_fn(|i| (f32::from_bits(a[i]) + f32::from_bits(b[i])).to_bits())
}

/// `_mm512_shuffle_f32x4::<IMM>(a, b)` (`vshuff32x4`): 128-bit blocks 0, 1 of the result are
/// blocks `imm[1:0]`, `imm[3:2]` of `a`; blocks 2, 3 are blocks `imm[5:4]`, `imm[7:6]` of `b`.
pub(super) fn shuffle_f32x4(a: Lanes, b: Lanes, imm: i32) -> Lanes {
    core::array::from_fn(|i| {
        let block = i / 4;
        let pick = ((imm >> (2 * block)) & 3) as usize;
        let source = if block < 2 { &a } else { &b };
        source[4 * pick + i % 4]
    })
}

/// `_mm512_shuffle_ps::<IMM>(a, b)` (`vshufps`): in each 128-bit block, lanes 0, 1 are lanes
/// `imm[1:0]`, `imm[3:2]` of `a`'s block, lanes 2, 3 lanes `imm[5:4]`, `imm[7:6]` of `b`'s.
pub(super) fn shuffle_ps(a: Lanes, b: Lanes, imm: i32) -> Lanes {
    core::array::from_fn(|i| {
        let (block, lane) = (i / 4, i % 4);
        let pick = ((imm >> (2 * lane)) & 3) as usize;
        let source = if lane < 2 { &a } else { &b };
        source[4 * block + pick]
    })
}

/// `_mm512_unpacklo_pd` (`high` false) / `_mm512_unpackhi_pd` on f32 lanes: in each 128-bit
/// block, the low (high) qword of `a` then the low (high) qword of `b`.
pub(super) fn unpack_pd(a: Lanes, b: Lanes, high: bool) -> Lanes {
    let q = if high { 2 } else { 0 };
    core::array::from_fn(|i| {
        let (block, lane) = (i / 4, i % 4);
        let source = if lane < 2 { &a } else { &b };
        source[4 * block + q + lane % 2]
    })
}
