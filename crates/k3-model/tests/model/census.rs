//! The format census: every stored byte in one (format, class) cell, the cells matching the
//! inventory's classes.

use expert_store::Checkpoint;
use k3_model::checks::{Class, Format, census};
use k3_model::inventory::{BytePlan, TensorClass};
use k3_model::synth::{Preset, SynthOptions, generate};

#[test]
fn census_of_the_tiny_checkpoint_matches_the_byte_plan() {
    let dir = std::env::temp_dir().join(format!("k3-census-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = generate(&dir, &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let cells = census(&ckpt, &cfg);
    let total: u64 = cells.values().map(|c| c.bytes).sum();
    assert_eq!(total, ckpt.data_bytes() as u64);
    let count: usize = cells.values().map(|c| c.tensors).sum();
    assert_eq!(count, ckpt.len());
    let plan = BytePlan::new(&cfg);
    let class = |c: TensorClass| plan.by_class.iter().find(|(k, _)| *k == c).unwrap().1 as u64;
    let cell = |f: Format, c: Class| cells.get(&(f, c)).map_or(0, |c| c.bytes);
    assert_eq!(
        cell(Format::MxFp4, Class::RoutedExperts),
        class(TensorClass::RoutedExperts)
    );
    assert_eq!(
        cell(Format::Bf16, Class::Embedding),
        class(TensorClass::Embedding)
    );
    assert_eq!(
        cell(Format::Bf16, Class::LmHead),
        class(TensorClass::LmHead)
    );
    assert!(cell(Format::Bf16, Class::TrunkLinear) > 0);
    assert!(
        cell(Format::F32, Class::SmallVectors) > 0,
        "A_log, conv taps, biases"
    );
    assert_eq!(cells.keys().filter(|(f, _)| *f == Format::F16).count(), 0);
    assert!(!cells.keys().any(|(_, c)| *c == Class::Unused));
    let _ = std::fs::remove_dir_all(&dir);
}
