//! The builder on the `tiny` preset: plans, the packed trunk, the expert store, warming.

use expert_store::Checkpoint;
use expert_store::io::MemoryBudget;
use expert_store::usage::{DecodeRates, UsageHistory};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;

use super::engine::Engine;
use super::experts::take_overrun;
use super::options::{BuildError, EngineOptions};
use crate::config::K3Config;
use crate::model::fingerprint;
use crate::plan::{PlanError, WeightSizes};
use crate::synth::{Preset, SynthOptions, generate};

/// A fresh `tiny` checkpoint in its own directory (removed on drop) and its config.
struct Tiny(Scratch, K3Config);

impl Tiny {
    fn new(name: &str) -> Self {
        let dir = Scratch::new(&format!("builder-{name}"));
        generate(dir.path(), &SynthOptions::new(Preset::Tiny)).unwrap();
        let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        Self(dir, K3Config::from_json(&text).unwrap())
    }

    fn build(&self, options: &EngineOptions) -> (Engine, Vec<String>) {
        let mut lines = Vec::new();
        let engine = Engine::build_within(
            self.0.path(),
            self.1.clone(),
            options,
            None,
            &mut |line: &str| lines.push(line.to_owned()),
        )
        .unwrap();
        (engine, lines)
    }
}

/// The bytes of `tiny`'s layers as stored (what a budget between the minimum and everything
/// streams some of).
fn layer_bytes(tiny: &Tiny) -> u64 {
    let sizes = WeightSizes::new(&Checkpoint::open(tiny.0.path()).unwrap(), &tiny.1).unwrap();
    let layers = sizes.layers.iter().flatten();
    layers.map(crate::plan::StoredTensor::resident_bytes).sum()
}

/// The fingerprints of the logits after each of a few teacher-forced tokens.
fn fingerprints(engine: &Engine) -> Vec<u64> {
    let model = engine.model().unwrap();
    let mut session = model.session();
    let tokens = [5, 17, 42, 7, 300, 2];
    model
        .score(&mut session, &tokens, 1)
        .unwrap()
        .iter()
        .map(|logits| fingerprint(logits))
        .collect()
}

fn options(threads: usize) -> EngineOptions {
    let mut options = EngineOptions::default();
    options.pool.threads = Some(threads);
    options.experts.usage_cache = false;
    options
}

/// Bytes a packed trunk holds beyond its plan come out of the plan-sized expert cache, or
/// the build is refused with the numbers.
#[test]
fn a_packed_trunk_over_its_plan_takes_from_the_expert_cache() {
    assert_eq!(take_overrun(Some(500), 0, 1000).unwrap(), Some(500));
    assert_eq!(take_overrun(None, 0, 1000).unwrap(), None);
    assert_eq!(take_overrun(Some(500), 200, 1000).unwrap(), Some(300));
    assert_eq!(take_overrun(Some(500), 500, 1000).unwrap(), Some(0));
    for cache in [Some(499), None] {
        let error = take_overrun(cache, 500, 1000).unwrap_err();
        assert!(error.contains("turn off the packed trunk"), "{error}");
    }
}

