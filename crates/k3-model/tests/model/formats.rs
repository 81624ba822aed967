//! Checkpoint formats by tensor, not by name (docs/ARCHITECTURE.md contract 3), on copies of the `tiny`
//! preset written in other formats: an F32 trunk of the BF16 values decodes to the BF16
//! checkpoint's bits; an F16 trunk to the bits of the F32 checkpoint of its widened values, and
//! near the BF16 one; float vectors (conv taps, `A_log`, `dt_bias`, `o_norm`, norms) in F32,
//! BF16 or F16 holding the same values give the same bits; MXFP4 trunk linears give the bits
//! of their BF16 twin. Each through the mapped and the streamed expert paths and a resident
//! trunk, in the exact tiers (scalar and, where the CPU has it, avx512).

use std::sync::Arc;

use expert_store::checkpoint::Dtype;
use expert_store::{Capacity, Checkpoint, ExpertStore, Policy, StoreConfig};
use k3_model::checks::{trunk_tensor_names, validate};
use k3_model::config::K3Config;
use k3_model::model::{Model, expert_layout, fingerprint};
use k3_model::synth::{FloatFormat, Preset, SynthFormats, SynthOptions, generate_with};
use k3_testkit::Scratch;
use mxfp4_kernels::Kernels;

fn tiny(tag: &str, formats: &SynthFormats) -> (Scratch, K3Config) {
    let dir = Scratch::new(&format!("formats-{tag}"));
    let options = SynthOptions {
        seed: 5,
        ..SynthOptions::new(Preset::Tiny)
    };
    let report = generate_with(dir.path(), &options, formats).unwrap();
    (dir, report.config)
}

const TOKENS: [usize; 10] = [1, 500, 17, 42, 1023, 7, 300, 64, 900, 2];

/// The exact tiers this CPU runs: the default (`detect`) and the scalar oracle.
fn exact_tiers() -> Vec<Kernels> {
    let mut tiers = vec![Kernels::scalar()];
    if Kernels::detect() != Kernels::scalar() {
        tiers.push(Kernels::detect());
    } else {
        eprintln!("note: no avx512 tier on this CPU; the scalar tier alone is compared");
    }
    tiers
}

/// Every step's logits, decoded token by token.
fn decode(model: &Model<'_>) -> Vec<Vec<f32>> {
    let mut session = model.session();
    TOKENS
        .iter()
        .map(|&t| model.decode_step(&mut session, t).unwrap())
        .collect()
}

fn prints(rows: &[Vec<f32>]) -> Vec<u64> {
    rows.iter().map(|r| fingerprint(r)).collect()
}

/// Logits of the checkpoint in `dir` through three load paths — mapped experts, streamed
/// experts (a 1-per-layer cache, 2 threads), a resident trunk — which must agree bit for bit;
/// returns the mapped logits.
fn logits_every_path(dir: &std::path::Path, config: &K3Config, kernels: Kernels) -> Vec<Vec<f32>> {
    let mut ckpt = Checkpoint::open(dir).unwrap();
    validate(&ckpt, config).unwrap();
    let mapped = decode(&Model::new(&ckpt, config, kernels).unwrap());
    let store = Arc::new(
        ExpertStore::open(
            &ckpt,
            expert_layout(config),
            StoreConfig {
                capacity: Capacity::PerLayer(1),
                policy: Policy::Lru,
                io_threads: 2,
                ..StoreConfig::default()
            },
        )
        .unwrap(),
    );
    let pool = Arc::new(numa_sched::Pool::new(2).unwrap());
    let streamed = decode(
        &Model::with_expert_store(&ckpt, config, kernels, store)
            .unwrap()
            .with_pool(Arc::clone(&pool))
            .with_parallel_threshold(0),
    );
    assert_eq!(prints(&streamed), prints(&mapped), "streamed vs mapped");
    // The resident copy holds exactly the trunk as stored (MXFP4 linears' two tensors too).
    let trunk = trunk_tensor_names(&ckpt, config);
    let expected: usize = trunk
        .iter()
        .map(|name| ckpt.tensor(name).unwrap().bytes.len())
        .sum();
    let copied = ckpt.make_resident(|stored| trunk.contains(stored)).unwrap();
    assert!(
        copied >= expected && copied < expected + 64 * trunk.len(),
        "{copied} vs {expected}"
    );
    let resident = decode(
        &Model::new(&ckpt, config, kernels)
            .unwrap()
            .with_pool(pool)
            .with_parallel_threshold(0),
    );
    assert_eq!(
        prints(&resident),
        prints(&mapped),
        "resident trunk vs mapped"
    );
    mapped
}

