//! Integration tests of k3-model.

mod budget;
mod census;
mod chat;
mod config;
mod ct_fixture;
mod fla_kda;
mod forward;
mod frozen;
mod inventory;
mod llamacpp;
mod numa;
mod ops;
mod streamed;
mod synth;
mod tokenizer;