/// Under a budget that everything fits, the mapped weights are read in at startup (all but
/// the embedding), and the logits are the unbudgeted run's; without a budget nothing is
/// warmed.
#[test]
fn a_budget_that_everything_fits_warms_the_mapping() {
    let tiny = Tiny::new("warm");
    let (plain, lines) = tiny.build(&options(1));
    assert!(!lines.iter().any(|l| l.starts_with("warmed")), "{lines:?}");
    let expected = fingerprints(&plain);
    drop(plain);
    let budget = MemoryBudget {
        bytes: 64 << 30,
        source: "a test budget".into(),
        limit: false,
    };
    let mut lines = Vec::new();
    let engine = Engine::build_within(
        tiny.0.path(),
        tiny.1.clone(),
        &options(1),
        Some(budget),
        &mut |line: &str| lines.push(line.to_owned()),
    )
    .unwrap();
    assert!(engine.plan.trunk.is_none() && engine.store.is_none());
    let warmed = lines
        .iter()
        .find(|l| l.starts_with("warmed the mapping: "))
        .unwrap_or_else(|| panic!("{lines:?}"));
    // The tiny checkpoint's decode weights: more than nothing, less than the whole file.
    let gb: f64 = warmed["warmed the mapping: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let file = engine.checkpoint.data_bytes() as f64 / 1e9;
    assert!(gb > 0.0 && gb < file + 0.01, "{warmed} of {file} GB");
    assert!(warmed.contains("read in and mapped"), "{warmed}");
    assert_eq!(fingerprints(&engine), expected);
}

/// Under a limit that everything fits, a tier whose packed GEMV runs at the memory's rate
/// (`avx512` and the approximate tiers) holds the whole trunk resident and packed and every
/// expert cached, with the mapped run's logits; the other tiers read through the mapping as
/// without a limit.
#[test]
fn a_limit_that_everything_fits_holds_the_trunk_packed() {
    let tiny = Tiny::new("limit");
    let limit = MemoryBudget {
        bytes: 64 << 30,
        source: "a test limit".into(),
        limit: true,
    };
    for kernels in Kernels::available() {
        let mut options = options(1);
        options.kernel_tier = Some(kernels.tier());
        let (plain, _) = tiny.build(&options);
        let expected = fingerprints(&plain);
        drop(plain);
        let mut lines = Vec::new();
        let engine = Engine::build_within_limit(
            tiny.0.path(),
            tiny.1.clone(),
            &options,
            limit.clone(),
            &mut |line: &str| lines.push(line.to_owned()),
        )
        .unwrap();
        if kernels.packed_at_memory_rate() {
            let trunk = engine.plan.trunk.as_ref().expect("planned");
            assert!(!trunk.streams(), "{lines:?}");
            assert_eq!(engine.plan.expert_fraction, 1.0);
            let packed = engine.resident.as_ref().expect("resident").packed_summary();
            assert!(packed.pieces > 0, "{lines:?}");
            assert!(
                lines.iter().any(|l| l.starts_with("resident trunk: ")),
                "{lines:?}"
            );
        } else {
            assert!(engine.plan.trunk.is_none(), "{lines:?}");
            assert!(engine.resident.is_none());
        }
        assert_eq!(fingerprints(&engine), expected, "{}", kernels.tier());
    }
}

/// A resident trunk (bound per domain, two synthetic domains) and a preloaded expert store
/// change where the weights live, never the logits' bits; the sink hears each step.
#[test]
fn residency_and_placement_keep_the_logits_bits() {
    let tiny = Tiny::new("bits");
    let (mapped, lines) = tiny.build(&options(1));
    assert!(mapped.store.is_none() && mapped.plan.memory.resident_trunk == 0);
    assert!(
        lines.iter().any(|l| l.starts_with("memory plan: ")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("1 compute threads")),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.starts_with("resident trunk")),
        "{lines:?}"
    );
    let expected = fingerprints(&mapped);
    drop(mapped);

    let mut resident = options(2);
    resident.pool.fake_domains = Some(2);
    resident.resident_trunk = true;
    resident.experts.preload = true;
    let (engine, lines) = tiny.build(&resident);
    assert!(engine.plan.memory.resident_trunk > 0, "{:?}", engine.plan);
    assert!(engine.store.is_some());
    for start in ["resident trunk: ", "expert store: ", "preloaded "] {
        assert!(
            lines.iter().any(|l| l.starts_with(start)),
            "{start} in {lines:?}"
        );
    }
    assert_eq!(fingerprints(&engine), expected);
    // The usage cache is off: nothing to save.
    assert!(engine.save_usage().is_none());
}

