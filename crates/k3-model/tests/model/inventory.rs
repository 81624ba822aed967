//! The tensor inventory reproduces the release's byte accounting (docs/MODEL.md §3.5) exactly.

use k3_model::config::{AttentionKind as A, FfnKind as F, K3Config};
use k3_model::inventory::{BytePlan, TensorClass, text_tensors};

const REAL: &str = include_str!("../../configs/Kimi-K3.config.json");
const TINY: &str = include_str!("../../configs/Kimi-K3-0.40B.config.json");

/// The release's vision tower and projector, which a text engine skips (docs/MODEL.md §3.5).
const VISION_BYTES: usize = 894_717_952;

#[test]
fn real_plan_matches_the_release_index_total() {
    let plan = BytePlan::new(&K3Config::from_json(REAL).unwrap());
    assert_eq!(plan.text_bytes + VISION_BYTES, 1_560_860_324_864);
    assert_eq!(plan.expert_bytes, 17_547_264);
    let class = |c| plan.by_class.iter().find(|(k, _)| *k == c).unwrap().1;
    assert_eq!(class(TensorClass::RoutedExperts), 1_446_456_066_048);
    assert_eq!(
        plan.text_bytes - class(TensorClass::RoutedExperts),
        113_509_540_864
    );
    let layer = |kind| {
        plan.by_layer_kind
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map(|&(_, b, n)| (b, n))
            .unwrap()
    };
    assert_eq!(layer((A::Kda, F::Dense)), (2_341_213_184, 1));
    assert_eq!(layer((A::Kda, F::Moe)), (1_267_744_256, 68));
    assert_eq!(layer((A::Mla, F::Moe)), (844_335_616, 24));
    // Per decoded token: trunk without the embedding table, one embedding row, 16 experts x 92.
    assert_eq!(
        plan.bytes_per_token,
        111_160_730_624 + 14_336 + 25_829_572_608
    );
    // Per layer 6 norm/AttnRes tensors; KDA 14 more, MLA 8; dense MLP 3; MoE router 2,
    // latent 3, shared 3, experts 6 each. (The index's 497,220 also counts vision tensors.)
    assert_eq!(
        plan.text_tensors,
        5 + 69 * 20 + 24 * 14 + 3 + 92 * (2 + 3 + 3 + 896 * 6)
    );
}

#[test]
fn tiny_plan_has_every_layer_kind_and_unique_names() {
    let c = K3Config::from_json(TINY).unwrap();
    let tensors = text_tensors(&c);
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(names.len(), before, "tensor names are unique");
    let plan = BytePlan::new(&c);
    assert_eq!(plan.by_layer_kind.len(), 3, "{:?}", plan.by_layer_kind);
    assert!(
        tensors
            .iter()
            .any(|t| t.name == "model.layers.1.block_sparse_moe.experts.7.w2.weight_scale")
    );
    let a_log = tensors
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.A_log")
        .unwrap();
    assert_eq!(a_log.shape, [8]);
}
