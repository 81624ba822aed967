//! A checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Each file is mapped once and its header parsed once; tensors
//! are looked up by name (the release's `language_model.` prefix is probed) and handed out as
//! borrowed bytes or as the kernels' validated views. Formats are read from the headers, not
//! implied by names: a linear weight may be BF16, F16, F32 or MXFP4 ([`Checkpoint::linear`]),
//! a float vector F32, BF16 or F16 ([`Checkpoint::f32_values`]).
//!
//! Hard failures with clear words: a truncated shard, overlapping or out-of-order data ranges
//! (the `safetensors` crate checks that a header's ranges tile the file exactly), a tensor the
//! index names but its shard lacks, or a shape/dtype a view cannot take is an error naming the
//! file and the tensor. Nothing here panics on file contents.
//!
//! Files: `open` opens a checkpoint and looks tensors up; `views` the typed views, `experts`
//! the expert table, `resident` the huge-page copy of the trunk, `warm` page-cache warming,
//! `index` the shard index, `storage` where tensor bytes live, `error` the error; this one
//! only declares them and re-exports the public names.

pub(crate) mod error;
pub(crate) mod experts;
mod index;
pub(crate) mod open;
mod resident;
pub(crate) mod storage;
pub(crate) mod views;
pub(crate) mod warm;

pub use safetensors::Dtype;

pub use error::CheckpointError;
pub use experts::{ExpertLocation, ExpertPiece};
pub use open::{Checkpoint, TEXT_PREFIX};
pub use storage::TensorRef;
pub use views::{LINEAR_FORMATS, LinearStorage, VECTOR_FORMATS};
pub use warm::{Warmed, read_ahead};