/// A budget one byte below the plan's minimum is refused with the numbers and the
/// budget's source; at the minimum the engine is built with the trunk streamed and the
/// experts read on every use, and the logits keep their bits.
#[test]
fn a_budget_too_small_is_refused_with_numbers() {
    let tiny = Tiny::new("budget");
    let options = options(1);
    let (mapped, _) = tiny.build(&options);
    let expected = fingerprints(&mapped);
    drop(mapped);
    let budget = |bytes| {
        Some(MemoryBudget {
            bytes,
            source: "a test budget".into(),
            limit: false,
        })
    };
    let build = |bytes, lines: &mut Vec<String>| {
        Engine::build_within(
            tiny.0.path(),
            tiny.1.clone(),
            &options,
            budget(bytes),
            &mut |line: &str| lines.push(line.to_owned()),
        )
    };
    let error = build(1, &mut Vec::new()).unwrap_err();
    let BuildError::Plan(PlanError::BelowMinimum { minimum, .. }) = &error else {
        panic!("{error}")
    };
    let minimum = minimum.total();
    let error = build(minimum - 1, &mut Vec::new()).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("is below this run's minimum"), "{message}");
    assert!(message.contains("a test budget"), "{message}");
    let mut lines = Vec::new();
    let engine = build(minimum, &mut lines).unwrap();
    assert!(engine.plan.streams(), "{}", engine.plan.describe());
    // At the stored plan's minimum the packed plan does not fit (the pack cache's exception
    // blocks and indexes are held too): the matrices stream as stored, and the line says so.
    assert!(engine.pack.is_none());
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("pack cache: not used (the plan with it: ")),
        "{lines:?}"
    );
    assert_eq!(engine.plan.memory.total(), minimum);
    let plan_line = lines.iter().find(|l| l.starts_with("memory plan: "));
    assert!(
        plan_line.is_some_and(|l| l.contains("predicted from disk")),
        "{lines:?}"
    );
    // The streamed layers came from disk: every pass read the streamed trunk (the stream
    // runs up to two layers ahead, so at least the passes made, at most two layers more).
    let model = engine.model().unwrap();
    let mut session = model.session();
    let tokens = [5, 17, 42, 7, 300, 2];
    let logits = model.score(&mut session, &tokens, 1).unwrap();
    let got: Vec<u64> = logits.iter().map(|l| fingerprint(l)).collect();
    assert_eq!(got, expected);
    let streamed = engine.plan.trunk.as_ref().unwrap().streamed_read_bytes();
    let read = model.streamed_trunk_bytes();
    assert!(
        read >= tokens.len() as u64 * streamed && read <= (tokens.len() as u64 + 1) * streamed,
        "{read} bytes read for {} passes of {streamed}",
        tokens.len()
    );
    drop(model);
    drop(engine);
    // Half the layers' trunk resident, the rest streamed, what is left to the expert
    // cache (preloaded): the same bits.
    let layers = layer_bytes(&tiny);
    let mut lines = Vec::new();
    let engine = build(minimum + layers / 2, &mut lines).unwrap();
    // The streamed BF16 matrices are read packed from the pack cache, written beside the
    // checkpoint on this first run that streams them.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("pack cache: ") && l.contains("read packed")),
        "{lines:?}"
    );
    assert!(engine.pack.is_some());
    let trunk = engine.plan.trunk.as_ref().unwrap();
    assert!(trunk.streams() && !trunk.resident.is_empty(), "{trunk:?}");
    assert!(engine.store.is_some());
    // The resident share was read in within the planned size: its BF16 matrices packed
    // (the plan gives them room for 2% of blocks kept as BF16; these need fewer).
    let resident = engine.resident.as_ref().expect("a resident share");
    assert!(resident.bytes() as u64 <= engine.plan.memory.resident_trunk);
    assert!(resident.packed_summary().pieces > 0);
    assert!(
        lines.iter().any(|l| l.starts_with("resident trunk: ")),
        "{lines:?}"
    );
    assert_eq!(fingerprints(&engine), expected);
}

/// With the store and the usage cache on, the counts go to the usage file at the path
/// the options give.
#[test]
fn usage_is_saved_to_the_options_path() {
    let tiny = Tiny::new("usage");
    let mut options = options(1);
    options.experts.usage_cache = true;
    options.experts.cache_experts = Some(2);
    let path = tiny.0.path().join("usage-here.json");
    options.experts.usage_file = Some(path.clone());
    let (engine, _) = tiny.build(&options);
    fingerprints(&engine);
    let (saved, outcome) = engine.save_usage().expect("a store with the usage cache");
    assert_eq!(saved, path);
    outcome.unwrap();
    assert!(path.exists());
    // Six one-token steps read experts: the rates of the five after the first are saved.
    let rates = engine.decode_rates().expect("measured");
    assert!(rates.read_mbps > 0 && rates.compute_us > 0, "{rates:?}");
    let saved = UsageHistory::load(&path).unwrap().unwrap();
    assert_eq!(saved.rates(), Some(rates));
}

