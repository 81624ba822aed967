//! The routed expert's layout as the store reads it: which of the six tensors make up each
//! MXFP4 matrix, and each matrix's dimensions. The one place the store spells the K3 layout
//! (with [`crate::checkpoint::EXPERT_TENSORS`], whose order the tensor indices follow).

use super::config::ExpertShape;

/// One MXFP4 matrix of a routed expert.
#[derive(Debug, Clone, Copy)]
pub(super) struct ExpertMatrix {
    /// Its name in errors.
    pub(super) what: &'static str,
    /// The index of its packed codes among the expert's tensors; its scales follow.
    pub(super) codes: usize,
    /// Its rows are the intermediate dimension (gate, up), not the model's (down).
    pub(super) rows_intermediate: bool,
}

/// The matrices in the order [`super::Expert::matrices`] hands them out: gate (`w1`), up
/// (`w3`) and down (`w2`).
pub(super) const EXPERT_MATRICES: [ExpertMatrix; 3] = [
    ExpertMatrix {
        what: "expert w1 (gate)",
        codes: 0,
        rows_intermediate: true,
    },
    ExpertMatrix {
        what: "expert w3 (up)",
        codes: 2,
        rows_intermediate: true,
    },
    ExpertMatrix {
        what: "expert w2 (down)",
        codes: 4,
        rows_intermediate: false,
    },
];

impl ExpertShape {
    /// (rows, cols) of `matrix`: gate and up are `[intermediate, io]`, down `[io, intermediate]`.
    pub(super) fn dims(self, matrix: &ExpertMatrix) -> (usize, usize) {
        if matrix.rows_intermediate {
            (self.intermediate, self.io)
        } else {
            (self.io, self.intermediate)
        }
    }
}