fn dtype_of(dir: &std::path::Path, name: &str) -> Dtype {
    Checkpoint::open(dir).unwrap().require(name).unwrap().dtype
}

fn formats(trunk: FloatFormat) -> SynthFormats {
    SynthFormats {
        trunk,
        ..SynthFormats::default()
    }
}

/// Acceptance 6: an F32 copy whose weights are the BF16 values widened decodes to the BF16
/// checkpoint's logits, bit for bit, at every step.
#[test]
fn f32_trunk_of_bf16_values_gives_the_bf16_bits() {
    let (bf16, config) = tiny("bf16", &SynthFormats::default());
    let (f32, _) = tiny("f32", &formats(FloatFormat::F32));
    for name in [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ] {
        assert_eq!(
            dtype_of(f32.path(), &format!("language_model.{name}")),
            Dtype::F32,
            "{name}"
        );
    }
    for kernels in exact_tiers() {
        let want = logits_every_path(bf16.path(), &config, kernels);
        let got = logits_every_path(f32.path(), &config, kernels);
        assert_eq!(
            prints(&got),
            prints(&want),
            "{}: f32 vs bf16 trunk",
            kernels.tier()
        );
    }
}

/// An F16 trunk (the BF16 values rounded to F16) decodes to the bits of the F32 checkpoint of
/// its widened values (same kernel order), and stays near the BF16 checkpoint.
///
/// The bound: every BF16 value of magnitude at least 2^-17 is exact in F16 (8 significant bits
/// fit in F16's 11 down to the subnormal quantum 2^-24), so the F16 copy moves only the weights
/// below 2^-17 (a few per thousand of these `U(±sqrt(3/fan_in))` weights), each by at most
/// 2^-25: a perturbation of relative size ~1e-6 of the weights, which nine layers carry to the
/// logits. Measured on the scalar tier: max gap 2.2e-5 at max |logit| 3.6 (6e-6 relative). The
/// bound, 1e-4 x max|logit|, leaves a 16x margin and is still four orders below the logits'
/// spread, so a misdecoded F16 weight (an exponent or half swapped) cannot pass it.
#[test]
fn f16_trunk_equals_its_f32_twin_and_stays_near_bf16() {
    let (bf16, config) = tiny("f16-ref", &SynthFormats::default());
    let (f16, _) = tiny("f16", &formats(FloatFormat::F16));
    let (twin, _) = tiny(
        "f16-twin",
        &SynthFormats {
            trunk: FloatFormat::F32,
            trunk_f16_values: true,
            ..SynthFormats::default()
        },
    );
    assert_eq!(
        dtype_of(f16.path(), "language_model.lm_head.weight"),
        Dtype::F16
    );
    for kernels in exact_tiers() {
        let got = logits_every_path(f16.path(), &config, kernels);
        let exact = logits_every_path(twin.path(), &config, kernels);
        assert_eq!(
            prints(&got),
            prints(&exact),
            "{}: f16 vs its f32 twin",
            kernels.tier()
        );
        let reference = logits_every_path(bf16.path(), &config, kernels);
        let scale = reference
            .iter()
            .flatten()
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let gap = got
            .iter()
            .flatten()
            .zip(reference.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "{}: f16 vs bf16 trunk: max gap {gap:e}, max |logit| {scale}",
            kernels.tier()
        );
        assert!(
            gap <= 1e-4 * scale,
            "{}: f16 trunk logits differ from bf16 by {gap:e} (max |logit| {scale})",
            kernels.tier()
        );
    }
}

