//! Snapshots at the k3-0.40b shapes without a checkpoint (a session built from the config
//! alone): bytes as computed, restore and file round trip bit-exact, and their times printed
//! (`cargo test -p k3-model --lib snapshot -- --nocapture`).

use std::time::Instant;

use super::file::{self, Identity};
use super::{KdaState, MlaCache, Session, Snapshot, state_bytes};
use crate::config::{AttentionKind, K3Config};
use crate::synth::{Preset, preset_config};

/// A session of `config` at `tokens` positions, every value distinct-ish and non-zero.
fn filled_session(config: &K3Config, tokens: usize) -> Session {
    let k = &config.kda;
    let (rank, rope) = (config.mla.kv_lora_rank, config.mla.qk_rope_head_dim);
    let mut seed = 1u32;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
            })
            .collect()
    };
    let window = config.kda_width() * (k.conv_kernel - 1);
    let (mut kda, mut mla) = (Vec::new(), Vec::new());
    for layer in &config.layers {
        if layer.attention == AttentionKind::Kda {
            kda.push(Some(KdaState {
                windows: [values(window), values(window), values(window)],
                state: values(k.num_heads * k.head_dim * k.head_dim),
            }));
            mla.push(None);
        } else {
            kda.push(None);
            mla.push(Some(MlaCache {
                latent: values(tokens * rank).into(),
                k_pe: values(tokens * rope).into(),
            }));
        }
    }
    Session {
        position: tokens,
        kda,
        mla,
        journal: None,
        spare: None,
        mirror: Default::default(),
    }
}

/// The session's values as bits, in layer order.
fn bits(s: &Session) -> Vec<u32> {
    let snap = s.snapshot();
    let mut out = Vec::new();
    for layer in snap.layers() {
        let parts: Vec<&[f32]> = match layer {
            super::LayerState::Kda { windows, state } => {
                vec![windows[0], windows[1], windows[2], state]
            }
            super::LayerState::Mla { latent, k_pe } => vec![latent, k_pe],
            super::LayerState::Empty => vec![],
        };
        out.extend(parts.into_iter().flatten().map(|v| v.to_bits()));
    }
    out
}

fn empty_like(config: &K3Config) -> Session {
    let mut s = filled_session(config, 0);
    s.reset();
    s
}

#[test]
fn k3_040b_snapshots_round_trip_and_are_timed() {
    let config = K3Config::from_json(&preset_config(Preset::K3_040B, None, None).to_string())
        .expect("the preset's config parses");
    let dir = std::env::temp_dir().join(format!("k3-snapshot-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let identity = Identity {
        engine: file::ENGINE_VERSION.into(),
        checkpoint: 42,
    };
    for tokens in [1usize, 2000] {
        let session = filled_session(&config, tokens);
        let started = Instant::now();
        let snap: Snapshot = session.snapshot();
        let capture = started.elapsed();
        assert_eq!(snap.bytes(), state_bytes(&config, tokens));
        let mut target = empty_like(&config);
        let started = Instant::now();
        target.restore(&snap).unwrap();
        let restore = started.elapsed();
        assert_eq!(bits(&target), bits(&session));
        let ids: Vec<usize> = (0..tokens).map(|t| t % 1000).collect();
        let path = dir.join(format!("{tokens}.k3state"));
        let started = Instant::now();
        let report = file::save(&path, &identity, &ids, &snap).unwrap();
        let save = started.elapsed();
        let started = Instant::now();
        let (header, loaded) = file::load(&path, &identity).unwrap();
        let load = started.elapsed();
        assert_eq!(header.tokens.len(), tokens);
        let mut from_file = empty_like(&config);
        from_file.restore(&loaded).unwrap();
        assert_eq!(bits(&from_file), bits(&session));
        println!(
            "k3-0.40b at {tokens} tokens: {} bytes ({} in the file, direct {}, {:?}); \
             snapshot {capture:?}, restore {restore:?}, save {save:?}, load {load:?}",
            snap.bytes(),
            report.bytes,
            report.direct,
            report.fallback,
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A state's numerics: the exact SIMD tiers share their bits (so their files), the scalar
/// tier's sums, an approximate tier and a requantised trunk each make another identity.
#[test]
fn numerics_split_identities_where_the_bits_differ() {
    use crate::plan::TrunkFormat;
    use mxfp4_kernels::Tier;
    let exact = TrunkFormat::Bf16;
    assert_eq!(file::numerics(Tier::Avx2, exact), None);
    assert_eq!(file::numerics(Tier::Avx512, exact), None);
    let q8 = TrunkFormat::Q8_0 { all: false };
    assert_eq!(
        file::numerics(Tier::Avx512, q8).as_deref(),
        Some("q8_0 trunk")
    );
    let all: Vec<Option<String>> = [Tier::Scalar, Tier::Avx512Bf16, Tier::Avx512Vnni]
        .into_iter()
        .flat_map(|t| [file::numerics(t, exact), file::numerics(t, q8)])
        .collect();
    for (i, a) in all.iter().enumerate() {
        assert!(a.is_some());
        assert!(all[i + 1..].iter().all(|b| b != a), "{all:?}");
    }
    let identity = Identity {
        engine: file::ENGINE_VERSION.into(),
        checkpoint: 7,
    };
    assert_eq!(identity.clone().with_numerics(Tier::Avx2, exact), identity);
    assert_ne!(
        identity.clone().with_numerics(Tier::Avx512Vnni, exact),
        identity
    );
}
