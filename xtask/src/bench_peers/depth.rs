//! `bench-peers --depth LIST`: decode and prefill at each context depth, ours against
//! `llama-bench -d`, alternating, with a table per depth and the median ratios by depth.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::engines::{Test, fresh, llama, our_decode, our_prefill};

/// What a depth sweep runs, set up by `bench_peers::run`.
pub(super) struct DepthRun<'a> {
    /// Our decode bench.
    pub(super) ours: &'a Path,
    pub(super) model: &'a Path,
    /// `llama-bench` and the GGUF; `None` runs ours alone (`--no-peer`).
    pub(super) peer: Option<(&'a Path, &'a Path)>,
    /// Our bench's extra arguments (kernel tier, trunk format, residency).
    pub(super) tier: &'a [String],
    pub(super) threads: &'a [usize],
    pub(super) depths: &'a [usize],
    pub(super) pairs: usize,
    /// Generated tokens per decode run.
    pub(super) tokens: usize,
    /// Tokens per timed prefill.
    pub(super) prompt: usize,
    /// The checkpoint's `max_position_embeddings`.
    pub(super) max_positions: usize,
    /// Our checkpoint's shards, dropped from the page cache before each llama.cpp run (the
    /// GGUF before each of ours).
    pub(super) ours_files: &'a [PathBuf],
}

/// `--depth LIST`: comma-separated token counts.
pub(super) fn parse_depths(list: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|d| {
            d.trim()
                .parse()
                .with_context(|| format!("--depth is a list of token counts, not {d:?}"))
        })
        .collect()
}

/// One pair's tokens/s: ours and, beside a peer, llama.cpp's.
struct Pair {
    decode: (f64, Option<f64>),
    prefill: (f64, Option<f64>),
}

pub(super) fn run(r: &DepthRun<'_>) -> Result<()> {
    anyhow::ensure!(r.pairs > 0, "--depth needs --pairs of at least 1");
    let deepest = r.depths.iter().max().copied().unwrap_or(0) + r.tokens.max(r.prompt);
    if deepest > r.max_positions {
        // llama.cpp only warns of a "training context overflow"; both engines run anyway.
        println!(
            "note: depth + tokens reaches {deepest}, past the checkpoint's max_position_embeddings {}",
            r.max_positions
        );
    }
    let ggufs: Vec<PathBuf> = r.peer.iter().map(|(_, g)| g.to_path_buf()).collect();
    for &t in r.threads {
        let mut medians = Vec::new();
        for &depth in r.depths {
            let mut pairs = Vec::new();
            for _ in 0..r.pairs {
                pairs.push(one_pair(r, t, depth, &ggufs)?);
            }
            println!(
                "\nthreads {t}, depth {depth}: decode of {} tokens, prefill of {} tokens (tokens/s)",
                r.tokens, r.prompt
            );
            let table = Table::new(&pairs);
            print!("{}", table.render());
            medians.push((depth, table.medians()));
        }
        println!("\nthreads {t}, medians by depth:");
        print!("{}", by_depth(&medians, r.peer.is_some()));
    }
    Ok(())
}

/// One pair at `depth` on `threads` threads: llama.cpp's decode, ours, llama.cpp's prefill,
/// ours, each started with the other engine's file out of the page cache.
fn one_pair(r: &DepthRun<'_>, threads: usize, depth: usize, ggufs: &[PathBuf]) -> Result<Pair> {
    let (decode, prefill) = (
        Test::decode(r.tokens, depth),
        Test::prefill(r.prompt, depth),
    );
    let peer = |test: Test| -> Result<Option<f64>> {
        let Some((bench, gguf)) = r.peer else {
            return Ok(None);
        };
        fresh(r.ours_files)?;
        llama(bench, gguf, threads, test).map(Some)
    };
    let peer_tg = peer(decode)?;
    fresh(ggufs)?;
    let (our_tg, _) = our_decode(r.ours, r.model, threads, (r.tokens, depth), r.tier)?;
    let peer_pp = peer(prefill)?;
    fresh(ggufs)?;
    let our_pp = our_prefill(r.ours, r.model, threads, (r.prompt, depth), r.tier)?;
    Ok(Pair {
        decode: (our_tg, peer_tg),
        prefill: (our_pp, peer_pp),
    })
}

/// A depth's pairs as rows of figures: ours, llama.cpp's and their ratio for decode and for
/// prefill (ours alone: the two tokens/s).
struct Table {
    peer: bool,
    rows: Vec<Vec<f64>>,
}

impl Table {
    fn new(pairs: &[Pair]) -> Self {
        let peer = pairs.iter().all(|p| p.decode.1.is_some());
        let rows = pairs
            .iter()
            .map(|p| {
                [p.decode, p.prefill]
                    .into_iter()
                    .flat_map(|(ours, theirs)| match theirs {
                        Some(theirs) if peer => vec![ours, theirs, ours / theirs],
                        _ => vec![ours],
                    })
                    .collect()
            })
            .collect();
        Self { peer, rows }
    }

    /// Each column's median over the pairs; a ratio's median is that of the pairs' ratios.
    fn medians(&self) -> Vec<f64> {
        let width = self.rows.first().map_or(0, Vec::len);
        (0..width)
            .map(|c| median(self.rows.iter().map(|r| r[c]).collect()))
            .collect()
    }

