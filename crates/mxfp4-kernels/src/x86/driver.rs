//! The row-blocking driver every x86 kernel runs through: [`drive`] walks a row range in
//! blocks of `R` rows for `T` tokens and calls the tier's block kernel ([`RowKernel::block`])
//! for each; the kernel says how it blocks rows (its [`GemvPlan`] and [`GemmPlan`]). A kernel
//! is a type, so the whole walk is monomorphised into the tier's `#[target_feature]` entry
//! point: no dispatch inside the loops, the same code as one written out per kernel.
//!
//! Batch invariance by construction: a block kernel is generic over `R` rows and `T` tokens,
//! and the arithmetic applied to one (row, token) pair — the loads, the FMA chain into one
//! accumulator, the final horizontal sum — does not depend on `R` or `T`. The GEMM is the
//! GEMV with more accumulators, so its rows equal the GEMV's bit for bit, and no row's result
//! depends on the plan.

use std::ops::Range;

use crate::activations::Activations;
use crate::packed::PackedBf16Matrix;
use crate::view::{Bf16Matrix, F16Matrix, F32Matrix, GROUP, MxFp4Matrix, Q8_0Matrix};

/// One call of a block kernel: rows `row0..row0 + R` of the matrix for tokens `tok0..tok0 + T`,
/// whose sums land at `out[(tok0 + t) * n + local0 + r]`, where the caller's row range has `n`
/// rows and starts `local0` rows before `row0`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) tok0: usize,
    pub(crate) row0: usize,
    pub(crate) local0: usize,
    pub(crate) n: usize,
    /// Of a GEMM run in column chunks ([`ChunkedGemm`]): the part of the rows this call runs.
    /// `None` (every other plan): the whole rows. Only kernels whose `Gemm` plan is
    /// `ChunkedGemm` are given a part.
    pub(crate) part: Option<ColumnPart>,
}

/// A tile's column chunk ([`ChunkedGemm`]): its rows' 32-column blocks `blocks.0..blocks.1`
/// (the partial last block counted), the tile's `R x T` accumulators (16 f32 each, row by
/// row, token by token) carried in memory at `carry` between chunks: loaded where the chunk
/// does not start the rows, stored there where it does not end them, and summed into the
/// output as ever where it does. Stored and loaded f32 keep their bits, so each accumulator
/// sees the whole-row call's FMAs in the same order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ColumnPart {
    pub(crate) blocks: (usize, usize),
    pub(crate) carry: *mut f32,
}

impl Tile {
    /// Token `tok0`'s vector in a prepared activation layout of `stride` values per token, after
    /// asserting that the tile's `T` tokens lie in it: the kernels' unchecked activation loads
    /// (any offset below `T * stride` from here) rely on this assert.
    #[inline(always)]
    pub(crate) fn tokens<const T: usize, E>(&self, layout: &[E], stride: usize) -> *const E {
        assert!(layout.len() >= (self.tok0 + T) * stride);
        layout[self.tok0 * stride..].as_ptr()
    }

    /// The 32-column blocks of its rows this call runs, of `blocks` in all: a chunk's
    /// ([`ColumnPart`]) or every one, after asserting that they lie in the rows.
    #[inline(always)]
    pub(crate) fn blocks(&self, blocks: usize) -> (usize, usize) {
        let (from, to) = self.part.map_or((0, blocks), |p| p.blocks);
        assert!(from < to && to <= blocks);
        (from, to)
    }

    /// The tile's `R` rows of an MXFP4 matrix, after asserting that they lie in it: the
    /// kernels' unchecked code loads rely on this assert.
    #[inline(always)]
    pub(crate) fn mxfp4_rows<'a, const R: usize, const C: usize>(
        &self,
        m: &MxFp4Matrix<'a>,
    ) -> Mxfp4Rows<'a> {
        assert!(self.row0 + R <= m.rows());
        let cols = width::<C>(m.cols());
        let (groups, row_bytes) = (cols / GROUP, cols / 2);
        Mxfp4Rows {
            groups,
            row_bytes,
            packed: m.packed()[self.row0 * row_bytes..].as_ptr(),
            scales: &m.scales()[self.row0 * groups..(self.row0 + R) * groups],
        }
    }
}

