//! The exact `avx2` tier: the exact `avx512` tier's arithmetic on 256-bit vectors, for CPUs
//! with avx2, fma and f16c but no AVX-512 (Zen 2/3, most Intel client parts).
//!
//! Same bits as `avx512`, by construction. Each of that tier's 16-lane accumulators is kept here
//! as two 8-lane halves (lanes 0..7 and 8..15), every lane receives the same weight and
//! activation values in the same order (the activations are `avx512`'s `perm32` layout, the
//! weights decoded exactly to the same f32), and each lane's chain is the same sequence of
//! correctly rounded FMAs, so each lane ends with the same bits. The horizontal sum then adds
//! the lanes in `x86::sums::hsum`'s tree (lanes 8 apart, then 4, 2, 1), which `store_sums` (and
//! its `hsum16`) also follow. Row blocks and token groups differ from `avx512` (16 registers, not
//! 32), but no (row, token) result depends on them, as in every tier.
//!
//! Files: `acc` (the two-half accumulator and its sums), one per weight format (`mxfp4`,
//! `float` for BF16/F16/F32, `packed`, `q8_0`), each with its entry points and row kernel.

pub(crate) mod acc;
pub(crate) mod float;
pub(crate) mod mxfp4;
pub(crate) mod packed;
pub(crate) mod q8_0;
