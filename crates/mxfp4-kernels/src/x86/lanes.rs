//! Lane constants and address arithmetic of the BF16, F16 and F32 row kernels, in one place so
//! the kernels and their portable model (`x86::model`, tests only) use the same values: the
//! model emulates each instruction on arrays and checks that every format's loader pairs each
//! weight with its own column's activation, on CPUs without AVX-512.
//!
//! Layout of one 32-column block: 16-bit formats (BF16, F16) load as 16 dword lanes, lane `j`
//! holding column `2j` in its low half and `2j + 1` in its high half; F32 loads as two vectors
//! (columns 0..15, 16..31). Every loader yields `(even, odd)`: lane `j` of `even` is column
//! `2j`, of `odd` column `2j + 1`, the order of `Activations::perm32`'s blocks.

/// Bits in one half of a dword lane: `<< HALF_BITS` moves column `2j` (low half) into an f32's
/// high half, `>> HALF_BITS` moves column `2j + 1` (high half) into the low half.
pub(crate) const HALF_BITS: u32 = 16;

/// A dword lane's high half: column `2j + 1` of a 16-bit format, in place.
pub(crate) const HIGH_HALF: u32 = 0xFFFF_0000;

/// `vpermt2ps` indices taking columns `2i + parity` of 32 f32 held as two vectors `a` (columns
/// 0..15) and `b` (16..31): an index's bit 4 picks `b`, bits 3..0 the lane.
const fn split_idx(parity: i32) -> [i32; 16] {
    let mut idx = [0i32; 16];
    let mut i = 0;
    while i < 16 {
        idx[i] = 2 * i as i32 + parity;
        i += 1;
    }
    idx
}

/// `vpermt2ps` indices of the even columns of an F32 block.
pub(crate) static F32_EVEN_IDX: [i32; 16] = split_idx(0);
/// `vpermt2ps` indices of the odd columns of an F32 block.
pub(crate) static F32_ODD_IDX: [i32; 16] = split_idx(1);

/// Lane masks of the two 16-f32 loads of an F32 block with `valid` (1..=32) columns left:
/// the first load takes columns `0..min(valid, 16)`, the second `16..valid`.
#[inline(always)]
pub(crate) fn f32_tail_masks(valid: usize) -> (u16, u16) {
    let mask = |k: usize| ((1u32 << k.min(16)) - 1) as u16;
    (mask(valid), mask(valid.saturating_sub(16)))
}

/// Byte mask of the first `n` (< 64) bytes of a 64-byte load.
#[inline(always)]
pub(crate) fn byte_mask64(n: usize) -> u64 {
    (1u64 << n) - 1
}

/// Byte mask of the first `n` (< 32) bytes of a 32-byte load.
#[inline(always)]
pub(crate) fn byte_mask32(n: usize) -> u32 {
    (1u32 << n) - 1
}

/// Byte offset of value block `block` (32 values) of row `r` of a row block, from the block's
/// first row, for a matrix of `cols` values of `elem` bytes each.
#[inline(always)]
pub(crate) fn block_offset(r: usize, cols: usize, block: usize, elem: usize) -> usize {
    (r * cols + 32 * block) * elem
}

/// `vpermt2ps` indices interleaving decoded low nibbles `a` (even columns) and high nibbles
/// `b` (odd columns) of one MXFP4 group back into column order: `half` 0 gives columns 0..15,
/// 1 gives 16..31.
const fn interleave_idx(half: i32) -> [i32; 16] {
    let mut idx = [0i32; 16];
    let mut i = 0;
    while i < 16 {
        idx[i] = 8 * half + (i as i32) / 2 + 16 * (i as i32 % 2);
        i += 1;
    }
    idx
}

/// Columns 0..15 of a group from its (even, odd) decode (`exact::dequant_mxfp4`).
pub(crate) static INTERLEAVE_FIRST: [i32; 16] = interleave_idx(0);
/// Columns 16..31 of a group from its (even, odd) decode.
pub(crate) static INTERLEAVE_SECOND: [i32; 16] = interleave_idx(1);

/// `hsum`: `vshuff32x4` bringing 128-bit blocks 2, 3 down to 0, 1 (lanes 8 apart).
pub(crate) const HSUM_UPPER_HALF: i32 = 0b00_00_11_10;
/// `hsum`: `vshuff32x4` bringing block 1 down to block 0 (lanes 4 apart).
pub(crate) const HSUM_UPPER_QUARTER: i32 = 0b00_00_00_01;
/// `hsum`: `shufps` bringing lane 1 down to lane 0 (after `movhlps`, lanes 2 apart).
pub(crate) const HSUM_LANE_ONE: i32 = 0b01;
/// `hsum16` step 1: `vshuff32x4` taking blocks 0, 1 of both sources.
pub(crate) const HSUM16_LOW_BLOCKS: i32 = 0b01_00_01_00;
/// `hsum16` step 1: blocks 2, 3 of both sources.
pub(crate) const HSUM16_HIGH_BLOCKS: i32 = 0b11_10_11_10;
/// `hsum16` step 2: blocks 0, 2 of both sources.
pub(crate) const HSUM16_EVEN_BLOCKS: i32 = 0b10_00_10_00;
/// `hsum16` step 2: blocks 1, 3 of both sources.
pub(crate) const HSUM16_ODD_BLOCKS: i32 = 0b11_01_11_01;
/// `hsum16` step 4: `shufps` taking lanes 0, 2 of each 128-bit block of both sources.
pub(crate) const HSUM16_EVEN_LANES: i32 = 0b10_00_10_00;
/// `hsum16` step 4: lanes 1, 3 of each block of both sources.
pub(crate) const HSUM16_ODD_LANES: i32 = 0b11_01_11_01;

/// The vector `hsum16` reads as its `j`-th input: reading the 16 vectors transposed (4 x 4)
/// puts `v[l]`'s sum in lane `l`.
#[inline(always)]
pub(crate) const fn hsum16_input(j: usize) -> usize {
    (j % 4) * 4 + j / 4
}
