//! Integration tests of k3-model.

mod config;
mod ct_fixture;
mod fla_kda;
mod forward;
mod inventory;
mod llamacpp;
mod ops;
mod synth;
