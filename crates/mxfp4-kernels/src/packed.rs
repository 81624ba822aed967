//! Packed BF16: BF16 matrices stored losslessly in 12.25 bits per weight, for memory that
//! holds less than the model (a packed trunk keeps 1.3x as many weights resident).
//!
//! A BF16 value is a sign bit, an 8-bit exponent and a 7-bit mantissa. In trained (and
//! synthetic) weight matrices the exponents of 32 neighbouring weights span few values: on
//! k3-wide's BF16 matrices the exponent's entropy is 2.3 bits and 99.84% of 32-weight blocks
//! have all their nonzero exponents within 15 consecutive values. A block is stored as
//!
//! - 32 bytes: each weight's sign (bit 7) and mantissa (bits 6..0),
//! - 16 bytes: each weight's exponent as a 4-bit code, two per byte (byte `i` holds slot `i`'s
//!   code in its low nibble, slot `16 + i`'s in its high nibble): code 0 is exponent 0 (zeros
//!   and subnormals), code `c` in 1..=15 is `base + c - 1`,
//! - 1 byte: `base`, the smallest nonzero exponent of the block (1..=255).
//!
//! 49 bytes instead of 64, the same for every block, so rows have a fixed stride and any
//! range of rows is one range of bytes. A block whose nonzero exponents span more than 15
//! values (an "exception") is stored with `base` 0 and its 64 BF16 bytes kept aside, in
//! block order; each row knows where its exceptions start. Decoding gives the BF16 bits back
//! exactly (signed zeros, subnormals, infinities and NaN payloads included), so a kernel that
//! decodes a block and then runs the BF16 kernel's FMAs gives the BF16 kernel's bits.
//!
//! Byte order inside a block: byte `p` of the sign/mantissa bytes (and code `p`) belongs to
//! column [`SLOT_COLUMN`]`[p]` of the block, `[0..8, 16..24, 8..16, 24..32]`: the order in
//! which the `avx2` decode's in-lane byte interleave yields the columns in order.

use crate::error::{Error, Result};
use crate::view::check_length;

/// Weights per block.
pub const PACKED_BLOCK: usize = 32;
/// Bytes per block: 32 sign/mantissa bytes, 16 code bytes, the base.
pub const PACKED_BLOCK_BYTES: usize = 49;
/// Offset of the code bytes in a block.
pub const CODES_AT: usize = 32;
/// Offset of the base byte in a block.
pub const BASE_AT: usize = 48;
/// Bytes of an exception block kept aside (32 BF16 values, little-endian, in column order).
pub const EXCEPTION_BYTES: usize = 64;
/// The largest `max - min` of a block's nonzero exponents that codes can hold.
const MAX_SPAN: u8 = 14;

/// Column (within the block) of byte `p` of a block's sign/mantissa bytes and of code `p`.
pub const SLOT_COLUMN: [usize; PACKED_BLOCK] = {
    let mut c = [0usize; PACKED_BLOCK];
    let mut p = 0;
    while p < PACKED_BLOCK {
        c[p] = match p {
            8..16 => p + 8,
            16..24 => p - 8,
            _ => p,
        };
        p += 1;
    }
    c
};

/// Bytes of the body of a packed `[rows, cols]` matrix (`cols` a multiple of 32).
pub const fn packed_body_bytes(rows: usize, cols: usize) -> usize {
    rows * (cols / PACKED_BLOCK) * PACKED_BLOCK_BYTES
}

/// A packed matrix, owned: the body, the exception blocks and where each row's start.
#[derive(Debug, Clone, Default)]
pub struct PackedBf16 {
    /// Every row's blocks, 49 bytes each ([`packed_body_bytes`] in all).
    pub body: Vec<u8>,
    /// The exception blocks' BF16 bytes, 64 each, in row and block order.
    pub exceptions: Vec<u8>,
    /// `rows + 1` indices into `exceptions` (in blocks): row `r`'s are
    /// `row_exceptions[r]..row_exceptions[r + 1]`.
    pub row_exceptions: Vec<u32>,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix (a multiple of [`PACKED_BLOCK`]).
    pub cols: usize,
}

