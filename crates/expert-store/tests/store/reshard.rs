//! A checkpoint re-sharded so experts' tensors straddle files: the expert table describes each
//! run of tensors in one file, and the streaming store reads every expert's exact bytes (one
//! read per run) — the bytes the mapping hands out.

use expert_store::writer::{ReshardLayout, reshard};
use expert_store::{Capacity, Checkpoint, ExpertStore, StoreConfig};
use k3_testkit::Scratch;

use crate::checkpoint::{EXPERTS, layout, write_checkpoint};

/// Every tensor of the source is in the copy with the same dtype, shape and bytes.
fn same_tensors(a: &Checkpoint, b: &Checkpoint) {
    assert_eq!(a.len(), b.len());
    for name in a.tensor_names() {
        let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
        assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{name}");
        assert!(x.bytes == y.bytes, "{name}: bytes differ");
    }
}

#[test]
fn experts_split_over_shards_are_read_piece_by_piece() {
    let src = Scratch::new("store-reshard-src");
    write_checkpoint(src.path(), "language_model.");
    std::fs::write(src.path().join("config.json"), "{}").unwrap();
    let source = Checkpoint::open(src.path()).unwrap();
    // One expert is 6 tensors, 2048 + 128 bytes each pair: shards of 3000 bytes hold about
    // one pair, so after a shuffle nearly every expert spans several files.
    let dst = Scratch::new("store-reshard-dst");
    let report = reshard(
        src.path(),
        dst.path(),
        ReshardLayout {
            max_shard_bytes: 3000,
            shuffle_seed: Some(7),
        },
    )
    .unwrap();
    assert!(report.shards > 10, "{report:?}");
    assert_eq!(
        std::fs::read(dst.path().join("config.json")).unwrap(),
        b"{}",
        "other files are copied"
    );
    let copy = Checkpoint::open(dst.path()).unwrap();
    same_tensors(&source, &copy);

    let table = copy.expert_table(&layout()).unwrap();
    assert_eq!(table.len(), EXPERTS);
    let spanning = table.values().filter(|l| l.spans_shards()).count();
    assert!(
        spanning >= EXPERTS / 2,
        "{spanning} of {EXPERTS} span shards"
    );
    for (key, loc) in &table {
        assert_eq!(loc.contiguous, loc.pieces.len() == 1, "{key:?}");
        // Pieces are in file order: each file's pieces together, by offset, not touching.
        for pair in loc.pieces.windows(2) {
            if pair[0].path == pair[1].path {
                assert!(pair[0].range.end < pair[1].range.start, "{key:?}: {loc:?}");
            } else {
                assert!(
                    loc.pieces.iter().filter(|p| p.path == pair[0].path).count()
                        == loc
                            .pieces
                            .iter()
                            .take_while(|p| p.path != pair[1].path)
                            .filter(|p| p.path == pair[0].path)
                            .count(),
                    "{key:?}: a file's pieces are not together: {loc:?}"
                );
            }
        }
        for i in 0..6 {
            let piece = &loc.pieces[loc.tensor_piece[i]];
            assert!(
                piece.range.start <= loc.tensors[i].start && loc.tensors[i].end <= piece.range.end
            );
            assert_eq!(loc.tensor_path(i), piece.path);
        }
    }

    for direct_io in [true, false] {
        let store = ExpertStore::open(
            &copy,
            layout(),
            StoreConfig {
                capacity: Capacity::PerLayer(0),
                io_threads: 2,
                direct_io,
                ..StoreConfig::default()
            },
        )
        .unwrap();
        let experts: Vec<usize> = (0..EXPERTS).collect();
        let mut request = store.request(1, &experts);
        let mut landed = 0;
        loop {
            let batch = request.next_batch();
            if batch.is_empty() {
                break;
            }
            for (i, expert) in batch {
                let expert = expert.unwrap();
                let base = format!("model.layers.1.block_sparse_moe.experts.{i}");
                for (m, w) in expert.matrices().iter().zip(["w1", "w3", "w2"]) {
                    let mapped = source.mxfp4_matrix(&format!("{base}.{w}"), 64, 64).unwrap();
                    assert!(m.packed() == mapped.packed(), "{base}.{w} codes");
                    assert!(m.scales() == mapped.scales(), "{base}.{w} scales");
                }
                landed += 1;
            }
        }
        assert_eq!(landed, EXPERTS);
        // One read per piece: the bytes read are the pieces' 4 KiB-aligned spans.
        let pieces: u64 = table
            .values()
            .flat_map(|l| &l.pieces)
            .map(|p| expert_store::io::aligned_span(&p.range).1 as u64)
            .sum();
        assert_eq!(store.stats().bytes_read, pieces, "direct {direct_io}");
    }
}

#[test]
fn name_order_with_large_shards_keeps_experts_whole() {
    let src = Scratch::new("store-reshard-whole-src");
    write_checkpoint(src.path(), "");
    let dst = Scratch::new("store-reshard-whole-dst");
    let report = reshard(
        src.path(),
        dst.path(),
        ReshardLayout {
            max_shard_bytes: usize::MAX,
            shuffle_seed: None,
        },
    )
    .unwrap();
    assert_eq!(report.shards, 1);
    let copy = Checkpoint::open(dst.path()).unwrap();
    same_tensors(&Checkpoint::open(src.path()).unwrap(), &copy);
    let table = copy.expert_table(&layout()).unwrap();
    assert!(table.values().all(|l| l.contiguous && !l.spans_shards()));
}
