//! Integration tests of mxfp4-kernels: every tier against scalar, frozen oracle vectors, edge cases.

mod avx2;
mod common;
mod edges;
mod floats;
mod oracle;
mod packed;
mod q8_0;
mod tiers;
