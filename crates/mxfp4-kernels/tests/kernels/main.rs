//! Integration tests of mxfp4-kernels: every tier against scalar, frozen oracle vectors, edge cases.

mod common;
mod edges;
mod floats;
mod oracle;
mod tiers;
