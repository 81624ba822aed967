//! Verify passes and rollback (speculative decoding's model side): a pass that feeds a
//! sequence's next token and drafted tokens gives, row by row, the logits of decoding them one
//! by one, and `Model::rollback` takes the rejected drafts back so the session continues with
//! the bits of a session that never saw them — alone, beside other sequences in the step, with
//! several domains and threads (every task split), and for any acceptance pattern.

use std::sync::Arc;

use expert_store::Checkpoint;
use k3_model::model::{Model, Want, fingerprint};
use k3_model::synth::{Preset, SynthOptions, generate};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;
use numa_sched::{Pool, Threads, Topology};

/// The true continuation the drafts are checked against (any token ids of tiny's vocabulary).
const TRUE: [usize; 24] = [
    1, 500, 17, 42, 1023, 7, 7, 300, 64, 65, 900, 2, 333, 128, 256, 511, 9, 10, 11, 12, 700, 701,
    5, 6,
];

fn tiny(tag: &str) -> (Scratch, k3_model::K3Config) {
    let dir = Scratch::new(&format!("rollback-{tag}"));
    let config = generate(dir.path(), &SynthOptions::new(Preset::Tiny))
        .unwrap()
        .config;
    (dir, config)
}

/// Fingerprints of the logits after each of `TRUE`'s tokens, decoded one by one.
fn reference(model: &Model<'_>) -> Vec<u64> {
    let mut session = model.session();
    TRUE.iter()
        .map(|&t| fingerprint(&model.decode_step(&mut session, t).unwrap()))
        .collect()
}

/// Decodes `TRUE` by verify passes: each pass feeds the next true token and `drafts` drafted
/// ones, of which the first `right` are the true continuation and the rest wrong; keeps the
/// rows up to the first wrong draft (as the sampler would), rolls the rest back. Another
/// sequence decodes `TRUE` beside it in the same steps, one token a step. Returns the kept
/// rows' fingerprints (one per true token) and the neighbour's (one per step).
fn by_verify_passes(model: &Model<'_>, pattern: &[(usize, usize)]) -> (Vec<u64>, Vec<u64>) {
    let mut session = model.session();
    let mut neighbour = model.session();
    let (mut kept, mut beside) = (Vec::new(), Vec::new());
    let mut at = 0;
    let mut turn = 0;
    while at < TRUE.len() {
        let (drafts, right) = pattern[turn % pattern.len()];
        turn += 1;
        let mut tokens = vec![TRUE[at]];
        for i in 0..drafts {
            let truth = TRUE.get(at + 1 + i).copied();
            // A wrong draft: any token but the true one.
            let token = match truth {
                Some(t) if i < right => t,
                Some(t) => (t + 1 + i) % 1024,
                None => 3,
            };
            tokens.push(token);
        }
        session.checkpoint();
        let start = session.position();
        let next = beside.len();
        let mut groups = vec![(&mut session, &tokens[..])];
        let lone = [TRUE[next.min(TRUE.len() - 1)]];
        let with_neighbour = next < TRUE.len();
        if with_neighbour {
            groups.push((&mut neighbour, &lone[..]));
        }
        let wants = [Want::All, Want::Last];
        let n = groups.len();
        let rows = model.step_rows(&mut groups, &wants[..n]).unwrap();
        if with_neighbour {
            beside.push(fingerprint(&rows[1][0]));
        }
        // Row i follows tokens[..=i]: it is kept while tokens[..=i] are all true.
        let good = 1 + tokens[1..]
            .iter()
            .zip(&TRUE[at + 1..])
            .take_while(|(a, b)| a == b)
            .count();
        let good = good.min(TRUE.len() - at);
        kept.extend(rows[0][..good].iter().map(|r| fingerprint(r)));
        assert_eq!(session.position(), start + tokens.len());
        model.rollback(&mut session, start + good).unwrap();
        assert_eq!(session.position(), start + good);
        assert_eq!(session.checkpoint_position(), None);
        at += good;
    }
    (kept, beside)
}

/// Acceptance patterns: (drafts, of which right), cycled over the passes.
const PATTERNS: [&[(usize, usize)]; 5] = [
    &[(0, 0)],
    &[(4, 4)],
    &[(4, 0)],
    &[(3, 1), (5, 5), (1, 0), (6, 2)],
    &[(7, 6), (2, 2), (0, 0), (4, 3)],
];

#[test]
fn verify_passes_and_rollback_give_the_bits_of_decoding_one_by_one() {
    let (dir, config) = tiny("one");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
    let truth = reference(&model);
    for pattern in PATTERNS {
        let (kept, beside) = by_verify_passes(&model, pattern);
        assert_eq!(kept, truth, "pattern {pattern:?}");
        // The neighbour advances one token a step, so it is as far as the passes went.
        assert!(!beside.is_empty());
        assert_eq!(
            beside,
            truth[..beside.len()],
            "the neighbour, pattern {pattern:?}"
        );
    }
}

#[test]
fn rollback_holds_with_several_domains_and_every_task_split() {
    let (dir, config) = tiny("numa");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let kernels = Kernels::detect();
    let truth = reference(&Model::new(&ckpt, &config, kernels).unwrap());
    let cpus: Vec<usize> = (0..2).collect();
    for domains in [1, 2] {
        let topology = Topology::split(&cpus, domains, Vec::new());
        let pool = Arc::new(Pool::with_topology(topology, Threads::Total(2)).unwrap());
        let model = Model::new(&ckpt, &config, kernels)
            .unwrap()
            .with_pool(pool)
            .with_parallel_threshold(0);
        for pattern in PATTERNS {
            let (kept, _) = by_verify_passes(&model, pattern);
            assert_eq!(kept, truth, "{domains} domains, pattern {pattern:?}");
        }
    }
}

/// A rollback to where the session is keeps everything; one outside the checkpoint's span, or
/// without a checkpoint, is refused and changes nothing.
#[test]
fn rollback_bounds_are_checked() {
    let (dir, config) = tiny("bounds");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
    let mut session = model.session();
    model.prefill(&mut session, &TRUE[..4], 4).unwrap();
    let err = model.rollback(&mut session, 2).unwrap_err().to_string();
    assert!(err.contains("no checkpoint"), "{err}");
    session.checkpoint();
    model.prefill(&mut session, &TRUE[4..8], 4).unwrap();
    let err = model.rollback(&mut session, 3).unwrap_err().to_string();
    assert!(err.contains("outside the checkpoint's span 4..=8"), "{err}");
    let err = model.rollback(&mut session, 9).unwrap_err().to_string();
    assert!(err.contains("outside"), "{err}");
    assert_eq!(session.position(), 8);
    model.rollback(&mut session, 8).unwrap();
    assert_eq!(session.position(), 8);
    let next = model.decode_step(&mut session, TRUE[8]).unwrap();
    let mut straight = model.session();
    let want = model.prefill(&mut straight, &TRUE[..9], 9).unwrap();
    assert_eq!(fingerprint(&next), fingerprint(&want));
}
