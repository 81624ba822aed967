//! `cargo xtask bench-peers --model DIR [--threads 1,2] [--pairs N] [--tokens N] [--prompt N]
//! [--depth LIST] [--kernel-tier T] [--trunk-format bf16|q8_0|mxfp4] [--no-peer]`: decode and
//! prefill side by side with llama.cpp's Kimi-K3 on the same checkpoint. The checkpoint is
//! converted to GGUF with the trunk in BF16 and the experts repacked to ggml MXFP4 (the same
//! bytes we read), by `gguf_k3` (no Python); then `llama-bench` and our
//! `teacher_forced_decode_bench` alternate, A B A B, at each thread count, and the ratios of
//! each pair are printed with their min / median / max.
//!
//! `--trunk-format q8_0` compares the two engines' Q8_0 trunks: the GGUF is written with
//! `--outtype q8_0` (the set `gguf_k3::Q8_0_SET` in ggml Q8_0, the rest as in the BF16 file;
//! cached as `peer-{name}-q8_0.gguf`) and ours runs with `--trunk-format q8_0`, which
//! requantises the same set at load. `--trunk-format mxfp4` runs ours alone (as `--no-peer`):
//! llama.cpp's converter writes no MXFP4 trunk. The rooflines count the quantised set at its
//! format's size (`trunk_saving`). `--no-peer` runs ours alone in either mode.
//!
//! Every figure gets its roofline: weight bytes per token x tokens/s / the read bandwidth
//! measured next to it (our bench probes between its own steps; for llama.cpp this probes
//! right after each run, with the same number of pinned threads). A prefill's weight bytes
//! are the least any engine must read for the prompt: the trunk once and every distinct
//! expert it can touch (`min(experts, prompt x top_k)` per MoE layer), so its roofline shows
//! how far a compute-bound prefill sits from the bandwidth floor.
//!
//! `--memory-gb G[,..]` or `--memory-fraction F[,..]` (of the model size) instead runs both
//! engines' decode inside memory cgroups of each budget (see `bench_memory`).
//!
//! `--depth 0,4096,16384,65536` instead runs both at each context depth: decode of `--tokens`
//! and prefill of `--prompt` tokens after the depth, prefilled untimed (ours `--depth`,
//! llama-bench `-d`), in alternating pairs, with a table of tokens/s and ratios per depth (see
//! `depth`).
//!
//! `--kernels` instead compares the GEMV kernels with ggml's (see `peer_kernels`).

mod depth;
mod engines;
mod weight_bytes;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::gguf_k3_meta::Outtype;
use crate::oracle::run_checked;
use crate::oracle_llamacpp::{WORK_DIR, build_llama_bench, fetch_sdist};
use crate::{Options, from_root};
use depth::{DepthRun, parse_depths};
use engines::{Test, fresh, llama, our_decode, our_prefill};
use k3_model::K3Config;
use k3_model::inventory::BytePlan;
use weight_bytes::{TrunkFormat, prompt_bytes, trunk_saving};

