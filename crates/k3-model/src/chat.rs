//! K3's chat format, "XTML" (docs/MODEL.md §10.2): messages rendered as a list of segments, each
//! encoded on its own (no BPE merge crosses a segment), special tokens only in the renderer's
//! control segments; and the parser that splits generated tokens back into reasoning, content
//! and tool calls as they stream, without ever emitting part of a marker.
//!
//! An element is `<|open|>` NAME (` key` `="` VALUE `"`)* `<|sep|>` BODY `<|close|>` NAME
//! `<|sep|>`; attribute values escape `&` and `"`. A message ends with `<|end_of_msg|>`.
//! The text follows llama.cpp's Kimi-K3 chat template (`models/templates/Kimi-K3.jinja` in the
//! llama-cpp-python 0.3.36 sdist, which says it matches the release's encoder) byte for byte;
//! `cargo xtask oracle-chat` freezes its renderings and `tests/model/chat.rs` compares. The
//! reference's own behaviour is the spec here, including its choices: tool results are matched
//! to calls by id (and then rendered in call order) or else by position, calls and results are
//! numbered from 1 within each assistant turn, and body text is never escaped.

mod markup;
mod parser;
mod pyjson;
mod render;
mod types;

pub use markup::{END_OF_MSG, escape, tool_declaration};
pub use parser::{Delta, OutputParser, take_text};
pub use render::{encode, render, render_assistant, render_split};
pub use types::{
    ChatError, ChatOptions, Message, ResponseFormat, Segment, ThinkingEffort, ToolCall, ToolChoice,
};