/// A tile's rows of an MXFP4 matrix, as its kernel walks them (`Tile::mxfp4_rows`).
pub(crate) struct Mxfp4Rows<'a> {
    /// Scale groups per row.
    pub(crate) groups: usize,
    /// Code bytes per row.
    pub(crate) row_bytes: usize,
    /// The first row's codes; the others follow `row_bytes` apart.
    pub(crate) packed: *const u8,
    /// The rows' scale bytes, `groups` per row.
    pub(crate) scales: &'a [u8],
}

/// What the driver needs of a matrix view.
pub(crate) trait Rows {
    /// Columns of the matrix.
    fn cols(&self) -> usize;
    /// Bytes of weights one pass over `rows` rows reads (sizes a GEMM's stretch).
    fn bytes_for_rows(&self, rows: usize) -> usize;
}

/// `Rows` of the views, by their own methods.
macro_rules! rows_of_views {
    ($($view:ident),*) => {$(
        impl Rows for $view<'_> {
            #[inline(always)]
            fn cols(&self) -> usize {
                $view::cols(self)
            }
            #[inline(always)]
            fn bytes_for_rows(&self, rows: usize) -> usize {
                $view::bytes_for_rows(self, rows)
            }
        }
    )*};
}
rows_of_views!(
    MxFp4Matrix,
    Bf16Matrix,
    F16Matrix,
    F32Matrix,
    PackedBf16Matrix,
    Q8_0Matrix
);

/// A tier's kernel over one block of rows of matrices `M`, and how its GEMVs and GEMMs block
/// rows (enough independent FMA chains to hide latency, few enough accumulators to stay in
/// the vector registers).
pub(crate) trait RowKernel<M: Rows> {
    /// The GEMVs' rows per block and the widths compiled on their own.
    type Gemv: GemvPlan;
    /// The rows per block of GEMMs of 2, 3 and 4 tokens.
    type Gemm: GemmPlan;

    /// Rows `tile.row0..tile.row0 + R` for tokens `tile.tok0..tile.tok0 + T`, their sums
    /// stored as [`Tile`] says. `C` is the width this copy is compiled for, or 0 for any width
    /// (see [`width`]). The kernel asserts that the rows and tokens lie in `m` and `act`
    /// before any unchecked load (`Tile::mxfp4_rows`, `Tile::tokens`).
    ///
    /// # Safety
    /// The CPU must have the kernel's target features.
    unsafe fn block<const R: usize, const T: usize, const C: usize>(
        m: &M,
        act: &Activations,
        tile: Tile,
        out: &mut [f32],
    );
}

/// Runs `K` over `rows` for every token of `act`: a GEMV as `K::Gemv` says, up to `MAX_GROUP`
/// tokens (4; 8 for [`WideGemm`]) as `K::Gemm` says, more as even groups of at most that, one
/// after the other over each stretch of `STRETCH_BYTES` of rows: the first streams the stretch
/// from memory, the others read it from L2. 8 or 16 tokens' accumulators and activations per
/// row block spill registers: 1024x1024 BF16 from L3, 1 thread, exact tier, 195-214 GFLOP/s
/// with 4 tokens x 4 rows, 164 with 8 x 2, 66 with 16 x 1 (PERFORMANCE.md, phase 7).
///
/// # Safety
/// The CPU must have `K`'s target features.
#[inline(always)]
pub(crate) unsafe fn drive<M: Rows, K: RowKernel<M>>(
    m: &M,
    act: &Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let (first, n) = (rows.start, rows.len());
    match act.tokens() {
        // SAFETY: by this function's contract.
        1 => unsafe { K::Gemv::run::<M, K>(m, act, rows, out) },
        // SAFETY: by this function's contract.
        tokens if tokens <= K::Gemm::MAX_GROUP => unsafe {
            K::Gemm::run::<M, K>(tokens, m, act, 0, rows, first, n, out)
        },
        tokens => {
            let stretch = stretch_rows(m.bytes_for_rows(1));
            let groups = tokens.div_ceil(K::Gemm::MAX_GROUP);
            let mut start = first;
            while start < rows.end {
                let end = (start + stretch).min(rows.end);
                for group in 0..groups {
                    let tok0 = group * tokens / groups;
                    let size = (group + 1) * tokens / groups - tok0;
                    // SAFETY: by this function's contract.
                    unsafe {
                        K::Gemm::run_group::<M, K>(size, m, act, tok0, start..end, first, n, out)
                    };
                }
                start = end;
            }
        }
    }
}

