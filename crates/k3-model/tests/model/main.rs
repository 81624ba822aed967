//! Integration tests of k3-model.

mod config;
mod inventory;
mod synth;