    /// A markdown table: one row per pair, then the medians.
    fn render(&self) -> String {
        let header: &[&str] = match self.peer {
            true => &[
                "pair",
                "decode ours",
                "llama.cpp",
                "ours / llama.cpp",
                "prefill ours",
                "llama.cpp",
                "ours / llama.cpp",
            ],
            false => &["run", "decode ours", "prefill ours"],
        };
        let mut out = format!("| {} |\n", header.join(" | "));
        out.push_str(&format!("|{}\n", "---|".repeat(header.len())));
        let labels = (0..self.rows.len()).map(|i| i.to_string());
        let medians = self.medians();
        let rows = self.rows.iter().zip(labels);
        for (row, label) in rows.chain([(&medians, "median".to_string())]) {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(c, v)| self.cell(c, *v))
                .collect();
            out.push_str(&format!("| {label} | {} |\n", cells.join(" | ")));
        }
        out
    }

    /// Tokens/s to two decimals; a ratio (every third column beside a peer) as `1.23x`.
    fn cell(&self, column: usize, value: f64) -> String {
        match self.peer && column % 3 == 2 {
            true => format!("{value:.2}x"),
            false => format!("{value:.2}"),
        }
    }
}

/// The medians of every depth in one table: the ratios beside a peer, else our tokens/s.
fn by_depth(medians: &[(usize, Vec<f64>)], peer: bool) -> String {
    let (header, columns, unit) = match peer {
        true => (
            "| depth | decode ours / llama.cpp | prefill ours / llama.cpp |",
            [2, 5],
            "x",
        ),
        false => (
            "| depth | decode ours, tokens/s | prefill ours, tokens/s |",
            [0, 1],
            "",
        ),
    };
    let mut out = format!("{header}\n|---|---|---|\n");
    for (depth, m) in medians {
        out.push_str(&format!(
            "| {depth} | {:.2}{unit} | {:.2}{unit} |\n",
            m[columns[0]], m[columns[1]]
        ));
    }
    out
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(decode: (f64, f64), prefill: (f64, f64)) -> Pair {
        Pair {
            decode: (decode.0, Some(decode.1)),
            prefill: (prefill.0, Some(prefill.1)),
        }
    }

    #[test]
    fn a_depth_table_gives_each_pair_and_the_median_of_its_ratios() {
        // Ratios 2, 0.5, 1 for decode and 1, 3, 2 for prefill: medians 1 and 2, which the
        // ratio of the median tokens/s (10 / 10, 30 / 10) would not give.
        let pairs = [
            pair((20.0, 10.0), (10.0, 10.0)),
            pair((5.0, 10.0), (30.0, 10.0)),
            pair((10.0, 10.0), (40.0, 20.0)),
        ];
        let table = Table::new(&pairs);
        let text = table.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2 + 3 + 1, "{text}");
        assert_eq!(
            lines[2],
            "| 0 | 20.00 | 10.00 | 2.00x | 10.00 | 10.00 | 1.00x |"
        );
        assert_eq!(
            lines[5],
            "| median | 10.00 | 10.00 | 1.00x | 30.00 | 10.00 | 2.00x |"
        );
        let summary = by_depth(&[(4096, table.medians())], true);
        assert!(summary.ends_with("| 4096 | 1.00x | 2.00x |\n"), "{summary}");
    }

    #[test]
    fn alone_a_depth_table_gives_our_tokens_per_second() {
        let pairs = [
            Pair {
                decode: (4.0, None),
                prefill: (50.0, None),
            },
            Pair {
                decode: (6.0, None),
                prefill: (70.0, None),
            },
        ];
        let table = Table::new(&pairs);
        let text = table.render();
        assert!(
            text.starts_with("| run | decode ours | prefill ours |\n"),
            "{text}"
        );
        assert!(text.ends_with("| median | 5.00 | 60.00 |\n"), "{text}");
        let summary = by_depth(&[(256, table.medians())], false);
        assert!(summary.ends_with("| 256 | 5.00 | 60.00 |\n"), "{summary}");
    }

    #[test]
    fn depths_parse_as_a_comma_list() {
        assert_eq!(
            parse_depths("0,4096, 16384,65536").unwrap(),
            [0, 4096, 16384, 65536]
        );
        assert!(parse_depths("4k").is_err());
    }

    /// llama.cpp's Kimi-K3 takes its training context from the GGUF's `context_length`,
    /// written from `max_position_embeddings`: the release config's must cover the deepest
    /// depth the issue asks for (past it llama.cpp would warn of an overflow).
    #[test]
    fn the_release_gguf_declares_a_context_past_the_deepest_depth() {
        use crate::gguf::Value;
        use crate::gguf_k3_meta::{Outtype, merged_hparams, metadata};
        let config: serde_json::Value = serde_json::from_str(include_str!(
            "../../../crates/k3-model/configs/Kimi-K3.config.json"
        ))
        .unwrap();
        let hp = merged_hparams(&config).unwrap();
        let kv = metadata(&hp, "Kimi-K3", Outtype::Bf16, true).unwrap();
        let context = kv.iter().find(|(k, _)| k == "kimi-k3.context_length");
        let Some((_, Value::U32(context))) = context else {
            panic!("no u32 kimi-k3.context_length in {kv:?}");
        };
        // The deepest depth with llama-bench's default prompt and generation on top.
        assert!(*context as usize >= 65_536 + 512 + 128, "{context}");
    }
}
