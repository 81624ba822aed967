//! One timed run of each engine for `bench-peers` — a `llama-bench` test, our decode bench's
//! decode or prefill — each at a context depth, and the reading of the figures they print.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::runs::{between, drop_page_cache};

/// One `llama-bench` test: a prompt of `prompt` tokens (`pp`) or `generate` generated tokens
/// (`tg`), after `depth` tokens (`-d`) prefilled untimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Test {
    pub(super) prompt: usize,
    pub(super) generate: usize,
    pub(super) depth: usize,
}

impl Test {
    /// `tg`: `generate` tokens generated after `depth`.
    pub(super) fn decode(generate: usize, depth: usize) -> Self {
        Self {
            prompt: 0,
            generate,
            depth,
        }
    }

    /// `pp`: a `prompt`-token prompt after `depth`.
    pub(super) fn prefill(prompt: usize, depth: usize) -> Self {
        Self {
            prompt,
            generate: 0,
            depth,
        }
    }
}

/// llama.cpp's tokens/s for `test` on `threads` threads, one repetition.
pub(super) fn llama(bench: &Path, gguf: &Path, threads: usize, test: Test) -> Result<f64> {
    // llama-bench sizes its context to depth + prompt + generated tokens itself, so `-d` needs
    // no `-c`; the depth is filled before each repetition, outside the timed region.
    let out = Command::new(bench)
        .arg("-m")
        .arg(gguf)
        .args([
            "-p",
            &test.prompt.to_string(),
            "-n",
            &test.generate.to_string(),
            "-d",
            &test.depth.to_string(),
            "-t",
            &threads.to_string(),
        ])
        .args(["-r", "1", "-o", "json"])
        .output()
        .context("running llama-bench")?;
    if !out.status.success() {
        bail!(
            "llama-bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    llama_rate(&out.stdout, test)
}

/// The `avg_ts` of `test` in what `llama-bench -o json` printed: the record whose `n_prompt`,
/// `n_gen` and `n_depth` are the test's, so a run that measured something else (an older
/// llama-bench without `-d` prints no `n_depth`) is an error, not a figure.
fn llama_rate(json: &[u8], test: Test) -> Result<f64> {
    let records: serde_json::Value =
        serde_json::from_slice(json).context("llama-bench did not print JSON")?;
    let records = records
        .as_array()
        .context("llama-bench's JSON is not an array of tests")?;
    let count = |record: &serde_json::Value, field: &str| record[field].as_u64();
    let record = records
        .iter()
        .find(|r| {
            count(r, "n_prompt") == Some(test.prompt as u64)
                && count(r, "n_gen") == Some(test.generate as u64)
                && count(r, "n_depth") == Some(test.depth as u64)
        })
        .with_context(|| {
            format!(
                "llama-bench printed no test with n_prompt {}, n_gen {}, n_depth {}",
                test.prompt, test.generate, test.depth
            )
        })?;
    record["avg_ts"]
        .as_f64()
        .context("llama-bench printed no avg_ts")
}

/// Drops `files` from the page cache and lets the machine settle for a second: two engines'
/// copies of a big checkpoint do not both fit next to a resident model, so each run starts
/// without the other engine's file cached. No files (no peer): nothing to settle.
pub(super) fn fresh(files: &[PathBuf]) -> Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    for f in files {
        drop_page_cache(f)?;
    }
    std::thread::sleep(std::time::Duration::from_secs(1));
    Ok(())
}

/// Our prefill tokens/s for a `prompt`-token prompt after `depth` tokens, in chunks of up to
/// `PREFILL_CHUNK` (`--prefill`), as k3-serve prefills; the depth is filled untimed in the
/// same chunks.
pub(super) fn our_prefill(
    bench: &Path,
    model: &Path,
    threads: usize,
    (prompt, depth): (usize, usize),
    tier: &[String],
) -> Result<f64> {
    let chunk = prompt.min(k3_model::model::PREFILL_CHUNK);
    // `--steps` as long as the prompt: the bench sizes its KV cache to depth + steps.
    let mut args = vec![
        "--threads".to_string(),
        threads.to_string(),
        "--steps".into(),
        prompt.to_string(),
        "--prefill".into(),
        prompt.to_string(),
        "--prefill-chunk".into(),
        chunk.to_string(),
    ];
    args.extend(depth_args(depth));
    args.extend_from_slice(tier);
    prefill_rate(&our_output(bench, model, &args)?, prompt, depth)
}

/// Our decode tokens/s for `steps` teacher-forced tokens after `depth` tokens — from the mean
/// step time, as llama-bench reports its `tg` (the steps right after our read probes
/// included) — and the median read bandwidth our bench probed between its steps.
pub(super) fn our_decode(
    bench: &Path,
    model: &Path,
    threads: usize,
    (steps, depth): (usize, usize),
    tier: &[String],
) -> Result<(f64, f64)> {
    let mut args = vec![
        "--threads".to_string(),
        threads.to_string(),
        "--steps".into(),
        steps.to_string(),
    ];
    args.extend(depth_args(depth));
    args.extend_from_slice(tier);
    decode_rate(&our_output(bench, model, &args)?, steps, depth)
}

/// `--depth`, filled in the chunks a prefill uses: the fill is untimed, and the chunk does not
/// change the cache it leaves. Nothing at depth 0, so today's runs keep their command line.
fn depth_args(depth: usize) -> Vec<String> {
    match depth {
        0 => Vec::new(),
        _ => vec![
            "--depth".into(),
            depth.to_string(),
            "--depth-chunk".into(),
            k3_model::model::PREFILL_CHUNK.to_string(),
        ],
    }
}

/// Runs our decode bench with `args` and returns what it printed.
fn our_output(bench: &Path, model: &Path, args: &[String]) -> Result<String> {
    let out = Command::new(bench)
        .arg("--model")
        .arg(model)
        .args(args)
        .output()
        .context("running teacher_forced_decode_bench")?;
    if !out.status.success() {
        bail!(
            "teacher_forced_decode_bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first line of `text` starting with `marker`.
fn line_with<'t>(text: &'t str, marker: &str) -> Result<&'t str> {
    text.lines()
        .find(|l| l.starts_with(marker))
        .with_context(|| format!("no {marker:?} line in: {text}"))
}

/// The tokens/s of our `--prefill` line for `prompt` tokens at `depth` (the line names both).
fn prefill_rate(out: &str, prompt: usize, depth: usize) -> Result<f64> {
    let marker = format!("prefill: {prompt} tokens at depth {depth} in chunks of");
    between(line_with(out, &marker)?, "ms = ", " tokens/s").context("no prefill rate")
}

/// Tokens/s from the mean step time of our decode summary for `steps` steps at `depth` (it
/// says `at depth N` only when N > 0), and the median read bandwidth in bytes/s.
fn decode_rate(out: &str, steps: usize, depth: usize) -> Result<(f64, f64)> {
    let marker = match depth {
        0 => format!("{steps} steps: median"),
        _ => format!("{steps} steps at depth {depth}: median"),
    };
    let ms =
        between(line_with(out, &marker)?, "after the first ", " ms/token").context("no mean")?;
    let read = line_with(out, "read bandwidth, measured")?;
    let gbps = between(read, "median ", " GB/s").context("no read median")?;
    Ok((1e3 / ms, gbps * 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two records of llama.cpp's `tools/llama-bench/README.md` "JSON" example (upstream
    /// output of `llama-bench -o json`, pp512 and tg128 at depth 0), as printed.
    const README_JSON: &str = r#"[
  {
    "build_commit": "8cf427ff",
    "build_number": 5163,
    "cpu_info": "AMD Ryzen 7 7800X3D 8-Core Processor",
    "gpu_info": "NVIDIA GeForce RTX 4080",
    "backends": "CUDA",
    "model_filename": "models/Qwen2.5-7B-Instruct-Q4_K_M.gguf",
    "model_type": "qwen2 7B Q4_K - Medium",
    "model_size": 4677120000,
    "model_n_params": 7615616512,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 8,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "use_mmap": true,
    "use_direct_io": false,
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2025-04-24T11:58:50Z",
    "avg_ns": 72135640,
    "stddev_ns": 1453752,
    "avg_ts": 7100.002165,
    "stddev_ts": 140.341520,
    "samples_ns": [ 74601900, 71632900, 71745200, 71952700, 70745500 ],
    "samples_ts": [ 6863.1, 7147.55, 7136.37, 7115.79, 7237.21 ]
  },
  {
    "build_commit": "8cf427ff",
    "build_number": 5163,
    "cpu_info": "AMD Ryzen 7 7800X3D 8-Core Processor",
    "gpu_info": "NVIDIA GeForce RTX 4080",
    "backends": "CUDA",
    "model_filename": "models/Qwen2.5-7B-Instruct-Q4_K_M.gguf",
    "model_type": "qwen2 7B Q4_K - Medium",
    "model_size": 4677120000,
    "model_n_params": 7615616512,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 8,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "use_mmap": true,
    "use_direct_io": false,
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2025-04-24T11:58:51Z",
    "avg_ns": 1076767880,
    "stddev_ns": 9449585,
    "avg_ts": 118.881588,
    "stddev_ts": 1.041811,
    "samples_ns": [ 1075361300, 1065089400, 1071761200, 1081934900, 1089692600 ],
    "samples_ts": [ 119.03, 120.178, 119.43, 118.307, 117.464 ]
  }
]
"#;

    #[test]
    fn the_llama_bench_record_of_the_requested_test_and_depth_is_read() {
        let json = README_JSON.as_bytes();
        assert_eq!(
            llama_rate(json, Test::prefill(512, 0)).unwrap(),
            7100.002165
        );
        assert_eq!(llama_rate(json, Test::decode(128, 0)).unwrap(), 118.881588);
        // The same records as `-d 4096` prints them (`n_depth` is the test's depth).
        let deep = README_JSON.replace("\"n_depth\": 0,", "\"n_depth\": 4096,");
        let deep = deep.as_bytes();
        assert_eq!(
            llama_rate(deep, Test::decode(128, 4096)).unwrap(),
            118.881588
        );
        // A figure at another depth, or of another test, is not taken for the one asked.
        let e = llama_rate(deep, Test::decode(128, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_gen 128, n_depth 0"), "{e}");
        assert!(llama_rate(json, Test::decode(128, 4096)).is_err());
        assert!(llama_rate(json, Test::prefill(64, 0)).is_err());
        // An older llama-bench, without the depth column.
        let undeep = README_JSON.replace("\"n_depth\": 0,", "");
        assert!(llama_rate(undeep.as_bytes(), Test::prefill(512, 0)).is_err());
    }

    /// The tail of what `teacher_forced_decode_bench --model /work/ck-040b --threads 2 --steps 4
    /// --depth 8` printed (2026-12-04).
    const DECODE_AT_DEPTH: &str = "\
step    2 token 154378     66.964 ms  fingerprint 427e5eab4d93494b
step    3 token  95517     64.307 ms  fingerprint ff2f475bba1c36b8
read bandwidth, measured after every 4 steps (2 threads): median 7.85 GB/s, range 7.85-7.85
4 steps at depth 8: median 66.964 ms/token, mean after the first 65.201 ms/token; 400580256 weight bytes per token; 5.98 GB/s; 79% of the read bandwidth (median of per-step ratios to the read measured next); combined fingerprint af791d3b6455de54
";

    /// The same without `--depth`.
    const DECODE: &str = "\
step    3 token 130029     60.590 ms  fingerprint ec971d9dcf0a2f4c
read bandwidth, measured after every 4 steps (2 threads): median 7.39 GB/s, range 7.39-7.39
4 steps: median 65.210 ms/token, mean after the first 63.427 ms/token; 400580256 weight bytes per token; 6.14 GB/s; 84% of the read bandwidth (median of per-step ratios to the read measured next); combined fingerprint 5eaa5febd9bc9f60
";

    #[test]
    fn our_decode_summary_is_read_at_the_depth_it_names() {
        let (rate, read) = decode_rate(DECODE_AT_DEPTH, 4, 8).unwrap();
        assert!((rate - 1e3 / 65.201).abs() < 1e-9, "{rate}");
        assert_eq!(read, 7.85e9);
        let (rate, read) = decode_rate(DECODE, 4, 0).unwrap();
        assert!((rate - 1e3 / 63.427).abs() < 1e-9, "{rate}");
        assert_eq!(read, 7.39e9);
        // A summary at another depth or of another step count is not the run asked for.
        assert!(decode_rate(DECODE_AT_DEPTH, 4, 0).is_err());
        assert!(decode_rate(DECODE_AT_DEPTH, 4, 16).is_err());
        assert!(decode_rate(DECODE, 4, 8).is_err());
        assert!(decode_rate(DECODE, 14, 0).is_err());
    }

    #[test]
    fn our_prefill_line_is_read_at_the_depth_it_names() {
        // What `--steps 4 --prefill 4 --prefill-chunk 4 --depth 8` printed on /work/ck-040b.
        let at_depth = "prefill: 4 tokens at depth 8 in chunks of 4: median 101.611 ms = 39.37 tokens/s; last logits fingerprint ff2f475bba1c36b8\n";
        assert_eq!(prefill_rate(at_depth, 4, 8).unwrap(), 39.37);
        assert!(prefill_rate(at_depth, 4, 0).is_err());
        assert!(prefill_rate(at_depth, 64, 8).is_err());
        // Without `--depth` the line says depth 0 (it once said only "4 tokens in chunks of").
        let fresh = at_depth.replace("at depth 8", "at depth 0");
        assert_eq!(prefill_rate(&fresh, 4, 0).unwrap(), 39.37);
        let old = at_depth.replace("at depth 8 ", "");
        assert!(prefill_rate(&old, 4, 0).is_err());
    }
}
