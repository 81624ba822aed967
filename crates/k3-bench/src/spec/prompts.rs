//! The bench's prompts, each one user turn (thinking off) through the checkpoint's chat
//! template and tokenizer: a short question for the cost curve and the oracle runs, and a
//! code-editing request for the n-gram drafter.

use anyhow::{Result, bail};
use k3_model::chat::{ChatOptions, Message, encode, render};
use k3_model::tokenizer::Tokenizer;

/// The short question.
const QUESTION: &str = "Explain in two sentences why reading the weights once for several tokens \
                        makes decoding faster.";

/// The code the code-editing request quotes.
const CODE: &str = r#"fn mean_latency(samples: &[Sample]) -> Option<f64> {
    let mut total = 0.0;
    let mut count = 0;
    for sample in samples {
        if sample.ok {
            total += sample.latency_ms;
            count += 1;
        }
    }
    if count == 0 {
        return None;
    }
    Some(total / count as f64)
}
"#;

/// The request around it.
const ASK: &str = "Rename `total` to `sum` in this function and give the whole function back, \
                   unchanged otherwise:";

/// The short question's tokens.
pub(crate) fn question(tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    user_turn(tokenizer, QUESTION)
}

/// The code-editing request's tokens: a block of code to be given back with an edit.
pub(crate) fn code_edit(tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    user_turn(tokenizer, &format!("{ASK}\n\n```rust\n{CODE}```"))
}

/// The user turn `text` ending in the generation prompt.
fn user_turn(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let message = Message {
        role: "user".into(),
        content: text.into(),
        ..Message::default()
    };
    let options = ChatOptions {
        thinking: false,
        ..ChatOptions::default()
    };
    let tokens = encode(tokenizer, &render(&[message], None, &options)?);
    if tokens.is_empty() {
        bail!("the prompt encodes to no token");
    }
    Ok(tokens)
}
