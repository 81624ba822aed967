//! The weight bytes the bench's rooflines count: the least a prefill reads, and the
//! `--trunk-format` both engines read, with the bytes per token its quantised set saves.

use anyhow::{Result, bail};
use k3_model::K3Config;
use k3_model::inventory::{BytePlan, text_tensors};

use crate::gguf_k3_meta::Outtype;

/// The least weight bytes a prefill of `prompt` tokens reads: every trunk tensor once (one
/// embedding row per token, the lm_head once, for the last token) and every expert the prompt
/// can touch, `min(experts, prompt x top_k)` per MoE layer.
pub(super) fn prompt_bytes(config: &K3Config, plan: &BytePlan, prompt: usize) -> usize {
    let touched = config.moe.num_experts.min(prompt * config.moe.router.top_k);
    plan.bytes_per_token - plan.routed_bytes_per_token
        + (prompt - 1) * config.hidden_size * 2
        + plan.moe_layers * touched * plan.expert_bytes
}

/// `--trunk-format`: the trunk both engines read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TrunkFormat {
    /// As stored (BF16 in the release): today's comparison.
    Bf16,
    /// `gguf_k3::Q8_0_SET` in ggml Q8_0, in both engines.
    Q8_0,
    /// The same set in MXFP4, ours only.
    MxFp4,
}

impl TrunkFormat {
    pub(super) fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "bf16" => TrunkFormat::Bf16,
            "q8_0" => TrunkFormat::Q8_0,
            "mxfp4" => TrunkFormat::MxFp4,
            other => bail!("--trunk-format {other:?} is not bf16, q8_0 or mxfp4"),
        })
    }

    /// Our decode bench's `--trunk-format` value.
    pub(super) fn name(self) -> &'static str {
        match self {
            TrunkFormat::Bf16 => "bf16",
            TrunkFormat::Q8_0 => "q8_0",
            TrunkFormat::MxFp4 => "mxfp4",
        }
    }

    /// The peer GGUF's outtype.
    pub(super) fn outtype(self) -> Outtype {
        match self {
            TrunkFormat::Q8_0 => Outtype::Q8_0,
            TrunkFormat::Bf16 | TrunkFormat::MxFp4 => Outtype::Bf16,
        }
    }

    /// Bytes of 32 weights of the quantised set (`None`: as stored).
    fn block_bytes(self) -> Option<usize> {
        match self {
            TrunkFormat::Bf16 => None,
            TrunkFormat::Q8_0 => Some(34),
            TrunkFormat::MxFp4 => Some(17),
        }
    }
}

/// Weight bytes per token that `trunk` saves against `BytePlan::bytes_per_token`: every
/// matrix of the quantised set (`gguf_k3::q8_0_source`, read once per token) at 34 (Q8_0) or
/// 17 (MXFP4) bytes per 32 weights instead of its stored dtype's. `BytePlan` counts the
/// release's dtypes only, so the formats are counted here.
pub(super) fn trunk_saving(config: &K3Config, trunk: TrunkFormat) -> usize {
    let Some(block_bytes) = trunk.block_bytes() else {
        return 0;
    };
    text_tensors(config)
        .iter()
        .filter(|t| crate::gguf_k3::q8_0_source(&t.name))
        .map(|t| t.bytes() - t.shape.iter().product::<usize>() / 32 * block_bytes)
        .sum()
}
