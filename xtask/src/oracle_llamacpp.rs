//! `cargo xtask oracle-llamacpp`: freezes llama.cpp's Kimi-K3 logits for a synthetic checkpoint
//! as an independent reference for our forward pass.
//!
//! llama.cpp is the only complete CPU implementation of K3; it ships inside the
//! llama-cpp-python source distribution. This fetches that sdist (sha256 pinned), builds only
//! `libllama` plus our harness `xtask/oracle/llamacpp_logits.cpp`, converts a *dense twin* of the
//! checkpoint to GGUF (by default with the torch-free `gguf_k3` writer; `--converter python`
//! runs the vendored `convert_hf_to_gguf.py` instead), and records the logits of every position.
//!
//! The twin differs from the checkpoint only where llama.cpp would otherwise compute something
//! else (docs/ORACLE_LLAMACPP.md):
//! - every routed expert is its exact dequantised F32 weight, because llama.cpp's MXFP4 matmul
//!   quantises activations to Q8_0;
//! - MLA layers get zero heads up to the KDA head count, because llama.cpp's K3 graph takes both
//!   head counts from `num_attention_heads`. A zero head adds exact zeros to the output.
//!
//! The slow parts (sdist, cmake build, and torch for the Python converter) are cached under
//! `target/llamacpp` and the venv.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use k3_model::synth::{Preset, SynthOptions, generate};

use crate::llamacpp_twin::write_dense_twin;

use crate::oracle::{
    DEFAULT_VENV, PINNED, publish_staged, relative, run_checked, sha256_hex, staging_dir, venv_with,
};
use crate::{Options, command_line, from_root};