/// A start whose usage file holds an earlier run's rates, under a budget that streams,
/// plans the stream to what they hide, with the same logits.
#[test]
fn an_earlier_runs_rates_size_the_stream() {
    let tiny = Tiny::new("rates");
    let mut options = options(1);
    let unplanned = fingerprints(&tiny.build(&options).0);
    let path = tiny.0.path().join("usage-rates.json");
    options.experts.usage_cache = true;
    options.experts.usage_file = Some(path.clone());
    let sizes = WeightSizes::new(&Checkpoint::open(tiny.0.path()).unwrap(), &tiny.1).unwrap();
    // About half the trunk resident: the trunk-first plan streams the rest.
    options.memory_bytes = Some(sizes.trunk_resident_bytes() / 2 + 2_000_000);
    let first = Engine::build(tiny.0.path(), tiny.1.clone(), &options, &mut |_: &str| {}).unwrap();
    assert_eq!(first.plan.hidden, None);
    let streamed = first
        .plan
        .trunk
        .as_ref()
        .map_or(0, |t| t.streamed_read_bytes());
    assert!(streamed > 0, "{}", first.plan.describe());
    // Rates that hide more than that: 1 MB/s for as many microseconds as bytes.
    let hidden = streamed + sizes.expert_total / 4;
    let mut history = UsageHistory::default();
    history.set_rates(DecodeRates {
        read_mbps: 1,
        compute_us: hidden,
    });
    history.save(&path).unwrap();
    let second = Engine::build(tiny.0.path(), tiny.1.clone(), &options, &mut |_: &str| {}).unwrap();
    assert_eq!(second.plan.hidden, Some(hidden));
    assert!(
        second.plan.memory.expert_cache > first.plan.memory.expert_cache,
        "{} / {}",
        first.plan.describe(),
        second.plan.describe()
    );
    assert_eq!(fingerprints(&first), unplanned);
    assert_eq!(fingerprints(&second), unplanned);
}

/// A copy of `tiny`'s checkpoint in which every matrix `format` requantises holds, as stored,
/// the values its blocks decode to (`dequant`: a stored row's f32 values to the decoded ones,
/// as stored bytes), the rest unchanged.
fn dequantised_twin(
    tiny: &Tiny,
    format: crate::plan::TrunkFormat,
    dequant: impl Fn(&[f32]) -> Vec<u8>,
) -> Tiny {
    use std::io::{Seek, SeekFrom, Write};
    let twin = Scratch::new("builder-requant-twin");
    for entry in std::fs::read_dir(tiny.0.path()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), twin.path().join(entry.file_name())).unwrap();
    }
    let ckpt = Checkpoint::open(tiny.0.path()).unwrap();
    let sizes = WeightSizes::new(&ckpt, &tiny.1)
        .unwrap()
        .with_trunk_format(format);
    let mut written = 0;
    for (_, t) in sizes.read_tensors().filter(|(_, t)| t.quant.is_some()) {
        let stored = ckpt.require(&t.name).unwrap();
        assert_eq!(stored.dtype, expert_store::Dtype::BF16, "{}", t.name);
        let values: Vec<f32> = stored
            .bytes
            .chunks_exact(2)
            .map(|b| mxfp4_kernels::codes::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        let file = twin.path().join(stored.path.file_name().unwrap());
        let mut file = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        file.seek(SeekFrom::Start(stored.offset as u64)).unwrap();
        file.write_all(&dequant(&values)).unwrap();
        written += 1;
    }
    assert!(written > 0);
    Tiny(twin, tiny.1.clone())
}

