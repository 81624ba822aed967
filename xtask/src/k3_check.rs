//! `cargo xtask k3-check`: opens a checkpoint directory the way the server does (config,
//! tokenizer, shards, validation against the config, the expert table), prints the format
//! census, and by default reads every weight once (`--no-scan` skips it): NaN/Inf counts per
//! float tensor and 0xFF (NaN) E8M0 scale bytes. Any finding is an error.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use expert_store::Checkpoint;
use expert_store::scan::scan_checkpoint;
use k3_model::checks::census;
use k3_model::checks::validate;
use k3_model::config::K3Config;
use k3_model::tokenizer::Tokenizer;

use crate::{Options, from_root};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(args, &["model", "no-scan!"])?;
    let dir = from_root(o.get("model").context("--model DIR is required")?);
    let start = Instant::now();
    let text = std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?;
    let config = K3Config::from_json(&text)?;
    // The server loads the tokenizer before anything else; a checkpoint it refuses fails here.
    Tokenizer::from_dir(&dir).context("loading the tokenizer")?;
    let ckpt = Checkpoint::open(&dir)?;
    let validated = validate(&ckpt, &config)?;
    let table = ckpt.expert_table(&k3_model::inventory::expert_layout(&config))?;
    let contiguous = table.values().filter(|l| l.contiguous).count();
    let spanning = table.values().filter(|l| l.spans_shards()).count();
    println!("format census (bytes per format and class):");
    for ((format, class), cell) in census(&ckpt, &config) {
        println!(
            "  {:<6} {:<15} {:>16} bytes in {:>6} tensors",
            format.name(),
            class.name(),
            cell.bytes,
            cell.tensors
        );
    }
    let scanned = if o.flag("no-scan") {
        "not scanned (--no-scan)".to_owned()
    } else {
        let scan_start = Instant::now();
        let report = scan_checkpoint(&ckpt, |_, _| {});
        let bad: Vec<_> = report.bad().collect();
        for t in &bad {
            println!(
                "  {} ({:?}, {}): {} NaN, {} Inf, {} NaN scales (0xFF) of {} values",
                t.name,
                t.dtype,
                t.path.display(),
                t.nan,
                t.inf,
                t.nan_scales,
                t.values
            );
        }
        if !bad.is_empty() {
            let first: Vec<String> = bad.iter().take(3).map(|t| t.describe()).collect();
            bail!(
                "{}: {} of {} tensors hold NaN, Inf or 0xFF (NaN) scales (all listed above), first {}",
                dir.display(),
                bad.len(),
                report.tensors.len(),
                first.join(", ")
            );
        }
        format!(
            "scanned {:.3} GB in {:.2} s: no NaN, Inf or 0xFF scale in {} tensors",
            report.bytes as f64 / 1e9,
            scan_start.elapsed().as_secs_f64(),
            report.tensors.len()
        )
    };
    println!(
        "{}: valid — {} tensors, {:.3} GB, {} layers, max_position_embeddings {}, tokenizer loaded, {} routed experts ({} stored contiguously, {} across shards), {} padded A_log; {scanned}; checked in {:.2} s",
        dir.display(),
        ckpt.len(),
        ckpt.data_bytes() as f64 / 1e9,
        config.num_layers(),
        config.max_position_embeddings,
        table.len(),
        contiguous,
        spanning,
        validated.truncated_a_log.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::path::Path;

    use expert_store::Checkpoint;
    use k3_model::synth::{Preset, SynthOptions, generate};
    use k3_testkit::Scratch;

    fn tiny(tag: &str) -> Scratch {
        let dir = Scratch::new(&format!("check-{tag}"));
        generate(dir.path(), &SynthOptions::new(Preset::Tiny)).unwrap();
        dir
    }

    fn check(dir: &Path, extra: &[&str]) -> Result<(), String> {
        let mut args = vec!["--model".to_owned(), dir.display().to_string()];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        super::run(&args).map_err(|e| format!("{e:#}"))
    }

    /// Overwrites the bytes of `tensor` at `at` (bytes into its data).
    fn poke(dir: &Path, tensor: &str, at: usize, bytes: &[u8]) {
        let ckpt = Checkpoint::open(dir).unwrap();
        let t = ckpt.require(tensor).unwrap();
        let (path, offset) = (t.path.to_owned(), t.offset);
        drop(ckpt);
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .write_all_at(bytes, (offset + at) as u64)
            .unwrap();
    }

    #[test]
    fn a_clean_checkpoint_passes_and_each_damage_is_named() {
        let dir = tiny("clean");
        check(dir.path(), &[]).unwrap();
        check(dir.path(), &["--no-scan"]).unwrap();

        // NaN in a BF16 matrix, -0/max/Inf in a BF16 vector, NaN in an F32 vector, a 0xFF
        // E8M0 scale: found by the scan, named with their counts; --no-scan does not read them.
        let cases: [(&str, usize, &[u8], &str); 4] = [
            (
                "model.layers.0.self_attn.q_proj.weight",
                6,
                &[0xC1, 0x7F],
                "q_proj.weight (1 NaN, 0 Inf, 0 NaN scales)",
            ),
            (
                "model.norm.weight",
                0,
                &[0x00, 0x80, 0x7F, 0x7F, 0x80, 0x7F],
                "model.norm.weight (0 NaN, 1 Inf, 0 NaN scales)",
            ),
            (
                "model.layers.0.self_attn.A_log",
                4,
                &[0x01, 0x00, 0x80, 0xFF],
                "A_log (1 NaN, 0 Inf, 0 NaN scales)",
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale",
                5,
                &[0xFF],
                "experts.3.w2.weight_scale (0 NaN, 0 Inf, 1 NaN scales)",
            ),
        ];
        for (i, (tensor, at, bytes, needle)) in cases.into_iter().enumerate() {
            let dir = tiny(&format!("nan{i}"));
            poke(dir.path(), tensor, at, bytes);
            let err = check(dir.path(), &[]).unwrap_err();
            assert!(err.contains(needle), "{needle:?} not in {err}");
            check(dir.path(), &["--no-scan"]).unwrap();
        }

        // Config values and tokenizer files the server refuses.
        let dir = tiny("config");
        let path = dir.path().join("config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            &path,
            text.replace(
                "\"max_position_embeddings\": 4096",
                "\"max_position_embeddings\": 0",
            ),
        )
        .unwrap();
        let err = check(dir.path(), &["--no-scan"]).unwrap_err();
        assert!(err.contains("max_position_embeddings is invalid"), "{err}");
        let dir = tiny("tokenizer");
        std::fs::write(dir.path().join("tokenizer_config.json"), "{ not json").unwrap();
        let err = check(dir.path(), &["--no-scan"]).unwrap_err();
        assert!(
            err.contains("loading the tokenizer") && err.contains("tokenizer_config.json"),
            "{err}"
        );
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        assert!(
            check(dir.path(), &["--no-scan"])
                .unwrap_err()
                .contains("tokenizer_config.json")
        );
        let dir = tiny("tiktoken");
        std::fs::remove_file(dir.path().join("tiktoken.model")).unwrap();
        let err = check(dir.path(), &["--no-scan"]).unwrap_err();
        assert!(err.contains("tiktoken.model"), "{err}");
    }
}
