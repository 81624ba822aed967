//! The crate's one error type.

use crate::tier::Tier;

/// Everything that can be wrong with the shapes and bytes handed to the kernels. `what` names
/// the tensor (the `with_name` constructors take it; the plain ones say which view it is).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// An MXFP4 matrix's columns are not whole groups of 32.
    #[error("{what}: cols {cols} is not a multiple of the MXFP4 group size 32")]
    ColsNotGroupMultiple {
        /// The tensor.
        what: &'static str,
        /// Its columns.
        cols: usize,
    },
    /// A buffer does not hold the bytes its matrix's shape needs.
    #[error("{what}: {buffer} holds {found} bytes, expected {expected} for [{rows}, {cols}]")]
    BufferLength {
        /// The tensor.
        what: &'static str,
        /// Which of its buffers (`weight_packed`, `weight_scale`, `bf16 data`, ...).
        buffer: &'static str,
        /// The matrix's rows.
        rows: usize,
        /// The matrix's columns.
        cols: usize,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes the buffer holds.
        found: usize,
    },
    /// An E8M0 scale byte is 0xFF, which means NaN.
    #[error("{what}: E8M0 scale byte 0xff (NaN) at row {row}, group {group}")]
    NanScale {
        /// The tensor.
        what: &'static str,
        /// The row of the first such scale.
        row: usize,
        /// Its group within the row.
        group: usize,
    },
    /// A shape with no element, or more than `usize` can count.
    #[error("{what}: shape [{rows}, {cols}] is empty or overflows usize")]
    BadShape {
        /// The tensor.
        what: &'static str,
        /// Its rows.
        rows: usize,
        /// Its columns.
        cols: usize,
    },
    /// A row range that is reversed or runs past the matrix.
    #[error("row range {start}..{end} is outside a matrix of {rows} rows")]
    RowRange {
        /// The range's first row.
        start: usize,
        /// Its end (exclusive).
        end: usize,
        /// The matrix's rows.
        rows: usize,
    },
    /// An output slice of the wrong length.
    #[error("output holds {found} f32, expected {expected}")]
    OutputLength {
        /// The length the call needs.
        expected: usize,
        /// The slice's length.
        found: usize,
    },
    /// Activations prepared for another width than the matrix's.
    #[error("activations have {found} columns, the matrix has {expected}")]
    ActivationCols {
        /// The matrix's columns.
        expected: usize,
        /// The activations' columns.
        found: usize,
    },
    /// Activation vectors that are not 1..=`MAX_TOKENS` whole vectors of `cols`.
    #[error(
        "activations hold {found} f32, expected a multiple of cols {cols} covering 1..={max} tokens"
    )]
    ActivationLength {
        /// The columns of one vector.
        cols: usize,
        /// The f32 given.
        found: usize,
        /// The most vectors one call takes ([`crate::MAX_TOKENS`]).
        max: usize,
    },
    /// Activations prepared by kernels of another tier.
    #[error("activations were prepared for tier {prepared}, kernels are tier {kernels}")]
    TierMismatch {
        /// The tier that prepared them.
        prepared: Tier,
        /// The tier of the kernels they were handed to.
        kernels: Tier,
    },
    /// A tier this CPU cannot run.
    #[error("tier {tier} needs the CPU feature {missing}, which this CPU lacks")]
    TierUnavailable {
        /// The tier asked for.
        tier: Tier,
        /// The first CPU feature it needs that this CPU lacks.
        missing: &'static str,
    },
    /// A tier name that is none of [`Tier::name`]'s.
    #[error(
        "unknown kernel tier {0:?} (expected scalar, avx2, avx512, avx512-bf16 or avx512-vnni)"
    )]
    UnknownTier(String),
    /// A packed BF16 matrix's columns are not whole blocks of 32.
    #[error("{what}: cols {cols} is not a multiple of the packed BF16 block of 32")]
    ColsNotBlockMultiple {
        /// The tensor.
        what: &'static str,
        /// Its columns.
        cols: usize,
    },
    /// A packed BF16 matrix's row exception index that cannot be right.
    #[error(
        "{what}: the row exception index is not nondecreasing, or points past the exception blocks"
    )]
    BadPackedIndex {
        /// The tensor.
        what: &'static str,
    },
    /// A Q8_0 matrix's columns are not whole blocks of 32.
    #[error("{what}: cols {cols} is not a multiple of the Q8_0 block of 32")]
    ColsNotQ8_0Multiple {
        /// The tensor.
        what: &'static str,
        /// Its columns.
        cols: usize,
    },
    /// The gate, up and down matrices of an expert do not fit together.
    #[error("expert FFN shapes disagree: {0}")]
    ExpertShapes(String),
}

/// The crate's `Result`, with [`Error`] by default.
pub type Result<T, E = Error> = std::result::Result<T, E>;