/// Runs `K::block::<R, T, C>` for tokens `tok0..tok0 + T` over `rows` in blocks of `R` rows,
/// then single rows for the tail. `rows` may be a stretch of the caller's range, which starts
/// at `first` and has `n` rows: outputs land at the caller's offsets.
///
/// # Safety
/// The CPU must have `K`'s target features.
#[inline(always)]
unsafe fn run_rows<M: Rows, K: RowKernel<M>, const R: usize, const T: usize, const C: usize>(
    m: &M,
    act: &Activations,
    tok0: usize,
    rows: Range<usize>,
    first: usize,
    n: usize,
    out: &mut [f32],
) {
    let tile = |row0: usize| Tile {
        tok0,
        row0,
        local0: row0 - first,
        n,
        part: None,
    };
    let mut row = rows.start;
    while rows.end - row >= R {
        // SAFETY: by this function's contract.
        unsafe { K::block::<R, T, C>(m, act, tile(row), out) };
        row += R;
    }
    while row < rows.end {
        // SAFETY: by this function's contract.
        unsafe { K::block::<1, T, C>(m, act, tile(row), out) };
        row += 1;
    }
}

/// How a GEMV blocks rows. A GEMV streams `R` rows at once: more concurrent row streams keep
/// more cache misses in flight, up to the point where the accumulators no longer fit in
/// registers. GEMVs on the listed column counts (K3's shapes) run a copy of the kernel
/// compiled for that width (`C`), so row offsets are constants folded into addressing instead
/// of registers spilled to the stack; any other width runs the generic copy (`C = 0`). Same
/// arithmetic.
pub(crate) trait GemvPlan {
    /// Runs `K`'s one-token GEMV over `rows`.
    ///
    /// # Safety
    /// The CPU must have `K`'s target features.
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        m: &M,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    );
}