pub(crate) fn run(args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == "--kernels") {
        let rest: Vec<String> = args.iter().filter(|a| *a != "--kernels").cloned().collect();
        return crate::peer_kernels::run(&rest);
    }
    let o = Options::parse(
        args,
        &[
            "model",
            "threads",
            "pairs",
            "tokens",
            "prompt",
            "kernel-tier",
            "memory-gb",
            "memory-fraction",
            "no-peer!",
            "trunk-format",
            "depth",
        ],
    )?;
    let depths = o.get("depth").map(parse_depths).transpose()?;
    let mut extra: Vec<String> = match o.get("kernel-tier") {
        Some(t) => vec!["--kernel-tier".into(), t.into()],
        None => Vec::new(),
    };
    let trunk = TrunkFormat::parse(o.get("trunk-format").unwrap_or("bf16"))?;
    if trunk != TrunkFormat::Bf16 {
        extra.extend(["--trunk-format".to_string(), trunk.name().into()]);
    }
    let no_peer = o.flag("no-peer") || trunk == TrunkFormat::MxFp4;
    if trunk == TrunkFormat::MxFp4 {
        println!(
            "--trunk-format mxfp4: our engine alone, as --no-peer (llama.cpp's converter writes no MXFP4 trunk)"
        );
    }
    let model = from_root(o.get("model").context("--model DIR is required")?);
    let threads: Vec<usize> = o
        .get("threads")
        .unwrap_or("1,2")
        .split(',')
        .map(|t| t.trim().parse().context("--threads is a list of counts"))
        .collect::<Result<_>>()?;
    let number = |name: &str, default: usize| -> Result<usize> {
        o.get(name)
            .map(|v| v.parse().with_context(|| format!("--{name} is a count")))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let (pairs, tokens, prompt) = (
        number("pairs", 3)?,
        number("tokens", 32)?,
        number("prompt", 64)?,
    );
    let work = from_root(WORK_DIR);
    std::fs::create_dir_all(&work)?;
    if o.get("memory-gb").is_some() || o.get("memory-fraction").is_some() {
        if depths.is_some() {
            bail!("--depth does not combine with --memory-gb or --memory-fraction");
        }
        let run = MemoryRun {
            ours_args: extra,
            no_peer,
            outtype: trunk.outtype(),
            threads,
            pairs,
            tokens,
        };
        return memory_mode(&o, &model, &work, run);
    }
    // llama-bench and the GGUF, unless ours runs alone.
    let peer = match no_peer {
        true => {
            if trunk != TrunkFormat::MxFp4 {
                println!("--no-peer: our engine alone");
            }
            None
        }
        false => {
            let source = fetch_sdist(&work)?;
            let llama_bench = build_llama_bench(&work, &source)?;
            Some((llama_bench, convert(&work, &model, trunk.outtype())?))
        }
    };
    let ours = build_ours()?;
    let config = K3Config::from_json(
        &std::fs::read_to_string(model.join("config.json")).context("reading config.json")?,
    )?;
    let plan = BytePlan::new(&config);
    let saving = trunk_saving(&config, trunk);
    // A checkpoint that fits in RAM is served from RAM the way a user would run it: trunk and
    // every expert copied once into huge-page memory (`--resident-trunk`, a full expert cache,
    // preloaded), not read through 4 KiB file mappings. llama.cpp does the same with its
    // experts by default (it repacks MXFP4 weights into its own buffers at load). A lossy
    // trunk format holds its requantised matrices resident anyway, and our bench refuses
    // `--resident-trunk` beside it (it would copy them as stored).
    let available = expert_store::io::memory_available().unwrap_or(0) as usize;
    let resident = plan.text_bytes < available / 10 * 6;
    if resident {
        if trunk == TrunkFormat::Bf16 {
            extra.push("--resident-trunk".into());
        }
        extra.extend([
            "--expert-cache".to_string(),
            config.moe.num_experts.to_string(),
            "--preload-experts".into(),
            "--no-usage-cache".into(),
        ]);
    }
    let tier = &extra[..];
    let per_token = (plan.bytes_per_token - saving) as f64;
    let per_prompt = (prompt_bytes(&config, &plan, prompt) - saving) as f64 / prompt as f64;
    println!(
        "ours: {}",
        match (resident, trunk) {
            (true, TrunkFormat::Bf16) => "trunk and experts resident in huge pages",
            (true, _) => "trunk requantised at load, experts resident in huge pages",
            (false, _) =>
                "trunk mapped, experts streamed (the checkpoint does not fit in 60% of free memory)",
        }
    );
    println!(
        "model {} ({}), trunk {}, {pairs} pairs, {tokens} generated tokens, {prompt}-token prompts; weights read: {:.3} GB per decoded token, at least {:.3} GB per prompt token",
        model.display(),
        peer.as_ref()
            .map_or("no peer".into(), |(_, gguf)| gguf.display().to_string()),
        trunk.name(),
        per_token / 1e9,
        per_prompt / 1e9,
    );
    let ours_files = shard_files(&model)?;
    if let Some(depths) = &depths {
        return depth::run(&DepthRun {
            ours: &ours,
            model: &model,
            peer: peer.as_ref().map(|(b, g)| (b.as_path(), g.as_path())),
            tier,
            threads: &threads,
            depths,
            pairs,
            tokens,
            prompt,
            max_positions: config.max_position_embeddings,
            ours_files: &ours_files,
        });
    }
    let buffer = benches::bandwidth_buffer(512 << 20);
    for &t in &threads {
        let pool = benches::Pool::new(t)?;
        // The median of three reads of the 512 MiB buffer.
        let probe = || {
            let mut reads: Vec<f64> = (0..3).map(|_| benches::read_rate(&pool, &buffer)).collect();
            reads.sort_by(f64::total_cmp);
            reads[1]
        };
        // Two 10 GB copies of a real-width slice (safetensors and GGUF) do not both fit in the
        // page cache next to a resident model in 24 GiB: each engine's run would then evict
        // the other's file and reclaim pages while the next one runs. So before each run the
        // other engine's file leaves the page cache, and the machine settles for a second.
        let ggufs: Vec<PathBuf> = peer.iter().map(|(_, gguf)| gguf.clone()).collect();
        probe(); // faults the buffer in
        let roof = |rate: f64, bytes: f64, read: f64| 100.0 * rate * bytes / read;
        // Per pair: the decode and prefill ratios, each engine's decode roofline, and the ratio
        // of the rooflines (tokens/s each normalised by the read probed next to it: robust to
        // the host changing phase between the two runs of a pair). Alone: our decode and
        // prefill tokens/s and decode roofline.
        let mut rows: Vec<Vec<f64>> = Vec::new();
        for pair in 0..pairs {
            let Some((llama_bench, gguf)) = &peer else {
                let (our_tg, our_tg_read) = our_decode(&ours, &model, t, (tokens, 0), tier)?;
                let before = probe();
                let our_pp = our_prefill(&ours, &model, t, (prompt, 0), tier)?;
                let our_pp_read = (before + probe()) / 2.0;
                println!(
                    "threads {t} run {pair}: decode ours {our_tg:.2} tok/s ({:.0}% of {:.1} GB/s read); prefill ours {our_pp:.1} tok/s ({:.1}% of {:.1})",
                    roof(our_tg, per_token, our_tg_read),
                    our_tg_read / 1e9,
                    roof(our_pp, per_prompt, our_pp_read),
                    our_pp_read / 1e9,
                );
                rows.push(vec![our_tg, our_pp, roof(our_tg, per_token, our_tg_read)]);
                continue;
            };
            // The host's read bandwidth drifts between phases within seconds: llama.cpp's runs
            // are judged by the mean of a probe just before and just after.
            fresh(&ours_files)?;
            let before = probe();
            let peer_tg = llama(llama_bench, gguf, t, Test::decode(tokens, 0))?;
            let peer_tg_read = (before + probe()) / 2.0;
            fresh(&ggufs)?;
            let (our_tg, our_tg_read) = our_decode(&ours, &model, t, (tokens, 0), tier)?;
            fresh(&ours_files)?;
            let before = probe();
            let peer_pp = llama(llama_bench, gguf, t, Test::prefill(prompt, 0))?;
            let peer_pp_read = (before + probe()) / 2.0;
            fresh(&ggufs)?;
            let our_pp = our_prefill(&ours, &model, t, (prompt, 0), tier)?;
            let our_pp_read = (peer_pp_read + probe()) / 2.0;
            println!(
                "threads {t} pair {pair}: decode ours {our_tg:.2} tok/s ({:.0}% of {:.1} GB/s read) vs llama.cpp {peer_tg:.2} tok/s ({:.0}% of {:.1}) = {:.2}x; prefill ours {our_pp:.1} tok/s ({:.1}% of {:.1}) vs {peer_pp:.1} tok/s ({:.1}% of {:.1}) = {:.2}x",
                roof(our_tg, per_token, our_tg_read),
                our_tg_read / 1e9,
                roof(peer_tg, per_token, peer_tg_read),
                peer_tg_read / 1e9,
                our_tg / peer_tg,
                roof(our_pp, per_prompt, our_pp_read),
                our_pp_read / 1e9,
                roof(peer_pp, per_prompt, peer_pp_read),
                peer_pp_read / 1e9,
                our_pp / peer_pp
            );
            rows.push(vec![
                our_tg / peer_tg,
                our_pp / peer_pp,
                roof(our_tg, per_token, our_tg_read),
                roof(peer_tg, per_token, peer_tg_read),
                roof(our_tg, per_token, our_tg_read) / roof(peer_tg, per_token, peer_tg_read),
            ]);
        }
        let columns: &[&str] = match peer {
            Some(_) => &[
                "decode: ours / llama.cpp",
                "prefill: ours / llama.cpp",
                "decode: ours, % of read",
                "decode: llama.cpp, % of read",
                "decode: ours / llama.cpp, each per GB/s of read",
            ],
            None => &[
                "decode: ours, tok/s",
                "prefill: ours, tok/s",
                "decode: ours, % of read",
            ],
        };
        for (i, what) in columns.iter().enumerate() {
            let mut v: Vec<f64> = rows.iter().map(|r| r[i]).collect();
            v.sort_by(f64::total_cmp);
            println!(
                "threads {t} {what}: min {:.2} median {:.2} max {:.2}",
                v[0],
                v[v.len() / 2],
                v[v.len() - 1]
            );
        }
    }
    Ok(())
}

