//! Packed BF16 matrices (`crate::packed`) in the exact `avx512` tier: each block decoded in
//! registers to the 32 BF16 words a BF16 row holds, widened as `exact::Bf16::block` widens a
//! BF16 row's 64 bytes, then its FMAs in its order, so every result has `matmul_bf16`'s bits.
//! An exception block (base 0) is read from the matrix's kept BF16 blocks instead. The
//! approximate tiers (`avx512-bf16`, `avx512-vnni`) run the same decode and then their BF16
//! kernel's `vdpbf16ps` on the words (`x86::bf16::Bf16`), so their results have their tiers'
//! `matmul_bf16` bits.
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
use super::bf16::as_bh;
use super::driver::{PackedGemv, RowKernel, Tile, WideGemm, drive, width};
use super::lanes::{HALF_BITS, HIGH_HALF};
use super::prefetch::{packed_l2_prefetch_offset, packed_prefetch_offset};
use super::sums::store_sums;
use crate::activations::Activations;
use crate::isa::Avx512;
use crate::packed::{
    BASE_AT, CODES_AT, PACKED_BLOCK, PACKED_BLOCK_BYTES, PackedBf16Matrix, SLOT_COLUMN,
};

/// An entry over a packed matrix, `$name`: the `vpermb` decode's kernel (through
/// `$vbmi_name`) where the CPU has avx512vbmi, else the `avx2` decode's.
///
/// Each function's safety contract: the CPU must have its target features (the token and
/// the detection say it has); `rows` must lie inside `matrix` and `out` hold `rows.len() *
/// tokens` f32 (checked by `Kernels`); `act` prepared by the caller's tier.
macro_rules! packed_entry {
    ($(#[$attr:meta])* $name:ident, $vbmi_name:ident, $features:literal, $vbmi_features:literal,
     $kernel:ident, $vbmi_kernel:ident) => {
        $(#[$attr])*
        /// # Safety
        /// As `packed_entry!` says.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name(
            _: Avx512,
            matrix: &PackedBf16Matrix<'_>,
            act: &Activations,
            rows: Range<usize>,
            out: &mut [f32],
        ) {
            if has_vbmi() {
                // SAFETY: avx512vbmi detected; the rest by this function's contract.
                unsafe { $vbmi_name(matrix, act, rows, out) };
                return;
            }
            // SAFETY: this function has the kernel's target features.
            unsafe { drive::<_, $kernel>(matrix, act, rows, out) }
        }

        #[doc = concat!("[`", stringify!($name), "`] with the `vpermb` decode.")]
        ///
        /// # Safety
        /// As `packed_entry!` says, and the CPU must have avx512vbmi.
        #[target_feature(enable = $vbmi_features)]
        unsafe fn $vbmi_name(
            matrix: &PackedBf16Matrix<'_>,
            act: &Activations,
            rows: Range<usize>,
            out: &mut [f32],
        ) {
            // SAFETY: this function has the kernel's target features.
            unsafe { drive::<_, $vbmi_kernel>(matrix, act, rows, out) }
        }
    };
}

packed_entry!(
    /// Packed BF16 rows in the exact `avx512` tier.
    matmul_packed_bf16,
    matmul_packed_bf16_vbmi,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c",
    Packed,
    PackedVbmi
);

/// Whether this CPU has avx512vbmi (`is_x86_feature_detected!` caches what it detects).
pub(crate) fn has_vbmi() -> bool {
    std::arch::is_x86_feature_detected!("avx512vbmi")
}

/// A packed row kernel: `$tables` is set up once per row block, and `$decode` gives the 32
/// words of the block at `$at` whose base byte `$b` is not 0. GEMVs run 4 rows at a time: on
/// k3-wide in a cgroup of 0.9x the model (the whole trunk packed and resident), 2 threads,
/// alternating, 4 rows 131-151 ms/token (mean of 8 steps), 8 rows 138-157, 16 rows 157-167.
///
/// `$mode` is what follows the decode: `exact` widens the words and runs the exact BF16
/// kernel's two FMAs per token on `perm32`; `dot` runs the approximate tiers' BF16 kernel's one
/// `vdpbf16ps` per token on `bf16_natural` (`x86::bf16::Bf16`), so each gives its tier's bits.
macro_rules! packed_kernel {
    ($(#[$attr:meta])* $name:ident, $features:literal, $mode:ident,
     $tables:ident = $setup:expr, |$at:ident, $b:ident, $whole:ident| $decode:expr) => {
        $(#[$attr])*
        pub(crate) struct $name;

        impl RowKernel<PackedBf16Matrix<'_>> for $name {
            type Gemv = PackedGemv;
            type Gemm = WideGemm<{ packed_kernel!(@group $mode) }>;

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
                let x = packed_kernel!(@tokens $mode, tile, act, stride, T);
                let mut next: [usize; R] = std::array::from_fn(|r| m.first_exception(row0 + r));
                let mut acc = [[_mm512_setzero_ps(); T]; R];
                let high_half = _mm512_set1_epi32(HIGH_HALF as i32);
                let $tables = $setup;
                for block in 0..blocks {
                    let pos = block * PACKED_BLOCK_BYTES;
                    let ahead = packed_prefetch_offset(R, row_bytes, pos);
                    let far = packed_l2_prefetch_offset(R, row_bytes, pos);
                    let xs = packed_kernel!(@loads $mode, x, stride, block, T);
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
                        packed_kernel!(@mac $mode, v, xs, acc[r], high_half, T);
                    }
                }
                store_sums(&acc, tile, out);
            }
        }
    };
    // The most tokens a group runs (`WideGemm`).
    (@group exact) => {
        6
    };
    (@group dot) => {
        8
    };
    // The tile's tokens: f32 as [even 16, odd 16] per 32 columns, or BF16 in column order.
    (@tokens exact, $tile:ident, $act:ident, $stride:ident, $t:ident) => {
        $tile.tokens::<$t, _>(&$act.perm32, $stride)
    };
    (@tokens dot, $tile:ident, $act:ident, $stride:ident, $t:ident) => {
        $tile.tokens::<$t, _>(&$act.bf16_natural, $stride)
    };
    // Each token's activations for the block: (even, odd) f32, or 32 BF16 words.
    (@loads exact, $x:ident, $stride:ident, $block:ident, $t:ident) => {{
        let mut even = [_mm512_setzero_ps(); $t];
        let mut odd = [_mm512_setzero_ps(); $t];
        for t in 0..$t {
            // SAFETY: t < T and 32 * block + 32 <= cols <= stride, inside the tile's tokens
            // of `perm32` (`Tile::tokens`).
            unsafe {
                even[t] = _mm512_loadu_ps($x.add(t * $stride + 32 * $block));
                odd[t] = _mm512_loadu_ps($x.add(t * $stride + 32 * $block + 16));
            }
        }
        (even, odd)
    }};
    (@loads dot, $x:ident, $stride:ident, $block:ident, $t:ident) => {{
        let mut words = [_mm512_setzero_si512(); $t];
        for (t, w) in words.iter_mut().enumerate() {
            // SAFETY: t < T and 32 * block + 32 <= cols <= stride, inside the tile's tokens
            // of `bf16_natural` (`Tile::tokens`).
            *w = unsafe { _mm512_loadu_si512($x.add(t * $stride + 32 * $block).cast()) };
        }
        words
    }};
    // The row's accumulators over the block: `exact::Bf16`'s widening and FMAs, or
    // `bf16::Bf16`'s `vdpbf16ps` (the same words and operand order).
    (@mac exact, $v:ident, $xs:ident, $acc:expr, $high_half:ident, $t:ident) => {{
        let (even, odd) = &$xs;
        let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<HALF_BITS>($v));
        let w_odd = _mm512_castsi512_ps(_mm512_and_si512($v, $high_half));
        for t in 0..$t {
            $acc[t] = _mm512_fmadd_ps(w_even, even[t], $acc[t]);
            $acc[t] = _mm512_fmadd_ps(w_odd, odd[t], $acc[t]);
        }
    }};
    (@mac dot, $v:ident, $xs:ident, $acc:expr, $high_half:ident, $t:ident) => {{
        let _ = $high_half;
        for t in 0..$t {
            $acc[t] = _mm512_dpbf16_ps($acc[t], as_bh($v), as_bh($xs[t]));
        }
    }};
}