/// An MXFP4 trunk gives the bits of the engine (in an exact tier) on a checkpoint that
/// stores, in BF16, the values its blocks decode to (E2M1 x 2^k is a BF16 value): the requantisation is
/// `codes::quantize_group` and nothing else, and the MXFP4 GEMV sums as the BF16 one does. It
/// is held resident with or without a limit, its bits are the same whatever the threads, the
/// (synthetic) domains and the chunking, and they differ from the stored checkpoint's.
#[test]
fn an_mxfp4_trunk_is_its_dequantised_checkpoint_and_deterministic() {
    use crate::plan::TrunkFormat;
    let tiny = Tiny::new("requant");
    let exact = fingerprints(&tiny.build(&options(1)).0);
    for format in [
        TrunkFormat::MxFp4 { all: false },
        TrunkFormat::MxFp4 { all: true },
    ] {
        let twin = dequantised_twin(&tiny, format, |values| {
            let mut bytes = Vec::with_capacity(2 * values.len());
            for group in values.chunks_exact(32) {
                let (codes, scale) =
                    mxfp4_kernels::codes::quantize_group(group.try_into().unwrap());
                for i in 0..32 {
                    let code = (codes[i / 2] >> (4 * (i % 2))) & 0xF;
                    let v = mxfp4_kernels::codes::mxfp4_value(code, scale);
                    let bf16 = mxfp4_kernels::codes::f32_to_bf16(v);
                    assert_eq!(mxfp4_kernels::codes::bf16_to_f32(bf16), v, "exact in BF16");
                    bytes.extend_from_slice(&bf16.to_le_bytes());
                }
            }
            bytes
        });
        // The exact tiers (the approximate ones round activations per format).
        for kernels in Kernels::available()
            .into_iter()
            .filter(|k| k.tier().is_exact())
        {
            let mut plain = options(1);
            plain.kernel_tier = Some(kernels.tier());
            let expected = fingerprints(&twin.build(&plain).0);
            assert_ne!(expected, exact, "{format} changed no logit");
            let mut runs = Vec::new();
            for (threads, domains, chunk) in [(1, None, 1), (2, None, 3), (2, Some(2), 4)] {
                let mut options = options(threads);
                options.kernel_tier = Some(kernels.tier());
                options.trunk_format = format;
                options.pool.fake_domains = domains;
                let (engine, lines) = tiny.build(&options);
                let trunk = engine.plan.trunk.as_ref().expect("planned resident");
                assert!(!trunk.streams(), "{lines:?}");
                let summary = engine.resident.as_ref().expect("resident").packed_summary();
                assert!(summary.requantised > 0, "{lines:?}");
                assert!(
                    lines
                        .iter()
                        .any(|l| l.contains(&format!("requantised to {format}"))),
                    "{lines:?}"
                );
                let model = engine.model().unwrap();
                let mut session = model.session();
                let logits = model
                    .score(&mut session, &[5, 17, 42, 7, 300, 2], chunk)
                    .unwrap();
                runs.push(logits.iter().map(|l| fingerprint(l)).collect::<Vec<_>>());
            }
            for run in &runs {
                assert_eq!(run, &expected, "{format}, {}", kernels.tier());
            }
        }
    }
}