/// A GEMV plan of `$rows` rows per block with copies for the listed widths.
macro_rules! gemv_plan {
    ($(#[$doc:meta])* $name:ident, $rows:literal rows, widths [$($cols:literal),*]) => {
        $(#[$doc])*
        pub(crate) struct $name;

        impl GemvPlan for $name {
            #[inline(always)]
            unsafe fn run<M: Rows, K: RowKernel<M>>(
                m: &M,
                act: &Activations,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                let (first, n) = (rows.start, rows.len());
                // SAFETY: by this function's contract.
                unsafe {
                    match m.cols() {
                        $($cols => {
                            run_rows::<M, K, $rows, 1, $cols>(m, act, 0, rows, first, n, out)
                        })*
                        _ => run_rows::<M, K, $rows, 1, 0>(m, act, 0, rows, first, n, out),
                    }
                }
            }
        }
    };
}

/// A GEMV plan of `R` rows per block, every width through the generic copy.
pub(crate) struct Gemv<const R: usize>;

impl<const R: usize> GemvPlan for Gemv<R> {
    #[inline(always)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        m: &M,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let (first, n) = (rows.start, rows.len());
        // SAFETY: by this function's contract.
        unsafe { run_rows::<M, K, R, 1, 0>(m, act, 0, rows, first, n, out) }
    }
}

gemv_plan!(
    /// The AVX-512 MXFP4 GEMVs: 8 rows; copies for K3's expert widths (3584 gate/up, 3072
    /// down).
    MxFp4Gemv, 8 rows, widths [3584, 3072]
);

gemv_plan!(
    /// The `avx512` Q8_0 GEMV: 16 rows; copies for K3's and k3-0.40b's widths.
    Q8_0Gemv, 16 rows, widths [7168, 12288, 6144, 3584, 1536, 1024, 512]
);

gemv_plan!(
    /// The `avx512` packed BF16 GEMV: 4 rows; copies for K3's and k3-0.40b's widths.
    PackedGemv, 4 rows, widths [7168, 12288, 6144, 3584, 1536, 512]
);

gemv_plan!(
    /// BF16 GEMVs on rows of more than `SHORT_ROW_COLS` columns: 16 rows; copies for K3's
    /// widths.
    LongRowGemv, 16 rows, widths [7168, 12288, 6144, 3584]
);

gemv_plan!(
    /// BF16 GEMVs on rows of at most `SHORT_ROW_COLS` columns: 8 rows; copies for k3-0.40b's
    /// and K3's short widths.
    ShortRowGemv, 8 rows, widths [256, 512, 1024, 1536, 2048]
);

/// The GEMV plan of the AVX-512 BF16 kernels and of the F16/F32 kernels built on them
/// (`exact`, `bf16`, `float`): short rows as [`ShortRowGemv`], the rest as [`LongRowGemv`].
/// Both BF16 tiers share it, so they pick the same row blocks for the same shapes.
pub(crate) struct Bf16Gemv;

impl GemvPlan for Bf16Gemv {
    #[inline(always)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        m: &M,
        act: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        if m.cols() <= SHORT_ROW_COLS {
            // SAFETY: by this function's contract.
            unsafe { ShortRowGemv::run::<M, K>(m, act, rows, out) }
        } else {
            // SAFETY: by this function's contract.
            unsafe { LongRowGemv::run::<M, K>(m, act, rows, out) }
        }
    }
}

/// How a GEMM of 2-4 tokens blocks rows: `R2`, `R3` or `R4` rows per block for 2, 3 or 4
/// tokens, so `R x T` accumulators stay in registers.
pub(crate) struct Gemm<const R2: usize, const R3: usize, const R4: usize>;

/// The AVX-512 tiers' GEMMs: 4 rows for 2-4 tokens (up to 16 of the 32 vector registers hold
/// accumulators).
pub(crate) type Avx512Gemm = Gemm<4, 4, 4>;

/// The `avx2` tier's GEMMs: 2 x R x T of the 16 vector registers hold the accumulators (each
/// is two 8-lane halves), so 2 rows for 2 tokens, 1 row for 3 or 4.
pub(crate) type Avx2Gemm = Gemm<2, 1, 1>;

/// Runs one group of 2 to [`GemmPlan::MAX_GROUP`] tokens.
pub(crate) trait GemmPlan {
    /// The most tokens one group runs ([`drive`] splits more into groups of at most this).
    const MAX_GROUP: usize = 4;

    /// Runs `K` for tokens `tok0..tok0 + tokens` (2..=4) over `rows`, a stretch of the caller's
    /// range, which starts at `first` and has `n` rows.
    ///
    /// # Safety
    /// The CPU must have `K`'s target features.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    );

    /// Runs one group of a GEMM of more than 4 tokens over `rows`, a stretch of the caller's
    /// range that an earlier group has brought into L2 ([`drive`]): as [`GemmPlan::run`]
    /// unless the plan walks a stretch otherwise.
    ///
    /// # Safety
    /// The CPU must have `K`'s target features.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn run_group<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: by this function's contract.
        unsafe { Self::run::<M, K>(tokens, m, act, tok0, rows, first, n, out) }
    }
}

impl<const R2: usize, const R3: usize, const R4: usize> GemmPlan for Gemm<R2, R3, R4> {
    #[inline(always)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        match tokens {
            // SAFETY: by this function's contract.
            2 => unsafe { run_rows::<M, K, R2, 2, 0>(m, act, tok0, rows, first, n, out) },
            // SAFETY: by this function's contract.
            3 => unsafe { run_rows::<M, K, R3, 3, 0>(m, act, tok0, rows, first, n, out) },
            // SAFETY: by this function's contract.
            4 => unsafe { run_rows::<M, K, R4, 4, 0>(m, act, tok0, rows, first, n, out) },
            _ => unreachable!("5..=MAX_TOKENS tokens split into groups of 2-4"),
        }
    }
}

