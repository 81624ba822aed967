//! What a request asks the engine for once validated ([`ValidRequest`], the only request type
//! the engine accepts) and its prompt ([`Prompt`]).

use k3_model::chat::Segment;
use k3_model::sampling::SamplingParams;

use super::structured::OutputConstraint;

/// What a request asks the engine for, checked.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// What to continue.
    pub prompt: Prompt,
    /// Temperature, top-p/k, min-p, penalties, logit bias, seed (a fresh one when the request
    /// gave none).
    pub sampling: SamplingParams,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop strings: the output ends before the first one.
    pub stop: Vec<String>,
    /// Extra stop tokens.
    pub stop_tokens: Vec<u32>,
    /// Answer as SSE chunks instead of one JSON body.
    pub stream: bool,
    /// A last stream chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Log-probabilities of the chosen tokens (with `sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// `cache_salt`: with the tenant (the API key), the prompt cache's namespace.
    pub cache_salt: Option<String>,
    /// What the output is constrained to (structured outputs), if anything.
    pub constraint: Option<OutputConstraint>,
    /// Whether drafted tokens may be verified for it (`"speculative": false` says no); the
    /// output is the same either way.
    pub speculative: bool,
}

impl ValidRequest {
    /// The request with its output constrained to `constraint`.
    pub fn constrained(mut self, constraint: Option<OutputConstraint>) -> Self {
        self.constraint = constraint;
        self
    }
}

/// The prompt: chat messages rendered with XTML (rendered while validating, so a conversation
/// the template refuses is a 400), plain text, or token ids. Non-exhaustive: structured
/// prompts may come.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Prompt {
    /// A chat: the rendered template's segments.
    Chat {
        /// The rendered conversation, its special tokens apart from its text.
        segments: Vec<Segment>,
        /// How many of the first segments are the system block (tools, thinking effort,
        /// leading system messages), which conversations with the same setup share.
        system_segments: usize,
        /// Whether the model thinks first (the output begins in reasoning).
        thinking: bool,
        /// Whether the output's tool calls are parsed as calls (`tool_choice` other than
        /// `none`); when not, a call the model makes anyway comes back as content.
        tool_calls: bool,
    },
    /// A completion request's plain text (no template, no BOS).
    Text(String),
    /// A completion request's prompt given as token ids (OpenAI's array of integers), fed as
    /// they are: no template, no BOS, nothing encoded.
    Tokens(Vec<u32>),
}
