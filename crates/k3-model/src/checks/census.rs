//! The format census of a checkpoint: bytes per (storage format, tensor class), read from the
//! headers, so a user sees at once what their checkpoint holds (an F32 trunk, MXFP4 beyond the
//! experts, BF16 vectors) before anything runs.

use std::collections::{BTreeMap, HashMap, HashSet};

use expert_store::{Checkpoint, Dtype};

use crate::config::K3Config;
use crate::inventory::{Role, TensorClass, text_tensors};

/// How a tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Format {
    /// f32, 4 bytes per value.
    F32,
    /// bfloat16, 2 bytes per value.
    Bf16,
    /// IEEE half, 2 bytes per value.
    F16,
    /// `weight_packed` codes and `weight_scale` E8M0 scales (both counted).
    MxFp4,
    /// Any other dtype (integers, F64, FP8, ...).
    Other,
}

/// What a tensor is for, coarsely (the census's columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// The routed experts' tensors.
    RoutedExperts,
    /// Matrices of the trunk: attention, dense and shared MLPs, latent projections, router.
    TrunkLinear,
    /// The token embedding table.
    Embedding,
    /// The output projection to the vocabulary.
    LmHead,
    /// Norms, biases, conv taps, `A_log`, AttnRes projections: the tensors whose
    /// [`Role`] is a vector.
    SmallVectors,
    /// Tensors the config does not imply (a vision tower, extras): not loaded.
    Unused,
}

impl Format {
    /// The format as the census table prints it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "F32",
            Format::Bf16 => "BF16",
            Format::F16 => "F16",
            Format::MxFp4 => "MXFP4",
            Format::Other => "other",
        }
    }
}

impl Class {
    /// The class as the census table prints it (a column heading).
    pub fn name(self) -> &'static str {
        match self {
            Class::RoutedExperts => "routed experts",
            Class::TrunkLinear => "trunk linear",
            Class::Embedding => "embedding",
            Class::LmHead => "lm_head",
            Class::SmallVectors => "small vectors",
            Class::Unused => "not used",
        }
    }
}

/// Bytes and tensor count of one (format, class) cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cell {
    /// Bytes of the cell's tensors as stored.
    pub bytes: u64,
    /// Tensors in the cell (an MXFP4 weight's codes and scales count as two).
    pub tensors: usize,
}

/// The stored tensors of the text layers (`model.layers.N.…`) that `config` does not imply:
/// a config that disagrees with its weights (`num_shared_experts: 0` over shared experts'
/// tensors, say) runs another model than the checkpoint's, so the builder says so. Tensors
/// outside the layers (a vision tower) are not counted.
pub(crate) fn unused_layer_tensors(ckpt: &Checkpoint, config: &K3Config) -> Vec<String> {
    let implied: HashSet<String> = text_tensors(config).into_iter().map(|t| t.name).collect();
    let experts = crate::inventory::expert_layout(config);
    let mut unused: Vec<String> = ckpt
        .tensor_names()
        .map(|stored| {
            stored
                .strip_prefix(expert_store::checkpoint::TEXT_PREFIX)
                .unwrap_or(stored)
        })
        .filter(|name| name.starts_with("model.layers."))
        .filter(|name| {
            let base = name
                .strip_suffix(".weight_packed")
                .or_else(|| name.strip_suffix(".weight_scale"))
                .map(|b| format!("{b}.weight"));
            !implied.contains(*name)
                && base.is_none_or(|b| !implied.contains(&b))
                && experts.parse(name).is_none()
        })
        .map(str::to_owned)
        .collect();
    unused.sort_unstable();
    unused
}

/// Every stored tensor of `ckpt`, counted in its (format, class) cell.
pub fn census(ckpt: &Checkpoint, config: &K3Config) -> BTreeMap<(Format, Class), Cell> {
    let specs: HashMap<String, (TensorClass, bool)> = text_tensors(config)
        .into_iter()
        .map(|t| {
            let vector = t.role() == Role::Vector;
            (t.name, (t.class, vector))
        })
        .collect();
    let mut cells: BTreeMap<(Format, Class), Cell> = BTreeMap::new();
    for stored in ckpt.tensor_names() {
        let Some(t) = ckpt.tensor(stored) else {
            continue;
        };
        let name = stored
            .strip_prefix(expert_store::checkpoint::TEXT_PREFIX)
            .unwrap_or(stored);
        // An MXFP4 pair stands for the `.weight` the config implies.
        let (base, mxfp4) = match name
            .strip_suffix(".weight_packed")
            .or_else(|| name.strip_suffix(".weight_scale"))
        {
            Some(base) if t.dtype == Dtype::U8 => (format!("{base}.weight"), true),
            _ => (name.to_owned(), false),
        };
        let format = match t.dtype {
            _ if mxfp4 => Format::MxFp4,
            Dtype::F32 => Format::F32,
            Dtype::BF16 => Format::Bf16,
            Dtype::F16 => Format::F16,
            _ => Format::Other,
        };
        let class = match specs.get(&base).or_else(|| specs.get(name)) {
            // Routed experts are named by their packed pair in the inventory.
            Some((TensorClass::RoutedExperts, _)) => Class::RoutedExperts,
            Some((TensorClass::Embedding, _)) => Class::Embedding,
            Some((TensorClass::LmHead, _)) => Class::LmHead,
            Some((_, true)) => Class::SmallVectors,
            Some((_, false)) => Class::TrunkLinear,
            None => Class::Unused,
        };
        let cell = cells.entry((format, class)).or_default();
        cell.bytes += t.bytes.len() as u64;
        cell.tensors += 1;
    }
    cells
}
