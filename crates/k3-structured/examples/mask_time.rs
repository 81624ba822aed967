//! Measures a checkpoint's constrained-decoding costs: building the [`Vocabulary`], compiling
//! a nested JSON Schema (and a forced tool call), and the per-token mask time over
//! random-logit sequences (greedy and at temperature 1).
//!
//! `cargo run --release -p k3-structured --example mask_time -- CHECKPOINT_DIR [SEQUENCES]`
//! (the directory holds `tiktoken.model`, `tokenizer_config.json` and `config.json`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k3_model::sampling::{Sampler, SamplingParams};
use k3_model::tokenizer::Tokenizer;
use k3_structured::{Grammar, Matcher, Options, Spec, Vocabulary};
use k3_testkit::Rng;
use serde_json::json;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: mask_time CHECKPOINT_DIR [SEQUENCES]")?,
    );
    let sequences: u64 = args.next().map_or(Ok(20), |s| s.parse())?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let n_vocab = config["text_config"]["vocab_size"]
        .as_u64()
        .or(config["vocab_size"].as_u64())
        .ok_or("config.json has no vocab_size")? as usize;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let with_bytes = (0..n_vocab as u32)
        .filter(|&t| !tokenizer.decode_bytes(&[t]).is_empty())
        .count();
    println!("{}: {n_vocab} ids, {with_bytes} with bytes", dir.display());

    let started = Instant::now();
    let vocab = Vocabulary::new(&tokenizer, n_vocab)?;
    println!("vocabulary built in {:?}", started.elapsed());

    // Leanings towards JSON punctuation and special tokens, so sequences end (see the tests).
    let bonus: Vec<f32> = (0..n_vocab as u32)
        .map(|t| match tokenizer.decode_bytes(&[t]).as_slice() {
            b"\"" => 3.5,
            b"}" | b"]" | b"{" | b"[" | b"," | b":" => 2.5,
            [b'0'..=b'9'] => 2.5,
            b if b.starts_with(b"<|") => 3.0,
            _ => 0.0,
        })
        .collect();
    let specs = [
        ("nested schema", Spec::JsonSchema(nested_schema())),
        (
            "tool call",
            Spec::ToolCall {
                name: "get_weather".into(),
                parameters: json!({"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]}
                }, "required": ["city", "unit"], "additionalProperties": false}),
            },
        ),
    ];
    for (name, spec) in &specs {
        for thinking in [false, true] {
            let options = Options {
                thinking,
                ..Options::default()
            };
            let grammar = Grammar::compile(&vocab, spec, &options)?;
            let mut times: Vec<Duration> = Vec::new();
            for temperature in [0.0, 1.0] {
                for seed in 0..sequences {
                    times.extend(run(&grammar, &bonus, temperature, seed)?);
                }
            }
            times.sort();
            let total: Duration = times.iter().sum();
            let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
            println!(
                "{name}, thinking {thinking}: compile {:?}; {} masks: mean {:?}, p50 {:?}, \
                 p99 {:?}, max {:?}",
                grammar.compile_time(),
                times.len(),
                total / times.len().max(1) as u32,
                at(0.5),
                at(0.99),
                at(1.0),
            );
        }
    }
    Ok(())
}

/// One random-logit sequence; the time of each mask computed after the first.
fn run(
    grammar: &Grammar,
    bonus: &[f32],
    temperature: f32,
    seed: u64,
) -> Result<Vec<Duration>, k3_structured::Error> {
    let mut rng = Rng::new(seed);
    let mut matcher = Matcher::new(grammar);
    let params = SamplingParams {
        temperature,
        seed,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params, &[]);
    let mut times = Vec::new();
    let mut logits = vec![0.0f32; bonus.len()];
    for step in 0..4000 {
        if matcher.has_ended() {
            break;
        }
        let before = matcher.mask_time();
        matcher.mask()?;
        if step > 0 {
            times.push(matcher.mask_time() - before);
        }
        let mask = matcher.mask()?;
        for (logit, b) in logits.iter_mut().zip(bonus) {
            *logit = rng.unit() * 2.0 + b;
        }
        let token = sampler.sample_masked(&logits, Some(mask.words())).token;
        matcher.commit(token)?;
    }
    Ok(times)
}

fn nested_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}
                },
                "required": ["city"],
                "additionalProperties": false
            },
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "role", "address"],
        "additionalProperties": false
    })
}
