//! Packed BF16 matrices (`crate::packed`) in the exact `avx512` tier: each block decoded in
//! registers to the 32 BF16 words a BF16 row holds, widened as `exact::Bf16::block` widens a
//! BF16 row's 64 bytes, then its FMAs in its order, so every result has `matmul_bf16`'s bits.
//! An exception block (base 0) is read from the matrix's kept BF16 blocks instead.
//!
//! Two decodes, picked once per CPU: with avx512vbmi (`vpermb`; Ice Lake, Zen 4 and later)
//! [`decode_words_vbmi`], else the `avx2` decode's two 16-word halves, joined. Without any
//! packed kernel this tier decoded a few rows at a time into a buffer and ran the BF16 kernel
//! over it (`Kernels::packed_via_bf16`): on k3-wide at half the model's size in memory, where
//! most of the trunk is packed, that made a token's compute 2.3 s (PERFORMANCE.md, phase 16).
//!
//! A GEMV's memory stream: each row prefetches `PREFETCH_PACKED` bytes ahead of itself and,
//! near its end, into the same row of the next row block (`prefetch::packed_prefetch_offset`),
//! and into L2 4 KB farther (`packed_l2_prefetch_offset`).
//! The row block's one sequential stream (`prefetch::prefetch_step`, which the `avx2` packed
//! kernel keeps) read at 43-50% of the read probe at one thread on Zen 4 where this reads at
//! 56-66%, and at two threads 48-63% against 74-82% (PERFORMANCE.md, phase 29).

use core::arch::x86_64::*;
use std::ops::Range;

use super::avx2::packed::{decode_rows_with, decode_words, tables};
use super::driver::{PackedGemv, RowKernel, Tile, WideGemm, drive, width};
use super::lanes::{HALF_BITS, HIGH_HALF};
use super::prefetch::{packed_l2_prefetch_offset, packed_prefetch_offset};
use super::sums::store_sums;
use crate::activations::Activations;
use crate::isa::Avx512;
use crate::packed::{
    BASE_AT, CODES_AT, PACKED_BLOCK, PACKED_BLOCK_BYTES, PackedBf16Matrix, SLOT_COLUMN,
};

/// # Safety
/// The CPU must have avx512f/bw/vl (the token says it has; they imply avx2, fma and f16c);
/// `rows` must lie inside `matrix` and `out` hold `rows.len() * tokens` f32 (checked by
/// `Kernels`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_packed_bf16(
    _: Avx512,
    matrix: &PackedBf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    if has_vbmi() {
        // SAFETY: avx512vbmi detected; the rest by this function's contract.
        unsafe { matmul_packed_bf16_vbmi(matrix, act, rows, out) };
        return;
    }
    // SAFETY: this function has `Packed`'s target features.
    unsafe { drive::<_, Packed>(matrix, act, rows, out) }
}

/// [`matmul_packed_bf16`] with the `vpermb` decode.
///
/// # Safety
/// As [`matmul_packed_bf16`], and the CPU must have avx512vbmi.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn matmul_packed_bf16_vbmi(
    matrix: &PackedBf16Matrix<'_>,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: this function has `PackedVbmi`'s target features.
    unsafe { drive::<_, PackedVbmi>(matrix, act, rows, out) }
}

/// Whether this CPU has avx512vbmi (`is_x86_feature_detected!` caches what it detects).
pub(crate) fn has_vbmi() -> bool {
    std::arch::is_x86_feature_detected!("avx512vbmi")
}