/// What `--memory-gb` / `--memory-fraction` runs besides the budgets.
struct MemoryRun {
    /// Ours' extra arguments (kernel tier, trunk format).
    ours_args: Vec<String>,
    no_peer: bool,
    /// The peer GGUF's trunk.
    outtype: Outtype,
    threads: Vec<usize>,
    pairs: usize,
    tokens: usize,
}

/// `--memory-gb` / `--memory-fraction`: both engines in memory cgroups (`bench_memory`).
fn memory_mode(o: &Options, model: &Path, work: &Path, run: MemoryRun) -> Result<()> {
    let (bytes, embedding) = crate::bench_memory::model_size(model)?;
    let size = bytes - embedding;
    println!(
        "model size (the decode's working set): {:.3} GB = {:.3} GB of tensors less the {:.3} GB embedding table",
        size as f64 / 1e9,
        bytes as f64 / 1e9,
        embedding as f64 / 1e9
    );
    let budgets = crate::bench_memory::budgets(o.get("memory-gb"), o.get("memory-fraction"), size)?;
    let mut files = shard_files(model)?;
    let peer = if run.no_peer {
        println!("--no-peer: our engine alone");
        None
    } else {
        let source = fetch_sdist(work)?;
        let bench = build_llama_bench(work, &source)?;
        let gguf = convert(work, model, run.outtype)?;
        files.push(gguf.clone());
        Some((bench, gguf))
    };
    let engines = crate::bench_memory::Engines {
        ours: build_ours()?,
        ours_args: run.ours_args,
        peer,
    };
    let sweep = crate::bench_memory::Sweep {
        budgets,
        threads: run.threads,
        pairs: run.pairs,
        tokens: run.tokens,
    };
    crate::bench_memory::run(model, &engines, &sweep, &files)
}

