//! Integration tests of k3-model.

mod config;
mod ct_fixture;
mod forward;
mod inventory;
mod ops;
mod synth;