/// A packed row kernel: `$tables` is set up once per row block, and `$decode` gives the 32
/// words of the block at `$at` whose base byte `$b` is not 0. GEMVs run 4 rows at a time: on
/// k3-wide in a cgroup of 0.9x the model (the whole trunk packed and resident), 2 threads,
/// alternating, 4 rows 131-151 ms/token (mean of 8 steps), 8 rows 138-157, 16 rows 157-167.
macro_rules! packed_kernel {
    ($(#[$attr:meta])* $name:ident, $features:literal, $tables:ident = $setup:expr, |$at:ident, $b:ident, $whole:ident| $decode:expr) => {
        $(#[$attr])*
        pub(crate) struct $name;

        impl RowKernel<PackedBf16Matrix<'_>> for $name {
            type Gemv = PackedGemv;
            type Gemm = WideGemm;

            #[target_feature(enable = $features)]
            #[inline]
            #[allow(clippy::needless_range_loop)] // r and t index loads and accumulators alike
            unsafe fn block<const R: usize, const T: usize, const C: usize>(
                m: &PackedBf16Matrix<'_>,
                act: &Activations,
                tile: Tile,
                out: &mut [f32],
            ) {
                let row0 = tile.row0;
                assert!(row0 + R <= m.rows());
                let stride = act.padded();
                let cols = width::<C>(m.cols());
                let blocks = cols / 32;
                let row_bytes = blocks * PACKED_BLOCK_BYTES;
                let body = &m.body()[row0 * row_bytes..(row0 + R) * row_bytes];
                let base = body.as_ptr();
                // Whether a whole 64-byte load from any of the tile's blocks stays inside the
                // body (every tile but the matrix's last): then no block needs the mask.
                let $whole = m.body().len() >= (row0 + R) * row_bytes + (64 - PACKED_BLOCK_BYTES);
                let x = tile.tokens::<T, _>(&act.perm32, stride);
                let mut next: [usize; R] = std::array::from_fn(|r| m.first_exception(row0 + r));
                let mut acc = [[_mm512_setzero_ps(); T]; R];
                let high_half = _mm512_set1_epi32(HIGH_HALF as i32);
                let $tables = $setup;
                for block in 0..blocks {
                    let pos = block * PACKED_BLOCK_BYTES;
                    let ahead = packed_prefetch_offset(R, row_bytes, pos);
                    let far = packed_l2_prefetch_offset(R, row_bytes, pos);
                    let mut even = [_mm512_setzero_ps(); T];
                    let mut odd = [_mm512_setzero_ps(); T];
                    for t in 0..T {
                        // SAFETY: t < T and 32 * block + 32 <= cols <= stride, inside the tile's
                        // tokens of `perm32` (`Tile::tokens`).
                        unsafe {
                            even[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block));
                            odd[t] = _mm512_loadu_ps(x.add(t * stride + 32 * block + 16));
                        }
                    }
                    for r in 0..R {
                        let at = r * row_bytes + block * PACKED_BLOCK_BYTES;
                        // Prefetch hint only: it never faults, so an address past the matrix
                        // is harmless.
                        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(at + ahead).cast());
                        _mm_prefetch::<_MM_HINT_T2>(base.wrapping_add(at + far).cast());
                        // SAFETY: at + BASE_AT < R * row_bytes = body.len().
                        let $b = unsafe { *base.add(at + BASE_AT) };
                        let v = if $b != 0 {
                            // SAFETY: the block's 49 bytes lie in `body` (`at + 49 <= R *
                            // row_bytes`).
                            let $at = unsafe { base.add(at) };
                            $decode
                        } else {
                            let raw = exception(m, row0 + r, &mut next[r]);
                            // SAFETY: `raw` is 64 bytes, 32 BF16 values.
                            unsafe { _mm512_loadu_si512(raw.as_ptr().cast()) }
                        };
                        let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<HALF_BITS>(v));
                        let w_odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
                        for t in 0..T {
                            acc[r][t] = _mm512_fmadd_ps(w_even, even[t], acc[r][t]);
                            acc[r][t] = _mm512_fmadd_ps(w_odd, odd[t], acc[r][t]);
                        }
                    }
                }
                store_sums(&acc, tile, out);
            }
        }
    };
}

packed_kernel!(
    /// The packed row kernel with the `avx2` decode.
    Packed,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    offsets = tables(),
    |at, _b, _whole| {
        // SAFETY: `at` is a whole block (above).
        let (first, second) = unsafe { decode_words(at, offsets.0, offsets.1) };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
    }
);

packed_kernel!(
    /// The packed row kernel with the `vpermb` decode.
    PackedVbmi,
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c",
    t = vbmi_tables(),
    |at, b, whole| {
        // SAFETY: `at` is a whole block and `b` its base, not 0 (above); where `whole`, 64
        // bytes from `at` lie in the body.
        unsafe { decode_words_vbmi(at, b, whole, t) }
    }
);