const PACKAGE: &str = "llama-cpp-python";
const VERSION: &str = "0.3.36";
pub(crate) const SDIST: &str = "llama_cpp_python-0.3.36.tar.gz";
/// The sdist's sha256 as PyPI listed it when this was written; PyPI's answer must still agree.
pub(crate) const SDIST_SHA256: &str =
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";
const PYPI_SIMPLE: &str = "https://pypi.org/simple/llama-cpp-python/";
/// Everything built or fetched lives here; nothing under it is committed.
pub(crate) const WORK_DIR: &str = "target/llamacpp";
/// The one cmake build directory under `WORK_DIR`: `libllama` for the harness, `llama-bench`.
pub(crate) const BUILD_DIR: &str = "build";
const CONVERT_SCRIPT: &str = "xtask/oracle/llamacpp_convert.py";
const HARNESS_SOURCE: &str = "xtask/oracle/llamacpp_logits.cpp";
const DEFAULT_OUT: &str = "crates/k3-model/tests/data/llamacpp_tiny";
/// The converter imports transformers (pulled in by compressed-tensors) and reads safetensors.
const EXTRA_PINS: [&str; 1] = ["safetensors==0.8.0"];
const SYNTH_PRESET: &str = "tiny";
const SYNTH_SEED: u64 = 1;
/// 20 ids below the tiny vocabulary (1024), spread over it, with one repeat (so attention sees
/// a key twice); fixed so that regenerating reproduces the committed logits.
const DEFAULT_TOKENS: [u32; 20] = [
    1, 17, 512, 3, 999, 256, 42, 768, 7, 1000, 128, 64, 901, 33, 17, 640, 5, 300, 1023, 2,
];
const THREADS: &str = "2";
/// The harness's limit on step-by-step vs batch logits (relative to a row's largest |logit|):
/// exact paths agree to ~1e-5. With MXFP4 experts ggml quantises the activations to Q8_0 and
/// its batch and one-token matmuls round differently: 1.6% was measured on tiny, so the
/// `--mxfp4-experts` check only catches a broken run, not numerics.
const STEP_VS_BATCH: f64 = 1e-4;
const STEP_VS_BATCH_MXFP4: f64 = 0.05;
const OUT_FILES: [&str; 2] = ["logits.f32", "manifest.json"];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let started = Instant::now();
    let options = Options::parse(
        args,
        &[
            "model",
            "out",
            "tokens",
            "venv",
            "converter",
            "mxfp4-experts!",
            "softplus-gate!",
        ],
    )?;
    let python_converter = match options.get("converter").unwrap_or("rust") {
        "rust" => false,
        "python" => true,
        other => bail!("--converter {other:?} is not rust or python"),
    };
    let softplus_gate = options.flag("softplus-gate");
    let out = from_root(options.get("out").unwrap_or(DEFAULT_OUT));
    let venv = from_root(options.get("venv").unwrap_or(DEFAULT_VENV));
    let tokens = match options.get("tokens") {
        Some(list) => parse_tokens(list)?,
        None => DEFAULT_TOKENS.to_vec(),
    };
    let command = command_line("oracle-llamacpp", args);
    let work = from_root(WORK_DIR);
    fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let mut timings: Vec<(&str, f64)> = Vec::new();
    let mut step = Instant::now();
    let mut lap = |name: &'static str, timings: &mut Vec<(&str, f64)>| {
        timings.push((name, step.elapsed().as_secs_f64()));
        step = Instant::now();
    };

    let source = fetch_sdist(&work)?;
    lap("fetch", &mut timings);
    let harness = build_llamacpp(&work, &source)?;
    lap("build", &mut timings);

    let (model_dir, generator) = match options.get("model") {
        Some(dir) => (from_root(dir), serde_json::json!({ "given": dir })),
        None => {
            let dir = work.join(SYNTH_PRESET);
            if dir.exists() {
                fs::remove_dir_all(&dir)
                    .with_context(|| format!("cannot remove stale {}", dir.display()))?;
            }
            let synth = SynthOptions {
                preset: SYNTH_PRESET.parse::<Preset>().map_err(anyhow::Error::msg)?,
                seed: SYNTH_SEED,
                layers: None,
                experts: None,
                router_skew: 0.0,
                softplus_gate,
            };
            generate(&dir, &synth).context("generating the tiny checkpoint")?;
            let generator = serde_json::json!({
                "generator": "k3_model::synth::generate",
                "command": format!(
                    "cargo xtask gen-k3-synth --preset {SYNTH_PRESET} --seed {SYNTH_SEED}{} --out DIR",
                    if softplus_gate { " --softplus-gate" } else { "" }
                ),
                "preset": SYNTH_PRESET,
                "seed": SYNTH_SEED,
                "layers": null,
                "experts": null,
                "router_skew": synth.router_skew,
                "softplus_gate": softplus_gate,
            });
            (dir, generator)
        }
    };
    let twin_dir = work.join("dense-twin");
    // --mxfp4-experts: the experts stay MXFP4 and the trunk BF16, as bench-peers converts.
    let mxfp4 = options.flag("mxfp4-experts");
    ensure!(
        !(mxfp4 && python_converter),
        "--mxfp4-experts is for the Rust converter"
    );
    let twin = write_dense_twin(&model_dir, &twin_dir, mxfp4)
        .with_context(|| format!("building the dense twin of {}", model_dir.display()))?;
    for &token in &tokens {
        ensure!(
            (token as usize) < twin.vocab_size,
            "token {token} is not below the vocabulary size {}",
            twin.vocab_size
        );
    }
    lap("dense twin", &mut timings);

    let (gguf, outtype) = match mxfp4 {
        true => ("twin-mxfp4-bf16.gguf", crate::gguf_k3_meta::Outtype::Bf16),
        false => ("dense-twin-f32.gguf", crate::gguf_k3_meta::Outtype::F32),
    };
    let gguf = work.join(gguf);
    if python_converter {
        let python = venv_with(&venv, &[&PINNED[..], &EXTRA_PINS[..]].concat())?;
        let mut convert = Command::new(&python);
        convert
            .arg(from_root(CONVERT_SCRIPT))
            .arg("--llama-cpp")
            .arg(&source)
            .arg("--")
            .arg(&twin_dir)
            .arg("--outfile")
            .arg(&gguf)
            .args(["--outtype", "f32"]);
        run_checked(&mut convert)?;
    } else {
        crate::gguf_k3::convert(&twin_dir, &gguf, outtype)?;
    }
    let gguf_sha256 = sha256_hex(&fs::read(&gguf).context("cannot read the converted gguf")?);
    lap("convert", &mut timings);

    let partial = staging_dir(&out)?;
    let token_list = tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let logits_path = partial.join("logits.f32");
    let step_limit = if mxfp4 {
        STEP_VS_BATCH_MXFP4
    } else {
        STEP_VS_BATCH
    };
    let output = Command::new(&harness)
        .arg(&gguf)
        .arg(&logits_path)
        .arg(&token_list)
        .arg(THREADS)
        .arg(step_limit.to_string())
        .output()
        .with_context(|| format!("cannot start {}", harness.display()))?;
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    ensure!(
        output.status.success(),
        "{} exited with {}: {}{}",
        harness.display(),
        output.status,
        report,
        String::from_utf8_lossy(&output.stderr)
    );
    lap("run", &mut timings);
    let facts = HarnessReport::parse(&report)?;

    let bytes = fs::read(&logits_path).context("cannot read the logits")?;
    let rows = tokens.len();
    ensure!(
        facts.n_vocab == twin.vocab_size,
        "llama.cpp reports {} logits a row, the config has vocab_size {}",
        facts.n_vocab,
        twin.vocab_size
    );
    ensure!(
        bytes.len() == rows * twin.vocab_size * 4,
        "logits.f32 holds {} bytes, expected {rows} rows of {} f32",
        bytes.len(),
        twin.vocab_size
    );
    let logits: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    ensure!(
        logits.iter().all(|v| v.is_finite()),
        "llama.cpp wrote non-finite logits"
    );
    let max_abs = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let logits_sha256 = sha256_hex(&bytes);

    let manifest = serde_json::json!({
        "what": "llama.cpp Kimi-K3 logits of the dense twin of a synthetic K3 checkpoint; \
                 row t = logits after consuming token t (batch prefill), little-endian f32",
        "command": command,
        "checkpoint": generator,
        "tokens": tokens,
        "logits": {
            "file": "logits.f32",
            "dtype": "f32",
            "endian": "little",
            "shape": [rows, twin.vocab_size],
            "sha256": logits_sha256,
            "max_abs": max_abs,
        },
        "llama_cpp": {
            "package": PACKAGE,
            "version": VERSION,
            "sdist": SDIST,
            "sdist_sha256": SDIST_SHA256,
            "source": "vendor/llama.cpp of the sdist",
            "library": "libllama (cmake -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release, CPU backend)",
            "harness": HARNESS_SOURCE,
            "context": "flash attention disabled, K and V cache F32, one sequence, 2 threads",
            "step_vs_batch": {
                "max_abs_diff": facts.max_abs_step_vs_batch,
                "max_rel_diff": facts.max_rel_step_vs_batch,
                "limit_rel": step_limit,
            },
        },
        "converter": {
            "script": if python_converter {
                "convert_hf_to_gguf.py of the sdist, with its gguf-py"
            } else {
                "xtask/src/gguf_k3.rs (torch-free; the keys and tensors of convert_hf_to_gguf.py)"
            },
            "wrapper": if python_converter { CONVERT_SCRIPT } else { "none" },
            "outtype": if mxfp4 { "bf16, experts mxfp4" } else { "f32" },
            "gguf_sha256": gguf_sha256,
            "notes": [
                "set_vocab replaced by a byte-level vocabulary of vocab_size \
                 (256 byte tokens, then unused [PADi]; pre-tokenizer kimi-k2, no merges)",
                "routed experts given as dense F32 `experts.{e}.w{1,2,3}.weight`, each the \
                 exact dequantisation of the checkpoint's MXFP4 (mxfp4_kernels scalar tier); \
                 quantization_config dropped",
                twin.mla_note,
            ],
        },
        "dense_twin": {
            "tensors": twin.tensors,
            "experts_dequantised": twin.expert_matrices,
            "mla_heads": twin.mla_heads,
            "kda_heads": twin.kda_heads,
        },
    });
    let mut text = serde_json::to_string_pretty(&manifest)?;
    text.push('\n');
    fs::write(partial.join("manifest.json"), &text).context("cannot write manifest.json")?;

    let digests = publish_staged(&partial, &out, &OUT_FILES, &OUT_FILES)?;

    println!("command:  {command}");
    println!(
        "model:    {} -> dense twin {}",
        relative(&model_dir),
        relative(&twin_dir)
    );
    println!("gguf:     {} (sha256 {gguf_sha256})", relative(&gguf));
    println!("tokens:   {token_list}");
    println!(
        "wrote:    {} ({rows} x {})",
        relative(&out),
        twin.vocab_size
    );
    for (file, digest) in digests {
        println!("sha256:   {digest}  {file}");
    }
    println!("row 0:    {:?}", &logits[..logits.len().min(6)]);
    println!("max |l|:  {max_abs}");
    println!(
        "step/batch: max |d| {:e}, max rel {:e}",
        facts.max_abs_step_vs_batch, facts.max_rel_step_vs_batch
    );
    for (name, seconds) in &timings {
        println!("time:     {name:<11} {seconds:.1} s");
    }
    println!("wall:     {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn parse_tokens(list: &str) -> Result<Vec<u32>> {
    let tokens = list
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .with_context(|| format!("token {t:?} is not a token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    ensure!(!tokens.is_empty(), "--tokens is empty");
    Ok(tokens)
}

/// The unpacked llama.cpp source directory, fetching and unpacking the sdist if needed. A
/// tarball already on disk is trusted only if it matches the pinned sha256.
pub(crate) fn fetch_sdist(work: &Path) -> Result<PathBuf> {
    let tarball = work.join(SDIST);
    let unpacked = work.join(SDIST.trim_end_matches(".tar.gz"));
    let source = unpacked.join("vendor").join("llama.cpp");
    if !tarball.exists() {
        let (url, listed) = pypi_file(SDIST)?;
        ensure!(
            listed == SDIST_SHA256,
            "PyPI lists sha256 {listed} for {SDIST}, pinned is {SDIST_SHA256}"
        );
        let partial = work.join(format!("{SDIST}.partial"));
        println!("fetching {url}");
        run_checked(
            Command::new("curl")
                .args(["-sSfL", "-o"])
                .arg(&partial)
                .arg(&url),
        )?;
        fs::rename(&partial, &tarball)?;
    }
    let digest = sha256_hex(&fs::read(&tarball)?);
    ensure!(
        digest == SDIST_SHA256,
        "{} has sha256 {digest}, pinned is {SDIST_SHA256}",
        tarball.display()
    );
    if !source.join("CMakeLists.txt").exists() {
        run_checked(
            Command::new("tar")
                .arg("xzf")
                .arg(&tarball)
                .arg("-C")
                .arg(work),
        )?;
        ensure!(
            source.join("convert_hf_to_gguf.py").exists(),
            "{SDIST} has no vendor/llama.cpp/convert_hf_to_gguf.py"
        );
    }
    Ok(source)
}

/// URL and sha256 of `filename` from PyPI's simple JSON API (PEP 691).
fn pypi_file(filename: &str) -> Result<(String, String)> {
    let output = Command::new("curl")
        .args([
            "-sSf",
            "-H",
            "Accept: application/vnd.pypi.simple.v1+json",
            PYPI_SIMPLE,
        ])
        .output()
        .context("cannot start curl")?;
    ensure!(
        output.status.success(),
        "curl {PYPI_SIMPLE} exited with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let index: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("PyPI's answer is not json")?;
    let files = index["files"]
        .as_array()
        .context("PyPI's answer has no files list")?;
    let file = files
        .iter()
        .find(|f| f["filename"] == filename)
        .with_context(|| format!("PyPI lists no {filename}"))?;
    let url = file["url"].as_str().context("no url")?.to_owned();
    let sha = file["hashes"]["sha256"]
        .as_str()
        .context("no sha256")?
        .to_owned();
    Ok((url, sha))
}

/// Configures a CPU-only release build of llama.cpp in `build` (once; installs Debian's cmake
/// if it is missing), with `common` and the tools (llama-bench) as targets besides the library.
/// Only the targets asked for are built.
fn configure(source: &Path, build: &Path) -> Result<()> {
    let has_cmake = Command::new("cmake")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cmake {
        println!("cmake is missing: installing Debian's with apt-get");
        run_checked(Command::new("apt-get").args(["install", "-y", "cmake"]))?;
    }
    if build.join("CMakeCache.txt").exists() {
        return Ok(());
    }
    run_checked(
        Command::new("cmake")
            .arg("-S")
            .arg(source)
            .arg("-B")
            .arg(build)
            .args([
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
                "-DLLAMA_BUILD_COMMON=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_TOOLS=ON",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF",
            ]),
    )
}

/// `bin/{product}` of the cmake `target`, built once: the source is pinned by its sha256, so a
/// product already there is used as it is (also one copied from another checkout: the build
/// runs with `$ORIGIN` rpaths), without asking cmake.
pub(crate) fn build_target(
    work: &Path,
    source: &Path,
    target: &str,
    product: &str,
) -> Result<PathBuf> {
    let build = work.join(BUILD_DIR);
    let path = build.join("bin").join(product);
    if path.exists() {
        return Ok(path);
    }
    configure(source, &build)?;
    run_checked(
        Command::new("cmake")
            .arg("--build")
            .arg(&build)
            .args(["-j2", "--target", target]),
    )?;
    ensure!(
        path.exists(),
        "cmake built {target} but there is no {}",
        path.display()
    );
    Ok(path)
}

/// Builds `libllama` (once) and the harness against it;
/// returns the harness path.
pub(crate) fn build_llamacpp(work: &Path, source: &Path) -> Result<PathBuf> {
    build_target(work, source, "llama", "libllama.so")?;
    let lib = work.join(BUILD_DIR).join("bin");
    let harness = lib.join("llamacpp_logits");
    // The harness is one small file: compiling it every run (under a second) is simpler than
    // tracking what it depends on.
    run_checked(
        Command::new("c++")
            .args(["-std=c++17", "-O2", "-Wall", "-Wextra"])
            .arg(format!("-I{}", source.join("include").display()))
            .arg(format!(
                "-I{}",
                source.join("ggml").join("include").display()
            ))
            .arg(from_root(HARNESS_SOURCE))
            .arg("-o")
            .arg(&harness)
            .arg(format!("-L{}", lib.display()))
            .args(["-lllama", "-lggml", "-lggml-base", "-Wl,-rpath,$ORIGIN"]),
    )?;
    Ok(harness)
}

/// The facts the harness prints as `key: value` lines.
struct HarnessReport {
    n_vocab: usize,
    max_abs_step_vs_batch: f64,
    max_rel_step_vs_batch: f64,
}

impl HarnessReport {
    fn parse(stdout: &str) -> Result<Self> {
        let get = |key: &str| -> Result<&str> {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(": "))
                .with_context(|| format!("the harness printed no {key}: {stdout}"))
        };
        Ok(Self {
            n_vocab: get("n_vocab")?.trim().parse()?,
            max_abs_step_vs_batch: get("max_abs_step_vs_batch")?.trim().parse()?,
            max_rel_step_vs_batch: get("max_rel_step_vs_batch")?.trim().parse()?,
        })
    }
}

/// `llama-bench`, built once in the build directory the logits oracle's `libllama` also
/// lives in.
pub(crate) fn build_llama_bench(work: &Path, source: &Path) -> Result<PathBuf> {
    build_target(work, source, "llama-bench", "llama-bench")
}

/// `llama-server`, built once in the same build directory. The shared configuration leaves
/// the server out, so the first build turns it on, with its web UI neither built (npm) nor
/// downloaded at build time: the server embeds an empty asset table and serves the API alone.
pub(crate) fn build_llama_server(work: &Path, source: &Path) -> Result<PathBuf> {
    let build = work.join(BUILD_DIR);
    if !build.join("bin").join("llama-server").exists() {
        configure(source, &build)?;
        run_checked(
            Command::new("cmake")
                .arg("-S")
                .arg(source)
                .arg("-B")
                .arg(&build)
                .args([
                    "-DLLAMA_BUILD_SERVER=ON",
                    "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF",
                ]),
        )?;
    }
    build_target(work, source, "llama-server", "llama-server")
}