/// The packed kernels' GEMM: groups of up to `MAX` tokens (6 exact: 7-8 in one group spilled,
/// 34/30 G multiply-adds/s a Zen 4 core against 40/41 split; 8 `vdpbf16ps`: 72/78 against
/// 59/62; PERFORMANCE.md phase 35); 4 rows a block for 2-3 tokens, 3 for 4-5, 2 for 6-8.
pub(crate) struct WideGemm<const MAX: usize>;

impl<const MAX: usize> GemmPlan for WideGemm<MAX> {
    const MAX_GROUP: usize = MAX;

    #[inline(always)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: by this function's contract.
        unsafe {
            match tokens {
                2..=3 => Avx512Gemm::run::<M, K>(tokens, m, act, tok0, rows, first, n, out),
                4 => run_rows::<M, K, 3, 4, 0>(m, act, tok0, rows, first, n, out),
                5 => run_rows::<M, K, 3, 5, 0>(m, act, tok0, rows, first, n, out),
                6 => run_rows::<M, K, 2, 6, 0>(m, act, tok0, rows, first, n, out),
                7 => run_rows::<M, K, 2, 7, 0>(m, act, tok0, rows, first, n, out),
                8 => run_rows::<M, K, 2, 8, 0>(m, act, tok0, rows, first, n, out),
                _ => unreachable!("more than 8 tokens split into groups of 2-8"),
            }
        }
    }
}

/// A GEMM plan of `R2`, `R3` or `R4` rows per block for 2, 3 or 4 tokens (as [`Gemm`]) whose
/// groups of a GEMM of more than 4 tokens walk their stretch in column chunks: a chunk of
/// [`CHUNK_BYTES`] of the group's activations at a time, every row block of the stretch
/// running that chunk before the next ([`ColumnPart`]). Row by row over the whole width, a
/// group's activations (T x 28 KB at K3's 7168 columns) do not fit in L1, and each row block
/// reads them from L2 again, 2 bytes of activations per weight byte. Measured on a Zen 3 core
/// (`avx2` BF16, 7168 columns, the two walks alternated 20 times each in one process): a
/// chunked 64-token GEMM took 0.85-0.88x the time over 1024 rows (in L3) and 0.85x over 8192
/// (from memory), 8 tokens 0.78-0.85x; `avx2` MXFP4 (3072x3584 and 3072x7168) 0.74-1.05x at 8
/// tokens, 0.81-0.94x at 16, 0.93-0.99x at 32; the k3-wide slice's 64-token prefill, one
/// binary with and without the chunks alternated, 1.13-1.23x the tokens/s (dense MLP 0.68x,
/// KDA 0.75x, routed experts 0.91x the time). A GEMM of 2-4 tokens alone (a few sequences'
/// decode, a short verify pass) streams the weights from memory, where the chunked walk took
/// 1.04-1.09x (2 and 4 tokens, 8192 rows): it walks row by row. The packed BF16 kernel is
/// bound by its decode, and chunked it took 1.0-1.35x the time: it keeps [`Gemm`]; so does
/// the Q8_0 kernel (its dense MLP bucket in the slice's prefill: 25.3 and 23.4 ms a token
/// chunked against 25.1 and 24.8).
pub(crate) struct ChunkedGemm<const R2: usize, const R3: usize, const R4: usize>;

/// Bytes of one chunk of a token group's activations ([`ChunkedGemm`]): half a 32 KB L1.
pub(crate) const CHUNK_BYTES: usize = 16 << 10;