impl PackedBf16 {
    /// Packs `[rows, cols]` little-endian BF16 values (`cols` a multiple of 32).
    pub fn pack(bf16: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let what = "packed bf16 matrix";
        check_shape(what, rows, cols)?;
        check_length(what, "bf16 data", (rows, cols), rows * cols * 2, bf16.len())?;
        let mut packed = Self {
            body: vec![0; packed_body_bytes(rows, cols)],
            exceptions: Vec::new(),
            row_exceptions: Vec::with_capacity(rows + 1),
            rows,
            cols,
        };
        pack_rows_into(
            bf16,
            cols,
            &mut packed.body,
            &mut packed.exceptions,
            &mut packed.row_exceptions,
        );
        packed.row_exceptions.push(packed.exception_count());
        Ok(packed)
    }

    /// Exception blocks in all.
    pub fn exception_count(&self) -> u32 {
        u32::try_from(self.exceptions.len() / EXCEPTION_BYTES).expect("under 2^32 exceptions")
    }

    /// Bytes held: body, exceptions and the row index.
    pub fn bytes(&self) -> usize {
        self.body.len() + self.exceptions.len() + 4 * self.row_exceptions.len()
    }

    /// The borrowed view the kernels take.
    pub fn view(&self) -> PackedBf16Matrix<'_> {
        PackedBf16Matrix::new(
            &self.body,
            &self.exceptions,
            &self.row_exceptions,
            self.rows,
            self.cols,
        )
        .expect("a packed matrix is consistent")
    }
}

/// Packs whole rows of `cols` BF16 values (`bf16`, little-endian) into `body` (exactly their
/// packed bytes), appending their exception blocks to `exceptions` and, per row, the index of
/// its first exception block (`exceptions.len() / 64` before it) to `row_exceptions`. A
/// matrix packed in pieces this way, with the final count pushed last, is the one
/// [`PackedBf16::pack`] makes.
pub fn pack_rows_into(
    bf16: &[u8],
    cols: usize,
    body: &mut [u8],
    exceptions: &mut Vec<u8>,
    row_exceptions: &mut Vec<u32>,
) {
    assert!(
        cols > 0 && cols.is_multiple_of(PACKED_BLOCK),
        "whole blocks per row"
    );
    let row_bytes = cols / PACKED_BLOCK * PACKED_BLOCK_BYTES;
    assert!(
        bf16.len().is_multiple_of(2 * cols) && body.len() == bf16.len() / (2 * cols) * row_bytes,
        "whole rows, and their packed bytes"
    );
    for (row, out) in bf16
        .chunks_exact(cols * 2)
        .zip(body.chunks_exact_mut(row_bytes))
    {
        let count = exceptions.len() / EXCEPTION_BYTES;
        row_exceptions.push(u32::try_from(count).expect("under 2^32 exception blocks"));
        for (src, dst) in row
            .chunks_exact(PACKED_BLOCK * 2)
            .zip(out.chunks_exact_mut(PACKED_BLOCK_BYTES))
        {
            let dst: &mut [u8; PACKED_BLOCK_BYTES] = dst.try_into().expect("49 bytes");
            if !pack_block(src, dst) {
                exceptions.extend_from_slice(src);
            }
        }
    }
}

fn check_shape(what: &'static str, rows: usize, cols: usize) -> Result<()> {
    if rows == 0
        || cols == 0
        || rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(2))
            .is_none()
    {
        return Err(Error::BadShape { what, rows, cols });
    }
    if !cols.is_multiple_of(PACKED_BLOCK) {
        return Err(Error::ColsNotBlockMultiple { what, cols });
    }
    Ok(())
}

