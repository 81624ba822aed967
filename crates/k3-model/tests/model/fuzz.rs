//! Robustness of loading: random mutations of a valid `tiny` checkpoint — safetensors header
//! bytes and length, tensor dtypes, shapes and data offsets, truncated shards, index entries,
//! config values, tokenizer files and weight bytes — never panic. Each case ends, within a time
//! bound, either in an error or in a model that decodes a few tokens (through the mapping and
//! through the expert store).
//!
//! The mutations are drawn from a fixed-seed generator, so a failure names a reproducible case
//! (`FUZZ_CASE` in the message is the case number).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use expert_store::{Capacity, Checkpoint, ExpertStore, Policy, StoreConfig};
use k3_model::checks::validate;
use k3_model::config::K3Config;
use k3_model::model::Model;
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_model::tokenizer::Tokenizer;
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;
use serde_json::Value;

/// Cases per mutation kind. Eight kinds: about 250 loads of a 3 MB checkpoint, a few seconds.
const CASES_PER_KIND: usize = 32;
/// A case that takes longer than this is a failure: loading the tiny checkpoint and decoding
/// three tokens takes milliseconds, so seconds mean the input drove work out of proportion.
const TIME_BOUND: Duration = Duration::from_secs(20);

/// Loads `dir` the way the engine does and decodes a few tokens, mapped and streamed.
/// `Err` is an orderly refusal; a panic propagates to the caller.
fn load_and_decode(dir: &Path) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let text = std::fs::read_to_string(dir.join("config.json")).map_err(|x| e(&x))?;
    let config = K3Config::from_json(&text).map_err(|x| e(&x))?;
    Tokenizer::from_dir(dir).map_err(|x| e(&x))?;
    let ckpt = Checkpoint::open(dir).map_err(|x| e(&x))?;
    validate(&ckpt, &config).map_err(|x| e(&x))?;
    let kernels = Kernels::detect();
    let tokens = [1usize, 7, config.vocab_size.saturating_sub(1)];
    let model = Model::new(&ckpt, &config, kernels).map_err(|x| e(&x))?;
    let mut session = model.session();
    for &t in &tokens {
        model.decode_step(&mut session, t).map_err(|x| e(&x))?;
    }
    let store = ExpertStore::open(
        &ckpt,
        k3_model::model::expert_layout(&config),
        StoreConfig {
            capacity: Capacity::PerLayer(2),
            policy: Policy::Lru,
            io_threads: 2,
            ..StoreConfig::default()
        },
    )
    .map_err(|x| e(&x))?;
    let model =
        Model::with_expert_store(&ckpt, &config, kernels, Arc::new(store)).map_err(|x| e(&x))?;
    let mut session = model.session();
    for &t in &tokens {
        model.decode_step(&mut session, t).map_err(|x| e(&x))?;
    }
    Ok(())
}

/// A copy of `original` in a fresh directory (files copied, so mutations stay local).
fn copy_of(original: &Path, tag: &str) -> Scratch {
    let dir = Scratch::new(&format!("fuzz-{tag}"));
    for entry in std::fs::read_dir(original).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
}

