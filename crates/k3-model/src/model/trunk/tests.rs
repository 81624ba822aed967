//! The trunk stream on the tiny checkpoint: every layout the planner can make (units whole,
//! the lm_head and the dense MLP in row blocks, one or two buffers, part resident) gives the
//! mapped run's logits bits, for decode steps, chunked scoring and a prefill that skips the
//! lm_head.

use std::sync::Arc;

use expert_store::Checkpoint;
use mxfp4_kernels::Kernels;
use numa_sched::Pool;

use super::resident::ResidentTrunk;
use crate::config::K3Config;
use crate::model::{Model, fingerprint};
use crate::plan::{Layout, Part, StoredTensor, WeightSizes, read_bytes};
use crate::synth::{Preset, SynthOptions, generate};

const TOKENS: [usize; 7] = [5, 17, 42, 7, 300, 2, 999];

/// Decode-step fingerprints, chunked scoring (each must match), and a prefill in chunks of
/// 3 (earlier chunks skip the lm_head) followed by one step.
fn fingerprints(model: &Model<'_>) -> (Vec<u64>, u64) {
    let mut session = model.session();
    let stepped: Vec<u64> = TOKENS
        .iter()
        .map(|&t| fingerprint(&model.decode_step(&mut session, t).unwrap()))
        .collect();
    let mut session = model.session();
    let chunked: Vec<u64> = model
        .score(&mut session, &TOKENS, 4)
        .unwrap()
        .iter()
        .map(|l| fingerprint(l))
        .collect();
    assert_eq!(chunked, stepped, "chunked scoring");
    let mut session = model.session();
    model.prefill(&mut session, &TOKENS[..6], 3).unwrap();
    let after = fingerprint(&model.decode_step(&mut session, TOKENS[6]).unwrap());
    assert_eq!(after, stepped[6], "after a prefill");
    (stepped, after)
}

fn model<'a>(ckpt: &'a Checkpoint, config: &K3Config) -> Model<'a> {
    Model::new(ckpt, config, Kernels::detect())
        .unwrap()
        .with_pool(Arc::new(Pool::new(2).unwrap()))
        .with_parallel_threshold(0)
}

