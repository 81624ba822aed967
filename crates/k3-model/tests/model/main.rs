//! Integration tests of k3-model.

mod budget;
mod census;
mod chat;
mod config;
mod ct_fixture;
mod fla_kda;
mod formats;
mod forward;
mod frozen;
mod fuzz;
mod inventory;
mod llamacpp;
mod numa;
mod ops;
mod sampling;
mod rollback;
mod speculate;
mod streamed;
mod synth;
mod tokenizer;