/// A shard's header JSON and data, split.
fn split_shard(bytes: &[u8]) -> (Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join_shard(header: &Value, data: &[u8]) -> Vec<u8> {
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Every path to a number in a JSON tree.
fn numeric_paths(value: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        Value::Number(_) => out.push(at.clone()),
        Value::Object(map) => {
            for (k, v) in map {
                at.push(k.clone());
                numeric_paths(v, at, out);
                at.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                at.push(i.to_string());
                numeric_paths(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn at_path<'v>(value: &'v mut Value, path: &[String]) -> &'v mut Value {
    path.iter().fold(value, |v, key| match v {
        Value::Array(items) => &mut items[key.parse::<usize>().unwrap()],
        other => &mut other[key.as_str()],
    })
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    HeaderBytes,
    HeaderLength,
    Dtype,
    Shape,
    Offsets,
    Truncate,
    Config,
    IndexAndTokenizer,
    WeightBytes,
}

/// Applies one random mutation of `kind` to `dir`; returns what it did (for the message).
fn mutate(dir: &Path, kind: Kind, rng: &mut fastrand::Rng) -> String {
    let files = shards(dir);
    let shard = rng.choice(&files).unwrap().clone();
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    let bytes = std::fs::read(&shard).unwrap();
    let write = |b: &[u8]| std::fs::write(&shard, b).unwrap();
    match kind {
        Kind::HeaderBytes => {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let mut b = bytes.clone();
            let flips = 1 + rng.usize(..4);
            for _ in 0..flips {
                let at = 8 + rng.usize(..n);
                b[at] = rng.u8(..);
            }
            write(&b);
            format!("{flips} random header bytes of {name}")
        }
        Kind::HeaderLength => {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            let choices = [
                0,
                1,
                n - 1,
                n + 1,
                bytes.len() as u64,
                u64::MAX,
                1 << 40,
                rng.u64(..),
            ];
            let value = *rng.choice(&choices).unwrap();
            let mut b = bytes.clone();
            b[..8].copy_from_slice(&value.to_le_bytes());
            write(&b);
            format!("header length of {name} = {value}")
        }
        Kind::Dtype | Kind::Shape | Kind::Offsets => {
            let (mut header, data) = split_shard(&bytes);
            let names: Vec<String> = header
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "__metadata__")
                .cloned()
                .collect();
            let tensor = rng.choice(&names).unwrap().clone();
            let entry = &mut header[tensor.as_str()];
            let what = match kind {
                Kind::Dtype => {
                    let dtypes = [
                        "F32", "BF16", "F16", "U8", "I8", "F64", "I64", "BOOL", "F8_E4M3", "",
                        "bf16",
                    ];
                    let d = *rng.choice(&dtypes).unwrap();
                    entry["dtype"] = Value::String(d.into());
                    format!("dtype {d:?}")
                }
                Kind::Shape => {
                    let shape = entry["shape"].as_array_mut().unwrap();
                    let choice = rng.usize(..6);
                    match choice {
                        0 if !shape.is_empty() => {
                            let i = rng.usize(..shape.len());
                            shape[i] = 0.into();
                        }
                        1 if !shape.is_empty() => {
                            let i = rng.usize(..shape.len());
                            let v = shape[i].as_u64().unwrap();
                            shape[i] = (v + 1).into();
                        }
                        2 => shape.push(1.into()),
                        3 if !shape.is_empty() => {
                            shape.pop();
                        }
                        4 if !shape.is_empty() => {
                            let i = rng.usize(..shape.len());
                            shape[i] = (1u64 << 40).into();
                        }
                        _ => shape.reverse(),
                    }
                    format!("shape {} (choice {choice})", entry["shape"])
                }
                _ => {
                    let offsets = entry["data_offsets"].as_array_mut().unwrap();
                    let (a, b) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
                    let len = data.len() as u64;
                    let choices = [
                        (b, a),
                        (a, b + 2),
                        (a + 2, b),
                        (a, len + 64),
                        (0, b - a),
                        (a, a),
                        (u64::MAX - 1, u64::MAX),
                        (rng.u64(..=len), rng.u64(..=len)),
                    ];
                    let (x, y) = *rng.choice(&choices).unwrap();
                    *offsets = vec![x.into(), y.into()];
                    format!("data_offsets [{x}, {y}]")
                }
            };
            write(&join_shard(&header, &data));
            format!("{name}: {tensor}: {what}")
        }
        Kind::Truncate => {
            let len = rng.usize(..bytes.len());
            write(&bytes[..len]);
            format!("{name} truncated to {len} of {} bytes", bytes.len())
        }
        Kind::Config => {
            let path = dir.join("config.json");
            let mut config: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let mut paths = Vec::new();
            numeric_paths(&config, &mut Vec::new(), &mut paths);
            let at = rng.choice(&paths).unwrap().clone();
            let choices = [
                Value::from(0),
                Value::from(-1),
                Value::from(1u64 << 40),
                Value::from(u64::MAX),
                Value::from(0.5),
                Value::from(f64::MAX),
                Value::Null,
                Value::from("x"),
                Value::from(3),
            ];
            let value = rng.choice(&choices).unwrap().clone();
            *at_path(&mut config, &at) = value.clone();
            std::fs::write(&path, config.to_string()).unwrap();
            format!("config {} = {value}", at.join("."))
        }
        Kind::IndexAndTokenizer => {
            let choice = rng.usize(..5);
            match choice {
                0 => {
                    // The index names a file that is not there.
                    let path = dir.join("model.safetensors.index.json");
                    let text = std::fs::read_to_string(&path).unwrap();
                    std::fs::write(&path, text.replacen(&name, "missing.safetensors", 1)).unwrap();
                }
                1 => {
                    // An index entry dropped.
                    let path = dir.join("model.safetensors.index.json");
                    let mut index: Value =
                        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                    let map = index["weight_map"].as_object_mut().unwrap();
                    let keys: Vec<String> = map.keys().cloned().collect();
                    map.remove(rng.choice(&keys).unwrap());
                    std::fs::write(&path, index.to_string()).unwrap();
                }
                2 => {
                    let path = dir.join("tiktoken.model");
                    let mut b = std::fs::read(&path).unwrap();
                    for _ in 0..8 {
                        let at = rng.usize(..b.len());
                        b[at] = rng.u8(..);
                    }
                    std::fs::write(&path, b).unwrap();
                }
                3 => {
                    let path = dir.join("tokenizer_config.json");
                    let b = std::fs::read(&path).unwrap();
                    std::fs::write(&path, &b[..rng.usize(..b.len())]).unwrap();
                }
                _ => std::fs::remove_file(dir.join("tiktoken.model")).unwrap(),
            }
            format!("index/tokenizer choice {choice} ({name})")
        }
        Kind::WeightBytes => {
            // Random data bytes: NaN, Inf, E8M0 0xFF scales. Loading may refuse (0xFF scales)
            // or decode non-finite logits; either way nothing panics.
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let mut b = bytes.clone();
            let data = 8 + n;
            for _ in 0..64 {
                if b.len() > data {
                    let at = data + rng.usize(..b.len() - data);
                    let random = rng.u8(..);
                    b[at] = *rng.choice(&[0xffu8, 0x7f, 0x80, 0x00, random]).unwrap();
                }
            }
            write(&b);
            format!("64 data bytes of {name}")
        }
    }
}

#[test]
fn mutated_checkpoints_never_panic() {
    let base = Scratch::new("fuzz-base");
    let original = base.path();
    generate(original, &SynthOptions::new(Preset::Tiny)).unwrap();
    load_and_decode(original).expect("the unmutated checkpoint loads");

    let kinds = [
        Kind::HeaderBytes,
        Kind::HeaderLength,
        Kind::Dtype,
        Kind::Shape,
        Kind::Offsets,
        Kind::Truncate,
        Kind::Config,
        Kind::IndexAndTokenizer,
        Kind::WeightBytes,
    ];
    let mut rng = fastrand::Rng::with_seed(0x6b33_f022_2026_1201);
    let (mut refused, mut loaded) = (0, 0);
    let mut failures = Vec::new();
    for (k, &kind) in kinds.iter().enumerate() {
        for i in 0..CASES_PER_KIND {
            let case = k * CASES_PER_KIND + i;
            let copy = copy_of(original, &case.to_string());
            let what = mutate(copy.path(), kind, &mut rng);
            let start = Instant::now();
            let dir = copy.path().to_path_buf();
            let outcome = std::panic::catch_unwind(move || load_and_decode(&dir));
            let took = start.elapsed();
            match outcome {
                Ok(Ok(())) => loaded += 1,
                Ok(Err(message)) => {
                    assert!(!message.is_empty(), "FUZZ_CASE {case}: an empty error");
                    refused += 1;
                }
                Err(_) => failures.push(format!("FUZZ_CASE {case} ({kind:?}: {what}) panicked")),
            }
            if took > TIME_BOUND {
                failures.push(format!(
                    "FUZZ_CASE {case} ({kind:?}: {what}) took {took:?}, over {TIME_BOUND:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Both outcomes occur: the mutations reach past the first check, and most are refused.
    assert!(
        refused > 0 && loaded > 0,
        "refused {refused}, loaded {loaded}"
    );
}