/// Packs one block of 32 BF16 values (64 bytes, column order) into `dst`; `false` (and `dst`
/// left as an exception: base 0) where its nonzero exponents span more than 15 values.
fn pack_block(src: &[u8], dst: &mut [u8; PACKED_BLOCK_BYTES]) -> bool {
    let src: &[u8; 2 * PACKED_BLOCK] = src.try_into().expect("64 bytes");
    let values: [u16; PACKED_BLOCK] =
        std::array::from_fn(|c| u16::from_le_bytes([src[2 * c], src[2 * c + 1]]));
    // Bits 14..7: the exponent (the shift leaves the sign in bit 8, which `as u8` drops).
    let exponents: [u8; PACKED_BLOCK] = std::array::from_fn(|c| (values[c] >> 7) as u8);
    let (mut min, mut max) = (u8::MAX, 0u8);
    for &e in &exponents {
        max = max.max(e);
        min = min.min(if e == 0 { u8::MAX } else { e });
    }
    if max != 0 && max - min > MAX_SPAN {
        *dst = [0; PACKED_BLOCK_BYTES];
        return false;
    }
    // No nonzero exponent: any base from 1 up decodes the block (every code is 0).
    let base = if max == 0 { 1 } else { min };
    let code = |e: u8| if e == 0 { 0 } else { e - base + 1 };
    let sign_mantissa = |v: u16| ((v >> 8) as u8 & 0x80) | (v as u8 & 0x7F);
    // Slot order `[0..8, 16..24, 8..16, 24..32]` (`SLOT_COLUMN`) written out as four runs of
    // 8 contiguous columns, which the compiler vectorizes; codes pair slot `p` with `p + 16`.
    for q in 0..8 {
        dst[q] = sign_mantissa(values[q]);
        dst[8 + q] = sign_mantissa(values[16 + q]);
        dst[16 + q] = sign_mantissa(values[8 + q]);
        dst[24 + q] = sign_mantissa(values[24 + q]);
        dst[CODES_AT + q] = code(exponents[q]) | (code(exponents[8 + q]) << 4);
        dst[CODES_AT + 8 + q] = code(exponents[16 + q]) | (code(exponents[24 + q]) << 4);
    }
    dst[BASE_AT] = base;
    true
}

/// The 32 BF16 values of a packed block (not an exception), in column order.
pub fn decode_block(block: &[u8; PACKED_BLOCK_BYTES]) -> [u16; PACKED_BLOCK] {
    let base = block[BASE_AT];
    let mut out = [0u16; PACKED_BLOCK];
    for (p, &c) in SLOT_COLUMN.iter().enumerate() {
        let code = (block[CODES_AT + p % 16] >> (4 * (p / 16))) & 0x0F;
        let e = if code == 0 {
            0
        } else {
            u16::from(base.wrapping_add(code - 1))
        };
        let m = block[p];
        out[c] = (u16::from(m & 0x80) << 8) | (e << 7) | u16::from(m & 0x7F);
    }
    out
}

/// A `[rows, cols]` packed BF16 matrix, borrowed: the kernels' view (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct PackedBf16Matrix<'a> {
    body: &'a [u8],
    exceptions: &'a [u8],
    /// `rows + 1` indices (in blocks) into `exceptions`, nondecreasing.
    row_exceptions: &'a [u32],
    rows: usize,
    cols: usize,
}

