//! Exact MXFP4, Q8_0, BF16, F16 and F32 weight kernels for CPU inference: dequant, GEMV,
//! batch-invariant small GEMM and the fused routed-expert FFN, with a scalar oracle tier and
//! AVX-512 and AVX2 tiers chosen at runtime.
//!
//! This crate does no I/O and spawns no threads: a kernel computes the row range it is given,
//! and the caller splits rows across its own workers.
//!
//! - Views: [`MxFp4Matrix`], [`Q8_0Matrix`], [`Bf16Matrix`], [`F16Matrix`], [`F32Matrix`] and
//!   [`PackedBf16Matrix`], or any of them as a [`WeightMatrix`]: shapes checked once, so the
//!   kernels cannot fail on them.
//! - Kernels: [`Kernels`], a [`Tier`] this CPU runs, prepares [`Activations`] and runs dequant,
//!   matmul and the fused expert FFN ([`Kernels::expert_ffn`], over any [`GluActivation`],
//!   such as [`Situ`]).
//! - Formats: [`codes`] (E2M1, E8M0, BF16, F16), [`packed`] (BF16 in 12.25 bits per weight,
//!   lossless), [`ggml`] (ggml's MXFP4 blocks); [`vmath`], the `exp`, `tanh`, `sigmoid` and
//!   `softplus` every tier computes with the same bits.
//!
//! ```
//! use mxfp4_kernels::{Kernels, MxFp4Matrix};
//! // One 2x32 matrix: every code 2 (value 1.0), scale byte 127 (2^0).
//! let packed = vec![0x22u8; 2 * 16];
//! let scales = vec![127u8; 2];
//! let w = MxFp4Matrix::new(&packed, &scales, 2, 32).unwrap();
//! let kernels = Kernels::detect();
//! let x = vec![0.5f32; 32];
//! let act = kernels.prepare(&x, 32).unwrap();
//! let mut y = vec![0.0; 2];
//! kernels.matmul_mxfp4(&w, &act, 0..2, &mut y).unwrap();
//! assert_eq!(y, [16.0, 16.0]);
//! ```

#![warn(missing_docs)]

// Layers, each module importing only from those before it:
//   isa, codes -> tier -> error -> view -> packed -> weight, ggml (formats and shapes)
//   -> kernels (the capability token) -> activations -> scalar, x86 (the tiers)
//   -> dispatch (the kernel methods) -> vmath -> situ -> expert.
mod activations;
pub mod codes;
mod dispatch;
mod error;
mod expert;
pub mod ggml;
mod isa;
mod kernels;
pub mod packed;
mod scalar;
pub mod situ;
mod tier;
mod view;
pub mod vmath;
mod weight;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use activations::{Activations, MAX_TOKENS};
pub use error::{Error, Result};
pub use expert::{ExpertScratch, GluActivation};
pub use kernels::Kernels;
pub use packed::{PackedBf16, PackedBf16Matrix, pack_rows_into};
pub use situ::Situ;
pub use tier::Tier;
pub use view::{Bf16Matrix, F16Matrix, F32Matrix, GROUP, GROUP_BYTES, MxFp4Matrix, Q8_0Matrix};
pub use weight::{WeightFormat, WeightMatrix};

// The README's example is compiled and run as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