/// Rows `rows` of `m` as little-endian BF16 bytes (`rows.len() * cols * 2`), exactly, with
/// the `vpermb` decode: what `avx2::packed::decode_rows_bf16` gives, for the GEMMs of many
/// tokens that run over decoded rows (`Kernels::packed_via_bf16`). The `avx2` decode's two
/// halves ran at ~3.6 G weights/s per core in a 64-token prefill of the k3-wide slice on Zen 4
/// and made it 0.88x the stored trunk's tokens/s (PERFORMANCE.md, phase 30).
///
/// # Safety
/// The CPU must have avx512f/bw/vl and avx512vbmi.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
pub(crate) unsafe fn decode_rows_bf16_vbmi(
    m: &PackedBf16Matrix<'_>,
    rows: Range<usize>,
    out: &mut [u8],
) {
    let t = vbmi_tables();
    let body_len = m.body().len();
    decode_rows_with(m, rows, out, |block, at, d| {
        // Whether 64 bytes from the block lie in the body (all but the last blocks).
        let whole = at + 64 <= body_len;
        // SAFETY: `block` is the block's 49 bytes of the body, and 64 where `whole`; its base
        // is not 0; `d` is 64 writable bytes.
        unsafe {
            let v = decode_words_vbmi(block.as_ptr(), block[BASE_AT], whole, t);
            _mm512_storeu_si512(d.as_mut_ptr().cast(), v);
        }
    });
}

/// An exception block's 64 bytes, out of the hot loop.
#[cold]
#[inline(never)]
fn exception<'a>(m: &PackedBf16Matrix<'a>, row: usize, next: &mut usize) -> &'a [u8] {
    m.take_exception(row, next)
}

/// The bytes of a block a 64-byte masked load takes: the other 15 are never read, so the last
/// block of a body needs nothing past it.
const BLOCK_MASK: u64 = (1 << PACKED_BLOCK_BYTES) - 1;

#[repr(C, align(64))]
struct ExponentWords([[u16; 32]; 256]);

/// For each base byte `b`, the exponent of each code already in place in a word (bits 14..7):
/// code 0 is exponent 0, code `c` is `b + c - 1` (the packer keeps every block's exponents
/// within `b..b + 15`, so the sum is an exponent; base 0 marks an exception, whose row is
/// never used). The 16 codes' words are repeated, so one `vpermw` (which reads bits 4..0 of
/// each index word: the code and one bit the repeat ignores) gives each word its exponent
/// field.
static EXPONENT_WORDS: ExponentWords = {
    let mut t = [[0u16; 32]; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 32 {
            let c = i % 16;
            if c != 0 {
                t[b][i] = ((b + c - 1) as u8 as u16) << 7;
            }
            i += 1;
        }
        b += 1;
    }
    ExponentWords(t)
};

/// `vpermb` indices: word `j` (column `j`) takes its slot's sign/mantissa byte into both of its
/// bytes (`SLOT_COLUMN` is its own inverse: the slot of column `j` is `SLOT_COLUMN[j]`).
const SM_INDEX: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < PACKED_BLOCK {
        t[2 * j] = SLOT_COLUMN[j] as u8;
        t[2 * j + 1] = SLOT_COLUMN[j] as u8;
        j += 1;
    }
    t
};

/// `vpermb` indices: word `j` takes the code byte that holds its slot's code (slot `s`'s is
/// byte `s % 16`: the low nibble for slots 0..16, the high one for 16..32).
const CODE_INDEX: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < PACKED_BLOCK {
        let byte = (CODES_AT + SLOT_COLUMN[j] % 16) as u8;
        t[2 * j] = byte;
        t[2 * j + 1] = byte;
        j += 1;
    }
    t
};

/// Word `j`'s right shift that brings its code to bits 3..0.
const CODE_SHIFT: [u16; 32] = {
    let mut t = [0u16; 32];
    let mut j = 0;
    while j < PACKED_BLOCK {
        t[j] = if SLOT_COLUMN[j] < 16 { 0 } else { 4 };
        j += 1;
    }
    t
};