/// KDA conv taps, `A_log` (zero-padded), `dt_bias`, `o_norm` and every norm stored as BF16 or
/// F16 load, and give the bits of the F32 checkpoint holding the same values.
#[test]
fn float_vectors_in_bf16_or_f16_equal_the_f32_ones() {
    let vectors = |format| SynthFormats {
        vectors: Some(format),
        ..SynthFormats::default()
    };
    let (f32, config) = tiny("vec-f32", &vectors(FloatFormat::F32));
    let want: Vec<_> = exact_tiers()
        .into_iter()
        .map(|k| prints(&logits_every_path(f32.path(), &config, k)))
        .collect();
    for (format, dtype) in [
        (FloatFormat::Bf16, Dtype::BF16),
        (FloatFormat::F16, Dtype::F16),
    ] {
        let (dir, _) = tiny(&format!("vec-{format}"), &vectors(format));
        for name in [
            "self_attn.q_conv1d.weight",
            "self_attn.A_log",
            "self_attn.dt_bias",
            "self_attn.o_norm.weight",
            "input_layernorm.weight",
        ] {
            let name = format!("language_model.model.layers.0.{name}");
            assert_eq!(dtype_of(dir.path(), &name), dtype, "{name}");
        }
        for (kernels, want) in exact_tiers().into_iter().zip(&want) {
            let got = prints(&logits_every_path(dir.path(), &config, kernels));
            assert_eq!(&got, want, "{}: {format} vectors vs f32", kernels.tier());
        }
    }
}

/// Trunk linears stored as MXFP4 (`weight_packed` + `weight_scale`; every one, the embedding,
/// lm_head, router and `kv_b_proj` included) load and give the bits of the BF16 checkpoint
/// holding their exact dequantised values.
#[test]
fn mxfp4_trunk_linears_give_their_bf16_twins_bits() {
    for selection in [
        vec!["all".to_owned()],
        vec!["shared_experts".into(), "o_proj".into()],
    ] {
        let mx = SynthFormats {
            mxfp4_linears: selection.clone(),
            ..SynthFormats::default()
        };
        let tag = selection.join("-");
        let (dir, config) = tiny(&format!("mx-{tag}"), &mx);
        let (twin, _) = tiny(
            &format!("mx-twin-{tag}"),
            &SynthFormats {
                mxfp4_as_bf16: true,
                ..mx.clone()
            },
        );
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let o_proj = "model.layers.1.self_attn.o_proj";
        assert!(ckpt.tensor(&format!("{o_proj}.weight")).is_none());
        assert_eq!(
            ckpt.require(&format!("{o_proj}.weight_packed"))
                .unwrap()
                .dtype,
            Dtype::U8
        );
        assert_eq!(
            ckpt.tensor("lm_head.weight").is_none(),
            selection[0] == "all",
            "lm_head is MXFP4 only when all linears are"
        );
        for kernels in exact_tiers() {
            let got = prints(&logits_every_path(dir.path(), &config, kernels));
            let want = prints(&logits_every_path(twin.path(), &config, kernels));
            assert_eq!(
                got,
                want,
                "{}: mxfp4 {selection:?} vs its bf16 twin",
                kernels.tier()
            );
        }
    }
}