/// The `avx2` decode's two 16-word halves of the block at `at`, joined: its 32 words in
/// column order.
///
/// # Safety
/// The block's 49 bytes from `at` must be readable (a whole block, its base not 0).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode_joined(at: *const u8, offsets: (__m256i, __m256i)) -> __m512i {
    // SAFETY: by this function's contract.
    let (first, second) = unsafe { decode_words(at, offsets.0, offsets.1) };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
}

packed_kernel!(
    /// The packed row kernel with the `avx2` decode.
    Packed,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    exact,
    offsets = tables(),
    |at, _b, _whole| {
        // SAFETY: `at` is a whole block (above).
        unsafe { decode_joined(at, offsets) }
    }
);

packed_kernel!(
    /// The packed row kernel with the `vpermb` decode.
    PackedVbmi,
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c",
    exact,
    t = vbmi_tables(),
    |at, b, whole| {
        // SAFETY: `at` is a whole block and `b` its base, not 0 (above); where `whole`, 64
        // bytes from `at` lie in the body.
        unsafe { decode_words_vbmi(at, b, whole, t) }
    }
);

packed_kernel!(
    /// The approximate tiers' packed row kernel with the `avx2` decode: `vdpbf16ps`.
    PackedDot,
    "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c",
    dot,
    offsets = tables(),
    |at, _b, _whole| {
        // SAFETY: `at` is a whole block (above).
        unsafe { decode_joined(at, offsets) }
    }
);

packed_kernel!(
    /// The approximate tiers' packed row kernel with the `vpermb` decode: `vdpbf16ps`.
    PackedDotVbmi,
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c",
    dot,
    t = vbmi_tables(),
    |at, b, whole| {
        // SAFETY: `at` is a whole block and `b` its base, not 0 (above); where `whole`, 64
        // bytes from `at` lie in the body.
        unsafe { decode_words_vbmi(at, b, whole, t) }
    }
);

packed_entry!(
    /// Packed BF16 rows in the approximate tiers (`avx512-bf16`, `avx512-vnni`), decoded in
    /// registers as in `avx512` and multiplied as those tiers multiply BF16 rows (`vdpbf16ps` on
    /// the activations rounded to BF16, `bf16_natural`): `matmul_bf16`'s bits in those tiers.
    /// Before, their packed rows were decoded into a buffer and read again
    /// (`Kernels::packed_via_bf16`).
    matmul_packed_bf16_dot,
    matmul_packed_bf16_dot_vbmi,
    "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c",
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c",
    PackedDot,
    PackedDotVbmi
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
mod tests;
