//! A validated request's prompt as tokens: its segments, the fewest tokens they can encode to
//! (a length check before tokenizing), and their encoding.

use k3_model::chat::Segment;
use k3_model::tokenizer::Tokenizer;

use crate::api::valid::Prompt;

/// A validated request's prompt as the pieces that are encoded each on its own (chat messages
/// rendered; plain text is one piece in which special-token strings are ordinary text; a
/// prompt of token ids has none: it is not encoded).
pub fn prompt_segments(prompt: &Prompt) -> Vec<Segment> {
    match prompt {
        Prompt::Chat { segments, .. } => segments.clone(),
        Prompt::Text(text) => vec![Segment {
            text: text.clone(),
            special: false,
        }],
        Prompt::Tokens(_) => Vec::new(),
    }
}

/// The fewest tokens `segments` can encode to (see [`Tokenizer::min_tokens`]): a prompt can be
/// refused on its length before it is tokenized.
pub(crate) fn min_prompt_tokens(tokenizer: &Tokenizer, segments: &[Segment]) -> usize {
    segments
        .iter()
        .map(|s| tokenizer.min_tokens(s.text.len()))
        .sum()
}

/// The tokens of `segments`. A prompt with no tokens (an empty completion prompt) starts from
/// `[BOS]` where the tokenizer has one, as a document does: OpenAI's and llama.cpp's servers
/// answer an empty prompt that way. Without `[BOS]` it stays empty (the server refuses it).
pub fn encode_segments(tokenizer: &Tokenizer, segments: &[Segment]) -> Vec<u32> {
    let ids = k3_model::chat::encode(tokenizer, segments);
    if ids.is_empty() {
        return tokenizer.special("[BOS]").into_iter().collect();
    }
    ids
}

/// The tokens of `segments`, and how many of them the first `system_segments` segments encode
/// to (each segment is encoded on its own, so those tokens are a prefix of the whole).
pub fn encode_split(
    tokenizer: &Tokenizer,
    segments: &[Segment],
    system_segments: usize,
) -> (Vec<u32>, usize) {
    let (system, rest) = segments.split_at(system_segments.min(segments.len()));
    let mut ids = k3_model::chat::encode(tokenizer, system);
    let system_tokens = ids.len();
    ids.extend(k3_model::chat::encode(tokenizer, rest));
    if ids.is_empty() {
        // An empty prompt begins from `[BOS]` (see `encode_segments`): no system block.
        return (encode_segments(tokenizer, segments), 0);
    }
    (ids, system_tokens)
}

/// How many segments of a validated request's prompt are its system block.
pub fn system_segments(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Chat {
            system_segments, ..
        } => *system_segments,
        Prompt::Text(_) | Prompt::Tokens(_) => 0,
    }
}

/// The tokens of a validated request's prompt whose segments are `segments`
/// ([`prompt_segments`]), and how many of them are its system block: ids given as they are
/// (no system block), text encoded ([`encode_split`]).
pub fn encode_prompt(
    tokenizer: &Tokenizer,
    prompt: &Prompt,
    segments: &[Segment],
) -> (Vec<u32>, usize) {
    match prompt {
        Prompt::Tokens(ids) => (ids.clone(), 0),
        _ => encode_split(tokenizer, segments, system_segments(prompt)),
    }
}

/// The tokens of a validated request's prompt.
pub fn prompt_ids(tokenizer: &Tokenizer, prompt: &Prompt) -> Vec<u32> {
    encode_prompt(tokenizer, prompt, &prompt_segments(prompt)).0
}