#[test]
fn every_layout_streams_the_mapped_bits() {
    let dir = std::env::temp_dir().join(format!("k3-trunk-layouts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = generate(&dir, &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let expected = fingerprints(&model(&ckpt, &config));
    // Resident BF16 matrices as stored, then packed, then packed with the streamed ones read
    // packed from a pack cache: the same bits every way.
    let mut packed_pieces = 0;
    let mut cache_steps = 0;
    let cache_path = dir
        .join("cache")
        .join(crate::packcache::place::file_name(1));
    for (pack, cached) in [(false, false), (true, false), (true, true)] {
        let mut sizes = match pack {
            true => WeightSizes::new(&ckpt, &config).unwrap(),
            false => WeightSizes::new(&ckpt, &config).unwrap().unpacked(),
        };
        let cache = cached.then(|| {
            let cache = crate::packcache::types::PackCache::write(
                &cache_path,
                1,
                &sizes.packable(),
                &Pool::new(2).unwrap(),
                &[],
            )
            .unwrap();
            Arc::new(cache)
        });
        if let Some(cache) = &cache {
            sizes = cache.sizes_with(sizes);
            assert!(sizes.packed_side > 0);
        }
        let head: Vec<StoredTensor> = sizes
            .head
            .iter()
            .filter(|t| t.part == Part::Head)
            .cloned()
            .collect();
        let lm_head = read_bytes(&head);
        let trunk = sizes.trunk_resident_bytes();
        let forced = |cap| crate::plan::forced_bytes(&sizes, cap);
        // (cap, room for resident tensors beyond what the cap forces, slots)
        let cases = [
            // Nothing resident, units whole (the lm_head one block).
            (trunk, 0, 1),
            (trunk, 0, 2),
            // The lm_head and the dense MLP in row blocks, the large units part resident.
            (lm_head / 4, 0, 1),
            (lm_head / 4, 0, 2),
            (lm_head / 7, 0, 2),
            // An odd cap (the last block is short), more resident than the cap forces.
            (lm_head / 3 + 777, trunk / 8, 1),
            // Room for every tensor but about two thirds of the lm_head: its leading rows
            // resident, the rest streamed.
            (
                lm_head / 4,
                (trunk - 2 * lm_head / 3).saturating_sub(forced(lm_head / 4)),
                2,
            ),
        ];
        let mut split = std::collections::HashSet::new();
        let mut partly_resident = 0;
        for (cap, extra, slots) in cases {
            let room = forced(cap) + extra + slots * cap + sizes.packed_side;
            let layout = Layout::new(&sizes, room, cap, slots).expect("room for the layout");
            let plan = &layout.trunk;
            assert!(
                plan.streams(),
                "cap {cap} lm_head {lm_head} trunk {trunk} forced {}",
                forced(cap)
            );
            // Matrices cut into more than one block: the lm_head's, a dense MLP's.
            for part in [Part::Head, Part::Gate, Part::Up, Part::Down] {
                let blocks = plan.steps.iter().filter(|s| s.part == part).count();
                if blocks > 1 {
                    split.insert(part);
                }
            }
            if !plan.resident_rows.is_empty() {
                partly_resident += 1;
            }
            let from_cache = plan
                .steps
                .iter()
                .filter(|s| s.tensors.iter().any(|t| t.packed_at.is_some()))
                .count();
            assert_eq!(
                from_cache > 0,
                cached,
                "cap {cap}: steps read from the pack cache"
            );
            cache_steps += from_cache;
            let resident =
                (!plan.resident.is_empty() || !plan.resident_rows.is_empty()).then(|| {
                    Arc::new(
                        ResidentTrunk::load(
                            &ckpt,
                            &plan.resident,
                            &plan.resident_rows,
                            &sizes.packed_cols(),
                            cache.as_deref(),
                            &Pool::new(2).unwrap(),
                            &[],
                        )
                        .unwrap(),
                    )
                });
            if let Some(r) = &resident {
                let summary = r.packed_summary();
                packed_pieces += summary.pieces;
                assert_eq!(summary.pieces > 0, pack, "cap {cap}: {summary:?}");
                // With a pack cache every packed piece is read from it.
                let cached_pieces = if cached { summary.pieces } else { 0 };
                assert_eq!(summary.cached, cached_pieces, "cap {cap}: {summary:?}");
                if pack {
                    // The plan counts room for 2% of blocks kept as BF16; the tiny checkpoint's
                    // weights need fewer.
                    let bytes = r.bytes() as u64;
                    assert!(
                        bytes <= layout.resident,
                        "cap {cap}: {bytes} > {}",
                        layout.resident
                    );
                    assert!(
                        summary.packed_bytes * 10 < summary.bf16_bytes * 8,
                        "{summary:?}"
                    );
                } else {
                    assert_eq!(r.bytes() as u64, layout.resident, "cap {cap}");
                }
            }
            let streamed = model(&ckpt, &config)
                .with_planned_trunk(&ckpt, plan, resident, cache.clone(), &[])
                .unwrap();
            assert_eq!(
                fingerprints(&streamed),
                expected,
                "cap {cap}, {} steps, {} buffers, {} bytes resident",
                plan.steps.len(),
                slots,
                layout.resident
            );
            // Every pass read the whole stream, the lm_head's steps too where the pass skipped
            // it (the I/O thread runs up to `slots` steps ahead): 7 steps, 2 chunks scored, 2
            // chunks prefilled and a step.
            let passes = (TOKENS.len() + 2 + 2 + 1) as u64;
            let per_pass = plan.streamed_read_bytes();
            let read = streamed.streamed_trunk_bytes();
            assert!(
                read >= passes * per_pass
                    && read <= passes * per_pass + slots * plan.buffer_bytes(),
                "{read} bytes read for {passes} passes of {per_pass}"
            );
        }
        assert_eq!(split.len(), 4, "cut in row blocks: {split:?}");
        // Some layout kept the leading rows of a matrix resident and streamed the rest.
        assert!(
            partly_resident > 0,
            "no layout kept part of a matrix resident"
        );
    }
    assert!(packed_pieces > 0, "no layout kept a packed matrix");
    assert!(cache_steps > 0, "no layout read packed steps");
    drop(ckpt);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lossy `--trunk-format` holds each requantised matrix as the quantiser's blocks of its
/// stored rows (Q8_0 blocks row after row; MXFP4 codes of every row, then scales), whole or
/// for any range of rows a view asks for; the matrices it keeps stay packed losslessly.
#[test]
fn a_requantised_trunk_holds_the_quantisers_blocks() {
    use mxfp4_kernels::WeightMatrix;
    use mxfp4_kernels::codes::{bf16_to_f32, quantize_group};

    use crate::plan::{QuantFormat, TrunkFormat};

    let dir = std::env::temp_dir().join(format!("k3-trunk-requant-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = generate(&dir, &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let formats = [
        TrunkFormat::MxFp4 { all: false },
        TrunkFormat::MxFp4 { all: true },
        TrunkFormat::Q8_0 { all: false },
        TrunkFormat::Q8_0 { all: true },
    ];
    for format in formats {
        let sizes = WeightSizes::new(&ckpt, &config)
            .unwrap()
            .with_trunk_format(format);
        assert!(sizes.requantised(), "{format}");
        let names = sizes.read_tensors().map(|(_, t)| t.name.clone()).collect();
        let resident = ResidentTrunk::load(
            &ckpt,
            &names,
            &[],
            &sizes.packed_cols(),
            None,
            &Pool::new(2).unwrap(),
            &[],
        )
        .unwrap();
        let summary = resident.packed_summary();
        let (mut requantised, mut kept) = (0, 0);
        for (_, t) in sizes.read_tensors() {
            let Some(m) = t.float else { continue };
            let stored = ckpt.require(&t.name).unwrap();
            let row_bytes = 2 * m.cols;
            // Whole, and rows 1..3 alone.
            for rows in [0..t.rows, 1..3.min(t.rows)] {
                let bytes = &stored.bytes[rows.start * row_bytes..rows.end * row_bytes];
                let view = resident
                    .find_packed(bytes)
                    .expect("held packed or requantised");
                let values: Vec<f32> = bytes
                    .chunks_exact(2)
                    .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                    .collect();
                let groups = values.chunks_exact(32).map(|g| g.try_into().unwrap());
                match (t.quant, view) {
                    (Some(QuantFormat::MxFp4), WeightMatrix::MxFp4(v)) => {
                        let (codes, scales): (Vec<[u8; 16]>, Vec<u8>) =
                            groups.map(|g: &[f32; 32]| quantize_group(g)).unzip();
                        assert_eq!(v.packed(), codes.concat(), "{} {rows:?}", t.name);
                        assert_eq!(v.scales(), scales, "{} {rows:?}", t.name);
                        requantised += 1;
                    }
                    (Some(QuantFormat::Q8_0), WeightMatrix::Q8_0(v)) => {
                        let blocks: Vec<[u8; 34]> = groups
                            .map(|g: &[f32; 32]| mxfp4_kernels::codes::quantize_q8_0(g))
                            .collect();
                        assert_eq!(v.bytes(), blocks.concat(), "{} {rows:?}", t.name);
                        requantised += 1;
                    }
                    (None, WeightMatrix::PackedBf16(v)) => {
                        assert!(m.kept, "{} is kept by {format}", t.name);
                        assert_eq!(v.rows(), rows.len());
                        kept += 1;
                    }
                    (quant, view) => {
                        panic!("{}: planned {quant:?}, held as {}", t.name, view.format())
                    }
                }
            }
        }
        assert!(requantised > 0, "{format}");
        let all = matches!(
            format,
            TrunkFormat::MxFp4 { all: true } | TrunkFormat::Q8_0 { all: true }
        );
        assert_eq!(kept > 0, !all, "{format}");
        assert_eq!(
            summary.requantised * 2,
            requantised,
            "{format}: {summary:?}"
        );
    }
    drop(ckpt);
    let _ = std::fs::remove_dir_all(&dir);
}