/// Our decode bench, built in release.
fn build_ours() -> Result<PathBuf> {
    build_bench_bin("teacher_forced_decode_bench")
}

/// One of k3-bench's binaries, built in release; its path.
pub(crate) fn build_bench_bin(name: &str) -> Result<PathBuf> {
    run_checked(Command::new("cargo").args([
        "build",
        "--release",
        "-p",
        "k3-bench",
        "--bin",
        name,
    ]))?;
    Ok(from_root(&format!("target/release/{name}")))
}

/// The checkpoint's safetensors shards.
fn shard_files(model: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(model).with_context(|| model.display().to_string())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            files.push(path);
        }
    }
    Ok(files)
}

/// The GGUF of `model` (experts ggml MXFP4; trunk BF16, or the Q8_0 set in Q8_0 for
/// `Outtype::Q8_0`), converted once per directory and outtype by the torch-free writer
/// (`gguf_k3`), as `peer-{name}-{bf16|q8_0}.gguf`; a file there is complete (it is renamed into
/// place).
pub(crate) fn convert(work: &Path, model: &Path, outtype: Outtype) -> Result<PathBuf> {
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .context("the model directory has no name")?;
    let suffix = match outtype {
        Outtype::Bf16 => "bf16",
        Outtype::Q8_0 => "q8_0",
        Outtype::F32 => "f32",
    };
    let gguf = work.join(format!("peer-{name}-{suffix}.gguf"));
    if !gguf.exists() {
        let started = std::time::Instant::now();
        let c = crate::gguf_k3::convert(model, &gguf, outtype)
            .with_context(|| format!("converting {} to gguf", model.display()))?;
        println!(
            "converted {} to {} ({} tensors, {:.3} GB) in {:.1} s",
            model.display(),
            gguf.display(),
            c.tensors,
            c.bytes as f64 / 1e9,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(gguf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_model::inventory::text_tensors;

    #[test]
    fn the_q8_0_saving_is_what_the_q8_0_gguf_saves() {
        use k3_model::synth::{Preset, SynthOptions, generate};
        let dir = std::env::temp_dir().join(format!("k3-peer-q8-{}", std::process::id()));
        let model = dir.join("tiny");
        let report = generate(&model, &SynthOptions::new(Preset::Tiny)).unwrap();
        let work = dir.join("work");
        std::fs::create_dir_all(&work).unwrap();
        let gguf = convert(&work, &model, Outtype::Q8_0).unwrap();
        assert!(gguf.ends_with("peer-tiny-q8_0.gguf"));
        let parsed = crate::gguf::tests::parse(&std::fs::read(&gguf).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        // The tiny trunk is BF16: each Q8_0 tensor saves 2 - 34/32 bytes per weight.
        let saved: u64 = parsed
            .tensors
            .iter()
            .filter(|(_, _, ty, _)| *ty == 8)
            .map(|(_, ne, _, _)| {
                ne.iter().product::<u64>() * 2 - ne.iter().product::<u64>() / 32 * 34
            })
            .sum();
        assert!(saved > 0);
        let config = &report.config;
        assert_eq!(trunk_saving(config, TrunkFormat::Q8_0) as u64, saved);
        assert_eq!(trunk_saving(config, TrunkFormat::Bf16), 0);
        // MXFP4: 17 bytes per 32 weights instead of 34.
        let weights = saved * 32 / (64 - 34);
        let mxfp4 = trunk_saving(config, TrunkFormat::MxFp4) as u64;
        assert_eq!(mxfp4, weights * (64 - 17) / 32);
    }

    #[test]
    fn the_q8_0_set_is_the_one_our_engine_requantises() {
        use k3_model::plan::{QuantFormat, TrunkFormat as Engine, WeightSizes};
        use k3_model::synth::{Preset, SynthOptions, generate};
        let dir = std::env::temp_dir().join(format!("k3-peer-set-{}", std::process::id()));
        let report = generate(&dir, &SynthOptions::new(Preset::Tiny)).unwrap();
        let ckpt = expert_store::Checkpoint::open(&dir).unwrap();
        let sizes = WeightSizes::new(&ckpt, &report.config)
            .unwrap()
            .with_trunk_format(Engine::Q8_0 { all: false });
        let mut engine: Vec<String> = sizes
            .read_tensors()
            .filter(|(_, t)| t.quant == Some(QuantFormat::Q8_0))
            .map(|(_, t)| t.name.trim_start_matches("language_model.").to_owned())
            .collect();
        let mut ours: Vec<String> = text_tensors(&report.config)
            .into_iter()
            .map(|t| t.name)
            .filter(|name| crate::gguf_k3::q8_0_source(name))
            .collect();
        engine.sort();
        engine.dedup(); // row blocks of one matrix
        ours.sort();
        assert!(!ours.is_empty());
        assert_eq!(engine, ours);
        // And the bytes a token saves are the engine's count of them.
        let (stored, held) = sizes.requantised_bytes();
        let saving = trunk_saving(&report.config, TrunkFormat::Q8_0) as u64;
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(stored - held, saving);
    }

    #[test]
    fn a_built_llama_bench_is_reused_without_cmake() {
        let work = std::env::temp_dir().join(format!("k3-peer-bench-{}", std::process::id()));
        let bin = work.join(crate::oracle_llamacpp::BUILD_DIR).join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("llama-bench"), b"").unwrap();
        // A source directory that does not exist: configuring or building would fail.
        let found = build_llama_bench(&work, Path::new("/nonexistent/llama.cpp"));
        std::fs::remove_dir_all(&work).unwrap();
        assert_eq!(found.unwrap(), bin.join("llama-bench"));
    }
}
