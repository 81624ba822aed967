//! `cargo xtask oracle-ct-checkpoint`: freezes a small K3 checkpoint whose routed experts were
//! packed by the independent PyPI package compressed-tensors, with their ml_dtypes decode, so
//! the k3-model tests can show that such a checkpoint loads and decodes bit for bit.
//!
//! Our generator writes the checkpoint; `xtask/oracle/ct_checkpoint.py` swaps every expert's
//! six tensors for compressed-tensors' packing of fresh random weights and writes one
//! `model.safetensors` in release order plus `expected.json`. Before anything replaces the
//! committed fixture, this checks that the result is our checkpoint with only the experts
//! changed, valid for our loader. The references need torch, so this never runs in `cargo test`.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use expert_store::Checkpoint;
use k3_model::checks::validate;
use k3_model::config::{FfnKind, K3Config};
use k3_model::inventory::{TensorClass, text_tensors};
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;

use crate::oracle::{
    DEFAULT_VENV, PINNED, publish_staged, relative, run_checked, staging_dir, venv_with,
};
use crate::{Options, command_line, from_root};

/// The reader the script checks its output with; pinned like the other references.
const EXTRA_PINS: [&str; 1] = ["safetensors==0.8.0"];
const SCRIPT: &str = "xtask/oracle/ct_checkpoint.py";
const DEFAULT_OUT: &str = "crates/k3-model/tests/data/ct_tiny";
/// Seed of the random expert weights; changing it changes the fixture.
const SEED: u64 = 0x004B_33C7;
/// The generated checkpoint the experts are swapped into: 2 layers, so layer 1 is the only
/// MoE layer, with 4 experts, which keeps the fixture near 1 MB.
const SYNTH_PRESET: &str = "tiny";
const SYNTH_SEED: u64 = 11;
const SYNTH_LAYERS: usize = 2;
const SYNTH_EXPERTS: usize = 4;
/// What the fixture directory holds, the first three written by this command's steps.
const FIXTURE_FILES: [&str; 3] = ["config.json", "model.safetensors", "expected.json"];
/// The files with a `.sha256` sidecar (config.json is checked by parsing it).
const HASHED_FILES: [&str; 2] = ["model.safetensors", "expected.json"];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(args, &["venv", "out"])?;
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let command = command_line("oracle-ct-checkpoint", args);

    let python = venv_with(&venv, &[&PINNED[..], &EXTRA_PINS[..]].concat())?;

    let synth = Scratch::try_new("ct-synth").context("cannot make a scratch directory")?;
    let synth_options = SynthOptions {
        preset: SYNTH_PRESET.parse::<Preset>().map_err(anyhow::Error::msg)?,
        seed: SYNTH_SEED,
        layers: Some(SYNTH_LAYERS),
        experts: Some(SYNTH_EXPERTS),
        router_skew: 0.0,
        softplus_gate: false,
    };
    let report =
        generate(synth.path(), &synth_options).context("generating the base checkpoint")?;
    let provenance = serde_json::json!({
        "generator": "k3_model::synth::generate",
        "preset": SYNTH_PRESET,
        "seed": SYNTH_SEED,
        "layers": SYNTH_LAYERS,
        "experts": SYNTH_EXPERTS,
        "router_skew": synth_options.router_skew,
    });

    let partial = staging_dir(&out)?;
    fs::copy(
        synth.path().join("config.json"),
        partial.join("config.json"),
    )
    .context("cannot copy config.json")?;

    let mut script = Command::new(&python);
    script
        .arg(from_root(SCRIPT))
        .arg("--synth")
        .arg(synth.path())
        .args(["--synth-options", &provenance.to_string()])
        .args(["--seed", &SEED.to_string(), "--command", &command, "--out"])
        .arg(&partial);
    run_checked(&mut script)?;

    let versions = check_fixture(synth.path(), &partial, &report.config)
        .with_context(|| format!("bad fixture in {}", partial.display()))?;
    let digests = publish_staged(&partial, &out, &FIXTURE_FILES, &HASHED_FILES)?;

    println!("command:  {command}");
    println!(
        "base:     k3_model::synth::generate {SYNTH_PRESET}, seed {SYNTH_SEED}, \
         {SYNTH_LAYERS} layers, {SYNTH_EXPERTS} experts"
    );
    for file in FIXTURE_FILES {
        let path = out.join(file);
        let size = fs::metadata(&path)
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        println!("wrote:    {} ({size} bytes)", relative(&path));
    }
    for (file, digest) in digests {
        println!("sha256:   {digest}  {file}");
    }
    println!("packages: {versions}");
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Checks the script's output against the generated checkpoint: a valid K3 checkpoint for our
/// loader, the same tensors (name, dtype, shape) with the same bytes except the routed experts,
/// data in lexicographic name order and back to back, and an `expected.json` that covers every
/// expert matrix with the right number of values. Returns the recorded package versions.
fn check_fixture(synth_dir: &Path, fixture_dir: &Path, config: &K3Config) -> Result<String> {
    let synth = Checkpoint::open(synth_dir)?;
    let fixture = Checkpoint::open(fixture_dir)?;
    let text = fs::read_to_string(fixture_dir.join("config.json"))?;
    ensure!(
        &K3Config::from_json(&text)? == config,
        "config.json does not parse to the generator's config"
    );
    validate(&fixture, config)?;

    let specs = text_tensors(config);
    ensure!(
        fixture.len() == specs.len() && synth.len() == specs.len(),
        "expected {} tensors, the generator wrote {} and the fixture holds {}",
        specs.len(),
        synth.len(),
        fixture.len()
    );
    let mut replaced = 0;
    let mut ranges = Vec::with_capacity(specs.len());
    for spec in &specs {
        let before = synth.require(&spec.name)?;
        let after = fixture.require(&spec.name)?;
        ensure!(
            after.name == before.name && after.dtype == before.dtype && after.shape == before.shape,
            "{}: stored as {} {:?} {:?}, generated as {} {:?} {:?}",
            spec.name,
            after.name,
            after.dtype,
            after.shape,
            before.name,
            before.dtype,
            before.shape
        );
        if spec.class == TensorClass::RoutedExperts {
            // Fresh random weights: identical packed bytes would mean nothing was replaced.
            ensure!(
                !spec.name.ends_with("weight_packed") || after.bytes != before.bytes,
                "{}: packed bytes equal the generator's",
                spec.name
            );
            replaced += 1;
        } else {
            ensure!(
                after.bytes == before.bytes,
                "{}: bytes differ from the generator's",
                spec.name
            );
        }
        ranges.push((after.name.to_owned(), after.offset, after.bytes.len()));
    }
    ranges.sort();
    for pair in ranges.windows(2) {
        let ((first, start, len), (next, next_start, _)) = (&pair[0], &pair[1]);
        ensure!(
            start + len == *next_start,
            "{next} starts at byte {next_start}, not right after {first} (which ends at {})",
            start + len
        );
    }

    let moe_layers: Vec<usize> = (0..config.num_layers())
        .filter(|&i| config.layers[i].ffn == FfnKind::Moe)
        .collect();
    let n_experts = moe_layers.len() * config.moe.num_experts;
    ensure!(
        replaced == 6 * n_experts,
        "{replaced} expert tensors replaced, expected 6 for each of {n_experts} experts"
    );
    let table = fixture.expert_table(&k3_model::inventory::expert_layout(config))?;
    ensure!(
        table.len() == n_experts && table.values().all(|l| l.contiguous),
        "expected {n_experts} experts each stored contiguously, found {} ({} contiguous)",
        table.len(),
        table.values().filter(|l| l.contiguous).count()
    );

    let bytes = fs::read(fixture_dir.join("expected.json"))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).context("expected.json is not json")?;
    let matrices = json["matrices"]
        .as_array()
        .context("expected.json has no matrices list")?;
    let io = config.moe.expert_io(config.hidden_size);
    let inter = config.moe.expert_intermediate;
    let mut wanted: BTreeSet<(String, usize, usize)> = BTreeSet::new();
    for &layer in &moe_layers {
        for expert in 0..config.moe.num_experts {
            let base = format!("model.layers.{layer}.block_sparse_moe.experts.{expert}");
            wanted.insert((format!("{base}.w1"), inter, io));
            wanted.insert((format!("{base}.w2"), io, inter));
            wanted.insert((format!("{base}.w3"), inter, io));
        }
    }
    let mut found = BTreeSet::new();
    for matrix in matrices {
        let name = matrix["name"].as_str().context("a matrix without a name")?;
        let rows = matrix["rows"]
            .as_u64()
            .with_context(|| format!("{name}: no rows"))? as usize;
        let cols = matrix["cols"]
            .as_u64()
            .with_context(|| format!("{name}: no cols"))? as usize;
        let hex = matrix["dequant_f32_bits"]
            .as_str()
            .with_context(|| format!("{name}: no dequant_f32_bits"))?;
        ensure!(
            hex.len() == rows * cols * 8,
            "{name}: dequant_f32_bits holds {} hex digits, expected {} for {rows}x{cols}",
            hex.len(),
            rows * cols * 8
        );
        fixture.mxfp4_matrix(name, rows, cols)?;
        ensure!(
            found.insert((name.to_owned(), rows, cols)),
            "{name} listed twice"
        );
    }
    ensure!(
        found == wanted,
        "expected.json covers {} matrices, the config implies {}",
        found.len(),
        wanted.len()
    );

    let versions = json["packages"]
        .as_object()
        .context("expected.json records no package versions")?;
    Ok(versions
        .iter()
        .map(|(name, version)| format!("{name}=={}", version.as_str().unwrap_or("?")))
        .collect::<Vec<_>>()
        .join(" "))
}
