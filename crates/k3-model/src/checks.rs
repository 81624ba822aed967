//! Checks of a checkpoint before it runs: that it matches the config ([`validate`]: every
//! tensor present, in its shape and a format its role allows; [`validate_expert_scales`]:
//! no 0xFF scale anywhere), and what it holds ([`census`]: bytes per storage format and tensor
//! class).

pub(crate) mod census;
pub(crate) mod validate;

pub use census::{Cell, Class, Format, census};
pub use validate::{Validated, a_log, trunk_tensor_names, validate, validate_expert_scales};
