//! `cargo xtask gen-k3-synth`: writes a synthetic K3 checkpoint in the release's layout (or
//! with its trunk, vectors or chosen linears in other formats: `--trunk-dtype`,
//! `--vector-dtype`, `--mxfp4-linears`), and
//! `cargo xtask set-router-skew` rewrites its router bias (`k3-check` is in `k3_check`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use expert_store::Checkpoint;
use k3_model::config::K3Config;
use k3_model::synth::{
    FloatFormat, Preset, SynthFormats, SynthOptions, generate_with, selection_bias,
};

use crate::{Options, from_root};

pub(crate) fn generate_checkpoint(args: &[String]) -> Result<()> {
    let o = Options::parse(
        args,
        &[
            "preset",
            "out",
            "seed",
            "layers",
            "experts",
            "router-skew",
            "softplus-gate!",
            "trunk-dtype",
            "trunk-f16-values!",
            "vector-dtype",
            "mxfp4-linears",
            "mxfp4-as-bf16!",
        ],
    )?;
    let preset: Preset = o
        .get("preset")
        .context("--preset is required")?
        .parse()
        .map_err(anyhow::Error::msg)?;
    let out: PathBuf = from_root(o.get("out").context("--out DIR is required")?);
    let parse = |name: &str| -> Result<Option<usize>> {
        o.get(name)
            .map(|v| {
                v.parse()
                    .with_context(|| format!("--{name} {v:?} is not a count"))
            })
            .transpose()
    };
    let options = SynthOptions {
        preset,
        seed: parse("seed")?.unwrap_or(0) as u64,
        layers: parse("layers")?,
        experts: parse("experts")?,
        router_skew: o
            .get("router-skew")
            .map(str::parse)
            .transpose()
            .context("--router-skew is a number")?
            .unwrap_or(0.0),
        softplus_gate: o.flag("softplus-gate"),
    };
    let format = |name: &str| -> Result<Option<FloatFormat>> {
        o.get(name)
            .map(|v| v.parse().map_err(anyhow::Error::msg))
            .transpose()
            .with_context(|| format!("--{name}"))
    };
    let formats = SynthFormats {
        trunk: format("trunk-dtype")?.unwrap_or_default(),
        trunk_f16_values: o.flag("trunk-f16-values"),
        vectors: format("vector-dtype")?,
        mxfp4_linears: o
            .get("mxfp4-linears")
            .map(|v| {
                v.split(',')
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
        mxfp4_as_bf16: o.flag("mxfp4-as-bf16"),
    };
    let start = Instant::now();
    let report = generate_with(&out, &options, &formats)?;
    let seconds = start.elapsed().as_secs_f64();
    let layers = report.config.num_layers();
    println!(
        "wrote {} ({:?}, seed {}): {} layers, {} experts per MoE layer, {} shards, {} tensors, {:.3} GB in {seconds:.2} s ({:.2} GB/s)",
        out.display(),
        preset,
        options.seed,
        layers,
        report.config.moe.num_experts,
        report.shards,
        report.tensors,
        report.bytes as f64 / 1e9,
        report.bytes as f64 / 1e9 / seconds,
    );
    for k in 1..=report.shards {
        let file = out.join(format!("model-{k:05}-of-{:06}.safetensors", report.shards));
        let size = std::fs::metadata(&file)
            .with_context(|| file.display().to_string())?
            .len();
        let what = if k <= layers {
            format!("layer {}", k - 1)
        } else {
            "embedding, lm_head, final norms".into()
        };
        println!(
            "  {} {:>14} bytes  ({what})",
            file.file_name().unwrap_or_default().to_string_lossy(),
            size
        );
    }
    Ok(())
}

/// `cargo xtask set-router-skew --model DIR --skew S`: overwrites each MoE layer's
/// `gate.e_score_correction_bias` (F32) in its shard with `selection_bias(S)`, so one large
/// synthetic checkpoint serves both the flat and the skewed cache measurements.
pub(crate) fn set_router_skew(args: &[String]) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let o = Options::parse(args, &["model", "skew"])?;
    let dir = from_root(o.get("model").context("--model DIR is required")?);
    let skew: f32 = o
        .get("skew")
        .context("--skew S is required")?
        .parse()
        .context("--skew is a number")?;
    let config = K3Config::from_json(
        &std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?,
    )?;
    let ckpt = Checkpoint::open(&dir)?;
    let experts = config.moe.num_experts;
    let bias = selection_bias(skew, experts);
    let bytes: Vec<u8> = bias.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut layers = 0;
    for (i, layer) in config.layers.iter().enumerate() {
        if layer.ffn != k3_model::config::FfnKind::Moe {
            continue;
        }
        let name = format!("model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias");
        let t = ckpt.require(&name)?;
        anyhow::ensure!(
            t.dtype == expert_store::Dtype::F32 && t.shape == [experts],
            "{name}: expected F32 [{experts}], found {:?} {:?}",
            t.dtype,
            t.shape
        );
        std::fs::OpenOptions::new()
            .write(true)
            .open(t.path)
            .and_then(|f| f.write_all_at(&bytes, t.offset as u64))
            .with_context(|| format!("writing {name} in {}", t.path.display()))?;
        layers += 1;
    }
    println!(
        "{}: router selection bias set to skew {skew} in {layers} MoE layers ({experts} experts each)",
        dir.display()
    );
    Ok(())
}