impl<'a> PackedBf16Matrix<'a> {
    /// Checks the shape, the body's length and the row index (nondecreasing, inside
    /// `exceptions`) and wraps the bytes. That a row's exceptions are as many as its blocks
    /// with base 0 is not checked here (it would read the whole body): a kernel that finds
    /// fewer panics.
    pub fn new(
        body: &'a [u8],
        exceptions: &'a [u8],
        row_exceptions: &'a [u32],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let what = "packed bf16 matrix";
        check_shape(what, rows, cols)?;
        let check =
            |buffer, expected, found| check_length(what, buffer, (rows, cols), expected, found);
        check("packed body", packed_body_bytes(rows, cols), body.len())?;
        check("row exception index", rows + 1, row_exceptions.len())?;
        let ordered = row_exceptions.windows(2).all(|w| w[0] <= w[1]);
        let inside = row_exceptions[rows] as usize * EXCEPTION_BYTES <= exceptions.len();
        if !ordered || !inside || !exceptions.len().is_multiple_of(EXCEPTION_BYTES) {
            return Err(Error::BadPackedIndex { what });
        }
        Ok(Self {
            body,
            exceptions,
            row_exceptions,
            rows,
            cols,
        })
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / PACKED_BLOCK
    }
    /// Bytes of one row of the body.
    pub fn row_bytes(&self) -> usize {
        self.blocks() * PACKED_BLOCK_BYTES
    }
    /// The whole body.
    pub fn body(&self) -> &'a [u8] {
        self.body
    }
    /// Row `row`'s blocks in the body ([`Self::row_bytes`] bytes; its exception blocks are
    /// kept aside).
    pub fn row_body(&self, row: usize) -> &'a [u8] {
        &self.body[row * self.row_bytes()..][..self.row_bytes()]
    }
    /// Every exception block of the matrix this view was cut from.
    pub fn exceptions(&self) -> &'a [u8] {
        self.exceptions
    }
    /// Index of row `row`'s first exception block in [`Self::exceptions`].
    pub(crate) fn first_exception(&self, row: usize) -> usize {
        self.row_exceptions[row] as usize
    }
    /// Exception block `next` (64 BF16 bytes) for the next exception block met in row `row`,
    /// and `next` moved past it. Panics where the row has no more than its index says.
    pub(crate) fn take_exception(&self, row: usize, next: &mut usize) -> &'a [u8] {
        let e = *next;
        assert!(
            e < self.first_exception(row + 1),
            "row {row} of a packed matrix has more exception blocks than its index says"
        );
        *next = e + 1;
        &self.exceptions[e * EXCEPTION_BYTES..(e + 1) * EXCEPTION_BYTES]
    }
    /// Bytes of weights that one pass over `rows` reads (the body's; exceptions are few).
    pub fn bytes_for_rows(&self, rows: usize) -> usize {
        rows * self.row_bytes()
    }
    /// Bytes of the whole matrix's body.
    pub fn weight_bytes(&self) -> usize {
        self.body.len()
    }

    /// Rows `rows` of the matrix (sharing its exceptions).
    pub fn sub_rows(&self, rows: std::ops::Range<usize>) -> Result<Self> {
        if rows.start >= rows.end || rows.end > self.rows {
            return Err(Error::RowRange {
                start: rows.start,
                end: rows.end,
                rows: self.rows,
            });
        }
        let per = self.row_bytes();
        Self::new(
            &self.body[rows.start * per..rows.end * per],
            self.exceptions,
            &self.row_exceptions[rows.start..=rows.end],
            rows.len(),
            self.cols,
        )
    }

    /// Row `row`'s BF16 values, exactly, into `out` (`cols` values).
    pub fn decode_row(&self, row: usize, out: &mut [u16]) {
        assert_eq!(out.len(), self.cols, "one row of values");
        let body = self.row_body(row);
        let mut next = self.first_exception(row);
        for (block, dst) in body
            .chunks_exact(PACKED_BLOCK_BYTES)
            .zip(out.chunks_exact_mut(PACKED_BLOCK))
        {
            let block: &[u8; PACKED_BLOCK_BYTES] = block.try_into().expect("49 bytes");
            if block[BASE_AT] == 0 {
                let raw = self.take_exception(row, &mut next);
                for (d, b) in dst.iter_mut().zip(raw.chunks_exact(2)) {
                    *d = u16::from_le_bytes([b[0], b[1]]);
                }
            } else {
                dst.copy_from_slice(&decode_block(block));
            }
        }
    }

    /// Rows `rows` as little-endian BF16 bytes (`rows.len() * cols * 2`), exactly.
    pub fn decode_rows_bf16(&self, rows: std::ops::Range<usize>, out: &mut [u8]) {
        assert_eq!(out.len(), rows.len() * self.cols * 2, "the rows' bytes");
        let mut values = vec![0u16; self.cols];
        for (row, dst) in rows.zip(out.chunks_exact_mut(self.cols * 2)) {
            self.decode_row(row, &mut values);
            for (d, v) in dst.chunks_exact_mut(2).zip(&values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k3_testkit::Rng;

    use super::*;

    fn to_bytes(values: &[u16]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Every BF16 bit pattern, in blocks that mix it with typical weights and with the values
    /// that force exceptions, comes back bit for bit.
    #[test]
    fn every_bf16_pattern_round_trips() {
        let cols = 64;
        let mut values = Vec::new();
        let mut rng = Rng::new(7);
        for v in 0..=u16::MAX {
            values.push(v);
            // A typical weight: exponent 110..=121, random sign and mantissa.
            let e = 110 + rng.below(12) as u16;
            values.push(((rng.next_u64() as u16) & 0x807F) | (e << 7));
        }
        let rows = values.len() / cols;
        let packed = PackedBf16::pack(&to_bytes(&values), rows, cols).unwrap();
        let m = packed.view();
        let mut row = vec![0u16; cols];
        for r in 0..rows {
            m.decode_row(r, &mut row);
            assert_eq!(row, values[r * cols..(r + 1) * cols], "row {r}");
        }
        assert!(
            packed.exception_count() > 0,
            "wide blocks became exceptions"
        );
    }

    /// Blocks at the edges of the code range: all zeros, only subnormals, exactly 15 nonzero
    /// exponents (packed), 16 (an exception), exponent 255 (infinities, NaN) with 241.
    #[test]
    fn code_range_edges() {
        let block = |f: &dyn Fn(usize) -> u16| (0..PACKED_BLOCK).map(f).collect::<Vec<u16>>();
        let cases: Vec<(Vec<u16>, bool)> = vec![
            (block(&|_| 0), true),
            (
                block(&|c| {
                    if c % 2 == 0 {
                        0x8000
                    } else {
                        0x0001 + c as u16
                    }
                }),
                true,
            ),
            (block(&|c| ((100 + (c % 15) as u16) << 7) | c as u16), true),
            (block(&|c| ((100 + (c % 16) as u16) << 7) | c as u16), false),
            (
                block(&|c| {
                    if c < 16 {
                        0x7F80 | (c as u16 & 1)
                    } else {
                        241 << 7
                    }
                }),
                true,
            ),
            (block(&|c| if c < 16 { 0xFF80 } else { 240 << 7 }), false),
        ];
        for (i, (values, packs)) in cases.iter().enumerate() {
            let packed = PackedBf16::pack(&to_bytes(values), 1, PACKED_BLOCK).unwrap();
            assert_eq!(packed.exception_count() == 0, *packs, "case {i}");
            let mut row = vec![0u16; PACKED_BLOCK];
            packed.view().decode_row(0, &mut row);
            assert_eq!(&row, values, "case {i}");
        }
    }

    /// Sub-rows share the exceptions and decode as the same rows of the whole.
    #[test]
    fn sub_rows_decode_as_the_whole() {
        let (rows, cols) = (9, 96);
        let mut rng = Rng::new(3);
        let values: Vec<u16> = (0..rows * cols)
            .map(|i| {
                // Every 7th block spans 20 exponents: an exception.
                let e = if (i / 32) % 7 == 3 {
                    90 + (i % 20)
                } else {
                    115 + (i % 5)
                };
                ((rng.next_u64() as u16) & 0x807F) | ((e as u16) << 7)
            })
            .collect();
        let packed = PackedBf16::pack(&to_bytes(&values), rows, cols).unwrap();
        assert!(packed.exception_count() >= 3);
        let whole = packed.view();
        for (a, b) in [(0, 9), (2, 5), (4, 5), (8, 9)] {
            let part = whole.sub_rows(a..b).unwrap();
            let mut bytes = vec![0u8; (b - a) * cols * 2];
            part.decode_rows_bf16(0..b - a, &mut bytes);
            assert_eq!(
                bytes,
                to_bytes(&values[a * cols..b * cols]),
                "rows {a}..{b}"
            );
        }
        assert!(whole.sub_rows(3..3).is_err() && whole.sub_rows(0..10).is_err());
    }

    /// Bad shapes and indexes are refused with the reason.
    #[test]
    fn bad_views_are_refused() {
        let packed = PackedBf16::pack(&[0u8; 2 * 64], 2, 32).unwrap();
        let (b, e) = (&packed.body[..], &packed.exceptions[..]);
        assert!(PackedBf16Matrix::new(b, e, &[0, 0, 0], 2, 32).is_ok());
        assert!(PackedBf16Matrix::new(&b[1..], e, &[0, 0, 0], 2, 32).is_err());
        assert!(PackedBf16Matrix::new(b, e, &[0, 0], 2, 32).is_err());
        assert!(PackedBf16Matrix::new(b, e, &[0, 1, 0], 2, 32).is_err());
        assert!(PackedBf16Matrix::new(b, e, &[0, 0, 1], 2, 32).is_err());
        assert!(PackedBf16::pack(&[0u8; 2 * 48], 2, 24).is_err());
        assert!(PackedBf16::pack(&[0u8; 10], 2, 32).is_err());
    }
}
