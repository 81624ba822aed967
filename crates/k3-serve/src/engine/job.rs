//! One request for the engine ([`Job`]) and what it sends back ([`Event`]).

use std::time::{Duration, Instant};

use k3_model::chat::ToolCall;
use k3_structured::Grammar;
use tokio::sync::mpsc::UnboundedSender;

use super::state::StateFiles;
use crate::api::valid::ValidRequest;
use crate::prompt_cache::Namespace;

/// A chosen token's text and log-probability, with the top alternatives'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (a token that ends inside a character shows U+FFFD for it).
    pub token: String,
    /// The token's bytes as the tokenizer has them: joined, the tokens' bytes are the output's
    /// UTF-8, characters split over tokens included (OpenAI's `bytes`).
    pub bytes: Vec<u8>,
    /// Its log-probability under the sampled distribution.
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<TopLogprob>,
}

/// One of the most likely tokens at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    /// Its text.
    pub token: String,
    /// Its bytes ([`TokenLogprob::bytes`]).
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
}

impl TopLogprob {
    /// Token `id` of `tokenizer`, at `logprob`.
    pub fn of(tokenizer: &k3_model::tokenizer::Tokenizer, id: u32, logprob: f32) -> Self {
        Self {
            token: tokenizer.decode(&[id]),
            bytes: tokenizer.decode_bytes(&[id]),
            logprob,
        }
    }
}

/// What a job sends back.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New output: reasoning and content text, completed tool calls, and the chosen tokens'
    /// log-probabilities (token text, logprob, top alternatives) when asked.
    Delta {
        /// Reasoning text (thinking), new since the last event.
        reasoning: String,
        /// Answer text, new since the last event.
        content: String,
        /// Tool calls completed since the last event.
        tool_calls: Vec<ToolCall>,
        /// The chosen tokens' log-probabilities, when the request asked.
        logprobs: Vec<TokenLogprob>,
    },
    /// The job finished; the last event.
    Done {
        /// OpenAI's `finish_reason`: `stop`, `length` or `tool_calls`.
        finish_reason: &'static str,
        /// Tokens of the prompt (restored ones included).
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
        /// Prompt tokens restored from the prompt cache instead of prefilled.
        cached_tokens: usize,
        /// Wall time of the prefill.
        prefill: Duration,
        /// Wall time from the prefill's end to the last token.
        decode: Duration,
        /// Forward passes that gave it its tokens after the first: decode steps, and verify
        /// passes that may give several (speculative decoding).
        passes: usize,
    },
    /// The job failed (why); the last event.
    Error(String),
}

/// A request for the engine: checked, tokenized, with its reply channel.
#[derive(Debug)]
pub struct Job {
    /// The validated request.
    pub request: ValidRequest,
    /// Its prompt as tokens.
    pub prompt_ids: Vec<u32>,
    /// How many of the first prompt tokens are a chat's system block (0: none known): the
    /// engine keeps a snapshot there for other conversations with the same system block.
    pub system_tokens: usize,
    /// The prompt cache's namespace: the job resumes only from, and leaves snapshots only
    /// for, requests of the same namespace (the server's: the tenant and `cache_salt`).
    pub cache_namespace: Namespace,
    /// Where the job's events go; dropping the receiver cancels the job.
    pub events: UnboundedSender<Event>,
    /// The request's id for the one info line logged when it ends (prompt and output token
    /// counts, time to first token, tokens/s, how it ended; never the prompt's text). `None`:
    /// no line (the one-shot run prints its own).
    pub log_id: Option<String>,
    /// When the request arrived: the time to first token counts from here.
    pub submitted: Instant,
    /// The one-shot run's `--load-state` / `--save-state` (the server's requests: none).
    pub state: StateFiles,
    /// The compiled output constraint of `request.constraint` (structured outputs), if any.
    pub grammar: Option<Grammar>,
}