impl<const R2: usize, const R3: usize, const R4: usize> GemmPlan for ChunkedGemm<R2, R3, R4> {
    #[inline(always)]
    unsafe fn run<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: by this function's contract.
        unsafe { Gemm::<R2, R3, R4>::run::<M, K>(tokens, m, act, tok0, rows, first, n, out) }
    }

    #[inline(always)]
    unsafe fn run_group<M: Rows, K: RowKernel<M>>(
        tokens: usize,
        m: &M,
        act: &Activations,
        tok0: usize,
        rows: Range<usize>,
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        match tokens {
            // SAFETY: by this function's contract.
            2 => unsafe { run_chunked::<M, K, R2, 2>(m, act, tok0, rows, first, n, out) },
            // SAFETY: by this function's contract.
            3 => unsafe { run_chunked::<M, K, R3, 3>(m, act, tok0, rows, first, n, out) },
            // SAFETY: by this function's contract.
            4 => unsafe { run_chunked::<M, K, R4, 4>(m, act, tok0, rows, first, n, out) },
            _ => unreachable!("5..=MAX_TOKENS tokens split into groups of 2-4"),
        }
    }
}

/// [`ChunkedGemm`]'s walk for `T` tokens in blocks of `R` rows (single rows for the tail).
///
/// # Safety
/// The CPU must have `K`'s target features.
#[inline(always)]
unsafe fn run_chunked<M: Rows, K: RowKernel<M>, const R: usize, const T: usize>(
    m: &M,
    act: &Activations,
    tok0: usize,
    rows: Range<usize>,
    first: usize,
    n: usize,
    out: &mut [f32],
) {
    let blocks = m.cols().div_ceil(32);
    let per_chunk = (CHUNK_BYTES / (T * 32 * 4)).max(1);
    let stretch = stretch_rows(m.bytes_for_rows(1));
    let mut carry = vec![0.0f32; stretch.min(rows.len()) * T * 16];
    let mut start = rows.start;
    while start < rows.end {
        let end = (start + stretch).min(rows.end);
        for b in (0..blocks).step_by(per_chunk) {
            let blocks = (b, (b + per_chunk).min(blocks));
            let tile = |row0: usize, carry: &mut [f32]| Tile {
                tok0,
                row0,
                local0: row0 - first,
                n,
                part: Some(ColumnPart {
                    blocks,
                    carry: carry[(row0 - start) * T * 16..].as_mut_ptr(),
                }),
            };
            let mut row = start;
            while end - row >= R {
                // SAFETY: by this function's contract; the carry holds the stretch's rows.
                unsafe { K::block::<R, T, 0>(m, act, tile(row, &mut carry), out) };
                row += R;
            }
            while row < end {
                // SAFETY: as above.
                unsafe { K::block::<1, T, 0>(m, act, tile(row, &mut carry), out) };
                row += 1;
            }
        }
        start = end;
    }
}

/// The matrix width a kernel copy runs with: the constant `C` it was compiled for, or the
/// runtime `cols` for the generic copy (`C = 0`). The GEMV plans pick `C == cols`.
#[inline(always)]
pub(crate) fn width<const C: usize>(cols: usize) -> usize {
    if C == 0 {
        cols
    } else {
        assert_eq!(C, cols, "kernel copy for {C} columns called on {cols}");
        C
    }
}

/// Weight bytes of a stretch of rows that a GEMM's token groups share in cache ([`drive`]):
/// well inside the 1 MB L2 of a Zen 4 core.
pub(crate) const STRETCH_BYTES: usize = 128 << 10;

/// Rows per stretch for rows of `row_bytes`: about `STRETCH_BYTES`, a multiple of 16 rows (so
/// every kernel's row block divides it and only a range's last stretch has a row tail).
pub(crate) fn stretch_rows(row_bytes: usize) -> usize {
    (STRETCH_BYTES / row_bytes.max(1)).div_ceil(16).max(1) * 16
}

/// BF16 GEMV rows of at most this many columns (4 KB) run 8 rows at once, not 16: a 16-row
/// block of 2 KB rows is 16 short streams that start cold every 32 KB, and 4 rows are too
/// few FMA chains. k3-0.40b's 163840x1024 lm_head at 1 thread: 74-76% of the read with 16,
/// 85-86% with 8, 69-70% with 4 (PERFORMANCE.md, phase 7). Per-row arithmetic does not
/// depend on the row block, so the bits do not either.
pub(crate) const SHORT_ROW_COLS: usize = 2048;
