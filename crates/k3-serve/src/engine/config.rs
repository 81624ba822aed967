//! How the engine is set up ([`EngineConfig`]): the checkpoint, the builder's options, the
//! queue, the prompt cache, and the hooks tests use.

use std::path::PathBuf;

use k3_model::builder::EngineOptions;

use super::cache::PromptCacheOptions;
use super::speculate::SpecOptions;

/// How the engine is set up (from the CLI).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The checkpoint directory (the release layout).
    pub model_dir: PathBuf,
    /// What the engine is built with (`k3_model::builder`): kernels, pool, experts, resident
    /// trunk, `--scan`; its `max_batch` is the most sequences advanced together, its `ctx` the
    /// tokens a sequence may hold (prompt and completion).
    pub options: EngineOptions,
    /// Jobs waiting for a slot at most (more are refused: 429).
    pub queue: usize,
    /// Tokens one engine step feeds at most (`--step-tokens`): every running sequence's next
    /// token first, then chunks of the prompts being prefilled, oldest first, in what is
    /// left (at least one prompt token a step). Larger: a prompt prefills in fewer, longer
    /// steps (each reads the weights once); smaller: the other streams wait less per step.
    pub step_tokens: usize,
    /// The prompt cache (off when its budget is 0).
    pub prompt_cache: PromptCacheOptions,
    /// How long one token's output-constraint mask may take (`--max-mask-ms`): a request whose
    /// mask is not ready within it fails, and the batch goes on.
    pub max_mask: std::time::Duration,
    /// Speculative decoding (`--spec`, `--spec-max-draft`, `--spec-cache-mb`).
    pub spec: SpecOptions,
    /// Fault injection for tests: a text prompt equal to `.0` panics in its sampling step
    /// once `.1` tokens have been generated (0: right after its prefill). `None` in use.
    #[doc(hidden)]
    pub panic_on_prompt: Option<(String, usize)>,
    /// Test hook: a job whose prompt tokens are exactly `.0` answers `.1` (each token forced
    /// in turn, with its log-probability under the logits; sampling resumes if the script
    /// runs out first), so tests can drive the output parser and the prompt cache with a
    /// known answer on a random model. Empty in use.
    #[doc(hidden)]
    pub scripted_answers: Vec<(Vec<u32>, Vec<u32>)>,
    /// Test hook: the engine thread waits for ever before it loads the model, a load that
    /// never ends (the shutdown tests; no file can hold a load any more, since every input file
    /// is checked to be a regular one before it is opened). The binary sets it from
    /// `K3_SERVE_TEST_HOLD_LOAD=1`. False in use.
    #[doc(hidden)]
    pub hold_load: bool,
}