/// A Q8_0 trunk: the same bits whatever the threads, the (synthetic) domains and the
/// chunking, in every exact tier, and not the stored checkpoint's. (How near they are is not
/// asked here: on the tiny model's random weights a 0.4% change of a weight can flip a
/// routing choice and move a logit by a third of the largest; the accuracy is measured on the
/// real-width slice, PERFORMANCE.md. That the blocks are the quantiser's is
/// `a_requantised_trunk_holds_the_quantisers_blocks`; that the kernels are the oracle's,
/// mxfp4-kernels' tests; the path between is the MXFP4 trunk's, tested whole above.)
#[test]
fn a_q8_0_trunk_is_deterministic_in_every_exact_tier() {
    use crate::plan::TrunkFormat;
    let tiny = Tiny::new("requant-q8");
    let tokens = [5, 17, 42, 7, 300, 2];
    let logits = |engine: &Engine, chunk: usize| {
        let model = engine.model().unwrap();
        let mut session = model.session();
        model.score(&mut session, &tokens, chunk).unwrap()
    };
    let bits = |run: &[Vec<f32>]| run.iter().map(|l| fingerprint(l)).collect::<Vec<_>>();
    let exact = bits(&logits(&tiny.build(&options(1)).0, 1));
    for format in [
        TrunkFormat::Q8_0 { all: false },
        TrunkFormat::Q8_0 { all: true },
    ] {
        for kernels in Kernels::available()
            .into_iter()
            .filter(|k| k.tier().is_exact())
        {
            let mut runs = Vec::new();
            for (threads, domains, chunk) in [(1, None, 1), (2, None, 3), (2, Some(2), 4)] {
                let mut options = options(threads);
                options.kernel_tier = Some(kernels.tier());
                options.trunk_format = format;
                options.pool.fake_domains = domains;
                let (engine, lines) = tiny.build(&options);
                let summary = engine.resident.as_ref().expect("resident").packed_summary();
                assert!(summary.requantised > 0, "{lines:?}");
                runs.push(logits(&engine, chunk));
            }
            let tier = kernels.tier();
            assert_eq!(
                bits(&runs[0]),
                bits(&runs[1]),
                "{format} {tier}: threads, chunks"
            );
            assert_eq!(
                bits(&runs[0]),
                bits(&runs[2]),
                "{format} {tier}: two domains"
            );
            assert_ne!(bits(&runs[0]), exact, "{format} changed no logit");
        }
    }
}

/// A lossy trunk is refused where it cannot be held resident: under `--resident-trunk` (a
/// copy as stored) and under a limit too small for it, with words naming the way out.
#[test]
fn a_requantised_trunk_that_cannot_be_resident_is_refused() {
    use crate::plan::TrunkFormat;
    let tiny = Tiny::new("requant-refused");
    let mut options = options(1);
    options.trunk_format = TrunkFormat::MxFp4 { all: false };
    options.resident_trunk = true;
    let err = Engine::build_within(
        tiny.0.path(),
        tiny.1.clone(),
        &options,
        None,
        &mut |_: &str| {},
    )
    .err()
    .expect("refused");
    let words = err.to_string();
    assert!(
        words.contains("--resident-trunk") && words.contains("--trunk-format bf16"),
        "{words}"
    );
}