/// The `vpermb` decode's constant vectors.
#[derive(Clone, Copy)]
struct VbmiTables {
    sm: __m512i,
    code: __m512i,
    shift: __m512i,
    /// Per word, the exponent's bits 14..7 (the rest is the sign/mantissa byte's).
    exponent_bits: __m512i,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
#[inline]
fn vbmi_tables() -> VbmiTables {
    // SAFETY: each table is 64 bytes.
    unsafe {
        VbmiTables {
            sm: _mm512_loadu_si512(SM_INDEX.as_ptr().cast()),
            code: _mm512_loadu_si512(CODE_INDEX.as_ptr().cast()),
            shift: _mm512_loadu_si512(CODE_SHIFT.as_ptr().cast()),
            exponent_bits: _mm512_set1_epi16(0x7F80),
        }
    }
}

/// One packed block's 32 BF16 words in column order (what [`decode_words`]' halves joined
/// give) with `vpermb`: word `j` gathers its slot's sign/mantissa byte (into both of its
/// bytes) and its code byte; the code is shifted to bits 3..0 and looked up with `vpermw` in
/// the base's row of exponent words (`EXPONENT_WORDS`: the exponent already in bits 14..7;
/// `vpermw` reads bits 4..0 of an index and the row is duplicated, so the bits above the code
/// do not matter); one bit-select then takes the exponent's bits 14..7 from the lookup, the
/// sign (bit 15) and the mantissa (bits 6..0) from the doubled byte. Six vector operations
/// after the load. On Zen 4 (256-bit units) the earlier `vpermb` lookup and shift by 7, a
/// 16-byte row broadcast per block and a masked load (its mask register set from a general
/// one every row) held the kernel to 14.5 G weights/s in L2, 20.2 now (PERFORMANCE.md,
/// phase 29).
///
/// # Safety
/// The block's 49 bytes from `at` must be readable, and where `whole` 64 bytes; `base` is its
/// base byte, not 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
#[inline]
unsafe fn decode_words_vbmi(at: *const u8, base: u8, whole: bool, t: VbmiTables) -> __m512i {
    // SAFETY: where `whole` 64 bytes from `at` are readable, else the masked load reads the
    // block's 49 bytes only (readable, by the caller); an exponent row is 64 bytes.
    let (block, exponents) = unsafe {
        (
            if whole {
                _mm512_loadu_si512(at.cast())
            } else {
                _mm512_maskz_loadu_epi8(BLOCK_MASK, at.cast())
            },
            _mm512_load_si512(EXPONENT_WORDS.0[base as usize].as_ptr().cast()),
        )
    };
    let sm = _mm512_permutexvar_epi8(t.sm, block);
    let code = _mm512_srlv_epi16(_mm512_permutexvar_epi8(t.code, block), t.shift);
    let exponent = _mm512_permutexvar_epi16(code, exponents);
    // Bit-select (imm 0xCA: a ? b : c) with the exponent's bits as the selector.
    _mm512_ternarylogic_epi32::<0xCA>(t.exponent_bits, exponent, sm)
}

#[cfg(test)]
mod tests {
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

    /// Runs the `avx2` decode's or the `vpermb` decode's kernel over `rows` of `m` for `act`'s tokens.
    ///
    /// # Safety
    /// avx512f/bw/vl, and avx512vbmi where `vbmi`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn run(
        vbmi: bool,
        m: &PackedBf16Matrix<'_>,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        if vbmi {
            // SAFETY: by this function's contract.
            unsafe { matmul_packed_bf16_vbmi(m, act, rows, out) };
        } else {
            // SAFETY: by this function's contract.
            unsafe { drive::<_, Packed>(m, act, rows, out) };
        }
    }

    /// Both decodes' kernels give the exact BF16 kernel's bits: compiled widths and others,
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
        let k = Kernels::new(Tier::Avx512).unwrap();
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
                let act = k.prepare(&x, cols).unwrap();
                for range in [0..rows, 1..rows, rows - 1..rows] {
                    let mut want = vec![0f32; range.len() * tokens];
                    k.matmul_bf16(&b, &act, range.clone(), &mut want).unwrap();
                    for vbmi in [false, true] {
                        if vbmi && !has_vbmi() {
                            continue;
                        }
                        let mut got = vec![f32::NAN; range.len() * tokens];
                        // SAFETY: avx512f/bw/vl detected, vbmi where asked; the range lies in
                        // the matrix and `got` holds its rows for every token.
                        unsafe { run(vbmi, &m, &act, range.clone(), &mut got) };
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "vbmi {vbmi}, [{rows}x{cols}] rows {range:?}, {tokens} tokens"
                        );
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
}
