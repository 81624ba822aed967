//! Where the forward pass gets each trunk weight: as loaded (views over the file mapping or
//! the resident copy), or, for what the memory plan streams ([`crate::plan::TrunkPlan`]:
//! per layer the attention, the dense MLP's gate, up and down or the MoE block, then the
//! lm_head; the dense matrices and the lm_head in row blocks), the same views relocated into
//! a buffer read from disk with `O_DIRECT` a step ahead of compute.
//!
//! The stream is two buffers (one where the budget is tight) cycling between one I/O thread
//! and the forward pass: the thread reads the plan's steps in forward order (each step's
//! tensors in file order, adjacent ones in one read, each read one `pread` that the kernel
//! splits into many requests in flight), round and round, into whichever buffer is free; the
//! pass takes the buffer of the step it needs and gives it back when that step is done. So
//! the next step's read overlaps this step's compute, and no weight byte passes through the
//! page cache. The bytes are the file's, and a row block's rows are computed as in the whole
//! matrix, so the logits are the same bits as the mapped run's.

mod passes;
mod relocate;
mod resident;
pub(in crate::model) mod stream;
#[cfg(test)]
mod tests;

pub use resident::{PackedSummary, ResidentTrunk};