/// Formats outside the roles' sets are refused with the tensor, the formats accepted and the
/// one found: a linear weight stored as I32 bytes, a vector as U8.
#[test]
fn unsupported_formats_are_refused_by_name() {
    use expert_store::writer::{TensorOut, write_safetensors};
    let (dir, config) = tiny("refuse", &SynthFormats::default());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    // Rewrite the globals' shard with lm_head as I32 (its shape kept), then with lm_head F32
    // and the final norm U8.
    let t = ckpt.require("lm_head.weight").unwrap();
    let (path, shape) = (t.path.to_owned(), t.shape.to_vec());
    let index = dir.path().join("model.safetensors.index.json");
    let weight_map: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let file_name = path.file_name().unwrap().to_str().unwrap();
    let others: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = weight_map["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(name, file)| *file == file_name && !name.ends_with("lm_head.weight"))
        .map(|(name, _)| {
            let t = ckpt.tensor(name).unwrap();
            (name.clone(), t.dtype, t.shape.to_vec(), t.bytes.to_vec())
        })
        .collect();
    drop(ckpt);
    let rewrite = |lm_head_dtype: Dtype, norm_dtype: Option<Dtype>| {
        let mut outs: Vec<TensorOut> = others
            .iter()
            .map(|(name, dtype, shape, _)| TensorOut {
                name: name.clone(),
                dtype: match norm_dtype {
                    Some(d) if name.ends_with("model.norm.weight") => d,
                    _ => *dtype,
                },
                shape: shape.clone(),
            })
            .collect();
        outs.push(TensorOut {
            name: "language_model.lm_head.weight".into(),
            dtype: lm_head_dtype,
            shape: shape.clone(),
        });
        write_safetensors(&path, outs, |t, buf| {
            let n: usize = t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
            match others.iter().find(|o| o.0 == t.name) {
                Some(o) if o.3.len() == n => buf.extend_from_slice(&o.3),
                _ => buf.extend(std::iter::repeat_n(0u8, n)),
            }
        })
        .unwrap();
        // The index's total size changes with the dtypes: drop it (it is optional).
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("metadata");
        std::fs::write(&index, json.to_string()).unwrap();
    };
    rewrite(Dtype::I32, None);
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &config)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains("BF16, F16 or F32") && err.contains("I32"),
        "{err}"
    );
    rewrite(Dtype::F32, Some(Dtype::U8));
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &config)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.norm.weight") && err.contains("F32, BF16 or F16") && err.contains("U8"),
        "{err}"
    );
}

/// The census `k3-check` prints: bytes by format and class, summing to the checkpoint's
/// tensor bytes, with each class in the format it was written in.
#[test]
fn format_census_counts_every_byte_by_class_and_format() {
    use k3_model::checks::{Class, Format, census};
    let (dir, config) = tiny(
        "census",
        &SynthFormats {
            trunk: FloatFormat::F32,
            vectors: Some(FloatFormat::F16),
            mxfp4_linears: vec!["shared_experts".into()],
            ..SynthFormats::default()
        },
    );
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let cells = census(&ckpt, &config);
    assert_eq!(
        cells.values().map(|c| c.bytes).sum::<u64>(),
        ckpt.data_bytes() as u64
    );
    for (format, class) in [
        (Format::F32, Class::TrunkLinear),
        (Format::F32, Class::LmHead),
        (Format::F16, Class::SmallVectors),
        // The shared experts' MXFP4 linears are trunk linears.
        (Format::MxFp4, Class::TrunkLinear),
        (Format::MxFp4, Class::RoutedExperts),
    ] {
        assert!(
            cells.get(&(format, class)).is_some_and(|c| c.bytes > 0),
            "{format:?} {class:?}: {cells:?}"
        );
    }
    assert!(
        !cells.keys().any(|(format, _)| *format == Format::Bf16),
        "{cells:?}"
    );
    // Every shared-expert linear is stored as MXFP4, and nothing else in the trunk is.
    for spec in k3_model::inventory::text_tensors(&config) {
        if spec.role() != k3_model::inventory::Role::Linear {
            continue;
        }
        let mxfp4 = matches!(
            ckpt.linear_format(&spec.name).unwrap(),
            expert_store::checkpoint::LinearStorage::MxFp4(_)
        );
        assert_eq!(mxfp4, spec.name.contains("shared_experts"), "{}", spec.name);
    }
}