/// A requantised trunk is written to the pack cache at the first start and read from it then
/// and at the next (nothing requantised again, the same bits); a cache of one format is never used
/// for another: each has its own file, and one renamed to another's name is refused and
/// written anew.
#[test]
fn a_requantised_trunk_is_read_from_its_pack_cache_and_only_its_own() {
    use crate::packcache::place::PackCachePlace;
    use crate::plan::TrunkFormat;
    let tiny = Tiny::new("requant-cache");
    let caches = Scratch::new("builder-requant-cache");
    let build = |format: TrunkFormat| {
        let mut options = options(2);
        options.trunk_format = format;
        options.pack_cache = PackCachePlace::Dir(caches.path().to_owned());
        tiny.build(&options)
    };
    let files = || {
        let mut names: Vec<String> = std::fs::read_dir(caches.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let q8 = TrunkFormat::Q8_0 { all: false };
    let mx = TrunkFormat::MxFp4 { all: true };
    let mut first = Vec::new();
    for format in [q8, mx] {
        let (engine, lines) = build(format);
        let cache = lines
            .iter()
            .find(|l| l.starts_with("pack cache: "))
            .expect("a cache");
        assert!(
            cache.contains("written in") && cache.contains("none was there"),
            "{cache}"
        );
        // Written in the plan's phase, then read like any other start's.
        let summary = engine.resident.as_ref().unwrap().packed_summary();
        assert!(
            summary.requantised > 0 && summary.cached == summary.pieces,
            "{summary:?}"
        );
        first.push(fingerprints(&engine));
    }
    assert_eq!(files().len(), 2, "one file per format: {:?}", files());
    // Without a cache the blocks are made at load: the same bits.
    for (format, expected) in [q8, mx].into_iter().zip(&first) {
        let mut options = options(1);
        options.trunk_format = format;
        options.pack_cache = PackCachePlace::Off;
        let (engine, lines) = tiny.build(&options);
        assert!(
            !lines.iter().any(|l| l.starts_with("pack cache: ")),
            "{lines:?}"
        );
        assert_eq!(engine.resident.as_ref().unwrap().packed_summary().cached, 0);
        assert_eq!(&fingerprints(&engine), expected, "{format} made at load");
    }
    for (format, expected) in [q8, mx].into_iter().zip(&first) {
        let (engine, lines) = build(format);
        let cache = lines
            .iter()
            .find(|l| l.starts_with("pack cache: "))
            .expect("a cache");
        assert!(!cache.contains("written in"), "{cache}");
        let summary = engine.resident.as_ref().unwrap().packed_summary();
        assert!(
            summary.requantised > 0 && summary.cached == summary.pieces,
            "{summary:?}"
        );
        assert_eq!(&fingerprints(&engine), expected, "{format} from the cache");
    }
    // The Q8_0 file put where the MXFP4 one is looked for: refused, and written anew.
    let path_of = |format| {
        let (_, lines) = build(format);
        let line = lines
            .iter()
            .find(|l| l.starts_with("pack cache: "))
            .unwrap()
            .clone();
        let path = line["pack cache: ".len()..]
            .split(" (")
            .next()
            .unwrap()
            .to_owned();
        std::path::PathBuf::from(path)
    };
    let (q8_path, mx_path) = (path_of(q8), path_of(mx));
    assert_ne!(q8_path, mx_path);
    std::fs::copy(&q8_path, &mx_path).unwrap();
    let (engine, lines) = build(mx);
    let cache = lines
        .iter()
        .find(|l| l.starts_with("pack cache: "))
        .unwrap();
    assert!(
        cache.contains("written in") && cache.contains("of another checkpoint or trunk format"),
        "{cache}"
    );
    assert_eq!(fingerprints(&engine), first[1]);
}

/// `PackRule::Measured` (the binaries' rule) measures at startup and says what it chose; the
/// trunk held packed or read through the mapping, the logits are the mapped run's bits.
#[test]
fn the_measured_pack_rule_says_why_and_keeps_the_bits() {
    use super::options::PackRule;
    let tiny = Tiny::new("measured");
    let expected = fingerprints(&tiny.build(&options(1)).0);
    let mut measured = options(2);
    measured.pack_rule = PackRule::Measured;
    let (engine, lines) = tiny.build(&measured);
    let line = lines
        .iter()
        .find(|l| l.starts_with("packed trunk: per core"))
        .unwrap_or_else(|| panic!("{lines:?}"));
    let packed = line.contains("held packed");
    assert_eq!(engine.resident.is_some(), packed, "{line}");
    if packed {
        assert!(!engine.plan.trunk.as_ref().unwrap().streams());
        assert!(engine.store.is_none(), "the experts stay mapped");
    }
    assert_eq!(fingerprints(&engine), expected, "{line}");
    // `--no-pack-trunk` measures nothing.
    measured.pack_trunk = false;
    let (_, lines) = tiny.build(&measured);
    assert!(
        !lines.iter().any(|l| l.starts_with("packed trunk:")),
        "{lines:?}"
    );
}

/// `--resident-trunk` beside a trunk the rule holds packed (`PackRule::Always` here, as where
/// the measurement finds it faster): the packed trunk is the resident copy, the copy as stored
/// is neither made nor counted, and the logits are the mapped run's bits.
#[test]
fn a_resident_trunk_held_packed_is_not_also_copied_as_stored() {
    use super::options::PackRule;
    let tiny = Tiny::new("resident-packed");
    let expected = fingerprints(&tiny.build(&options(1)).0);
    let mut stored = options(2);
    stored.resident_trunk = true;
    stored.pack_trunk = false;
    let (engine, _) = tiny.build(&stored);
    let copy = engine.plan.memory.resident_trunk;
    drop(engine);
    let mut both = options(2);
    both.resident_trunk = true;
    both.pack_rule = PackRule::Always;
    let (engine, lines) = tiny.build(&both);
    assert!(engine.resident.is_some(), "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("resident trunk: ") && l.contains("packed")),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("copied in")),
        "no copy as stored: {lines:?}"
    );
    assert!(
        engine.plan.memory.resident_trunk < copy,
        "{} against the copy's {copy}",
        engine.plan.memory.resident_trunk
    );
    assert_eq!(fingerprints(&engine), expected);
}

/// A pack cache damaged in a body (a bit flipped on disk) is found as the trunk is first read,
/// whether the resident load reads it (checked as it lands) or the stream does (checked once
/// at the start under `--scan`), removed and written again: the logits keep the bits of a
/// start without it.
#[test]
fn a_pack_cache_damaged_in_a_body_is_written_again_and_changes_no_logits() {
    use crate::packcache::place::PackCachePlace;
    use crate::plan::TrunkFormat;
    let tiny = Tiny::new("damaged-cache");
    let caches = Scratch::new("builder-damaged-cache");
    let mut options = options(2);
    options.pack_cache = PackCachePlace::Dir(caches.path().to_owned());
    // Resident and read whole from the cache: a requantised trunk.
    let mut resident = options.clone();
    resident.trunk_format = TrunkFormat::Q8_0 { all: false };
    // Streamed: a budget of the stored plan's minimum plus half the layers.
    let minimum = match Engine::build_within(
        tiny.0.path(),
        tiny.1.clone(),
        &options,
        Some(MemoryBudget {
            bytes: 1,
            source: "a test budget".into(),
            limit: false,
        }),
        &mut |_: &str| {},
    ) {
        Err(BuildError::Plan(PlanError::BelowMinimum { minimum, .. })) => minimum.total(),
        other => panic!("{other:?}"),
    };
    let layers = layer_bytes(&tiny);
    // The streamed bodies are read at the start only under `--scan`.
    let mut scanned = options.clone();
    scanned.scan = true;
    let streamed = |lines: &mut Vec<String>| {
        Engine::build_within(
            tiny.0.path(),
            tiny.1.clone(),
            &scanned,
            Some(MemoryBudget {
                bytes: minimum + layers / 2,
                source: "a test budget".into(),
                limit: false,
            }),
            &mut |line: &str| lines.push(line.to_owned()),
        )
        .unwrap()
    };
    let resident_build = |lines: &mut Vec<String>| {
        let (engine, got) = tiny.build(&resident);
        lines.extend(got);
        engine
    };
    for build in [
        &resident_build as &dyn Fn(&mut Vec<String>) -> Engine,
        &streamed,
    ] {
        let engine = build(&mut Vec::new());
        let expected = fingerprints(&engine);
        let cache = engine.pack.as_ref().expect("a pack cache");
        let path = cache.path().to_owned();
        let body = cache.at(0).body + cache.at(0).body_bytes() / 3;
        drop(engine);
        let good = std::fs::read(&path).unwrap();
        let mut bytes = good.clone();
        bytes[body] ^= 0x04;
        std::fs::write(&path, &bytes).unwrap();
        let mut lines = Vec::new();
        let engine = build(&mut lines);
        assert!(
            lines
                .iter()
                .any(|l| l.contains("is damaged") && l.ends_with("written again")),
            "{lines:?}"
        );
        assert_eq!(fingerprints(&engine), expected);
        assert_eq!(std::fs::read(&path).unwrap(), good, "written again whole");
    }
}

/// A config that leaves some of the text layers' tensors unused (here: no shared experts over
/// a checkpoint that has them) builds, since it is a valid model, but says so in a warning;
/// the checkpoint's own config leaves none unused.
#[test]
fn tensors_the_config_leaves_unused_are_reported() {
    let tiny = Tiny::new("unused");
    let (_, lines) = tiny.build(&options(2));
    assert!(
        !lines.iter().any(|l| l.contains("not used by this config")),
        "{lines:?}"
    );
    let mut config = tiny.1.clone();
    assert!(config.moe.num_shared_experts > 0);
    config.moe.num_shared_experts = 0;
    let mut lines = Vec::new();
    let built = Engine::build_within(
        tiny.0.path(),
        config,
        &options(2),
        None,
        &mut |line: &str| lines.push(line.to_owned()),
    );
    let warning = lines
        .iter()
        .find(|l| l.contains("not used by this config"))
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(warning.contains("shared_experts"), "{warning}");
    drop(built);
}
