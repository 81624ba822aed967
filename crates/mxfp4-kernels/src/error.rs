//! The crate's one error type.

use crate::tier::Tier;

/// Everything that can be wrong with the shapes and bytes handed to the kernels.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("{what}: cols {cols} is not a multiple of the MXFP4 group size 32")]
    ColsNotGroupMultiple { what: &'static str, cols: usize },
    #[error("{what}: {buffer} holds {found} bytes, expected {expected} for [{rows}, {cols}]")]
    BufferLength {
        what: &'static str,
        buffer: &'static str,
        rows: usize,
        cols: usize,
        expected: usize,
        found: usize,
    },
    #[error("{what}: E8M0 scale byte 0xff (NaN) at row {row}, group {group}")]
    NanScale {
        what: &'static str,
        row: usize,
        group: usize,
    },
    #[error("{what}: shape [{rows}, {cols}] is empty or overflows usize")]
    BadShape {
        what: &'static str,
        rows: usize,
        cols: usize,
    },
    #[error("row range {start}..{end} is outside a matrix of {rows} rows")]
    RowRange {
        start: usize,
        end: usize,
        rows: usize,
    },
    #[error("output holds {found} f32, expected {expected}")]
    OutputLength { expected: usize, found: usize },
    #[error("activations have {found} columns, the matrix has {expected}")]
    ActivationCols { expected: usize, found: usize },
    #[error(
        "activations hold {found} f32, expected a multiple of cols {cols} covering 1..={max} tokens"
    )]
    ActivationLength {
        cols: usize,
        found: usize,
        max: usize,
    },
    #[error("activations were prepared for tier {prepared}, kernels are tier {kernels}")]
    TierMismatch { prepared: Tier, kernels: Tier },
    #[error("tier {tier} needs the CPU feature {missing}, which this CPU lacks")]
    TierUnavailable { tier: Tier, missing: &'static str },
    #[error(
        "unknown kernel tier {0:?} (expected scalar, avx2, avx512, avx512-bf16 or avx512-vnni)"
    )]
    UnknownTier(String),
    #[error("{what}: cols {cols} is not a multiple of the packed BF16 block of 32")]
    ColsNotBlockMultiple { what: &'static str, cols: usize },
    #[error(
        "{what}: the row exception index is not nondecreasing, or points past the exception blocks"
    )]
    BadPackedIndex { what: &'static str },
    #[error("expert FFN shapes disagree: {0}")]
    ExpertShapes(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
