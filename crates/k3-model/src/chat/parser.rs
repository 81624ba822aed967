//! The output parser: generated tokens into reasoning, content and tool calls as they stream.
//!
//! It follows llama.cpp's Kimi-K3 parser (`common/parsers/kimi-k3.cpp`): reasoning runs to
//! the think closer or, when the model skips it, to the response opener; text after the think
//! closer is content even without a response opener; a call holds `argument` elements. It also
//! takes a `json` block inside a call as the call's arguments (a string), the form the
//! reference template renders string arguments in. With [`OutputParser::calls_as_text`] (a
//! request whose `tool_choice` is `none`) a `tools` element the model writes anyway is passed
//! on as content, markers and all, instead of being parsed into calls.

use serde_json::Value;

use super::markup::{CLOSE, OPEN, SEP};
use super::types::ToolCall;
use crate::tokenizer::Tokenizer;

/// What a piece of generated output is.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Reasoning text: inside `think`, up to the think closer or the response opener.
    Reasoning(String),
    /// Answer text: inside `response`, after the think closer, or a `tools` element passed on as
    /// text.
    Content(String),
    /// A complete tool call, emitted once its element closes.
    ToolCall(ToolCall),
}

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Think,
    Response,
    Tools,
    /// Inside a `tools` element passed on as text.
    ToolsText,
    Argument,
    Json,
    Elsewhere,
}

/// Splits generated tokens into reasoning, content and tool calls. Text between a marker
/// (`<|open|>`/`<|close|>`) and its `<|sep|>` is buffered until the `<|sep|>` arrives, so no
/// part of a marker reaches the output. Bytes are held until they form whole UTF-8 characters.
#[derive(Debug)]
pub struct OutputParser {
    open: u32,
    close: u32,
    sep: u32,
    place: Place,
    /// Between a marker and its `<|sep|>`: (was it an open, the text so far).
    tag: Option<(bool, Vec<u8>)>,
    pending: Vec<u8>,
    call: Option<ToolCall>,
    /// The open argument: key, type and value so far.
    argument: Option<(String, String, String)>,
    /// The open `json` block's text.
    json: Option<String>,
    /// A `tools` element is content, not calls.
    calls_as_text: bool,
}

impl OutputParser {
    /// A parser for output that starts inside `think` (thinking on) or `response`.
    pub fn new(tokenizer: &Tokenizer, thinking: bool) -> Option<Self> {
        Some(Self {
            open: tokenizer.special(OPEN)?,
            close: tokenizer.special(CLOSE)?,
            sep: tokenizer.special(SEP)?,
            place: if thinking {
                Place::Think
            } else {
                Place::Response
            },
            tag: None,
            pending: Vec::new(),
            call: None,
            argument: None,
            json: None,
            calls_as_text: false,
        })
    }

    /// This parser passes a `tools` element on as content (its markers' text included)
    /// instead of parsing it into tool calls: for a request that told the model not to call
    /// tools, whose answer must not carry calls.
    pub fn calls_as_text(mut self) -> Self {
        self.calls_as_text = true;
        self
    }

    /// Feeds one generated token (its id and decoded bytes); returns what it completes.
    pub fn push(&mut self, id: u32, bytes: &[u8]) -> Vec<Delta> {
        let mut out = Vec::new();
        if id == self.open || id == self.close {
            self.flush(&mut out, true);
            self.tag = Some((id == self.open, Vec::new()));
        } else if id == self.sep {
            if let Some((opening, text)) = self.tag.take() {
                self.enter(opening, &String::from_utf8_lossy(&text), &mut out);
            }
        } else if let Some((_, text)) = &mut self.tag {
            text.extend_from_slice(bytes);
        } else {
            self.pending.extend_from_slice(bytes);
            self.flush(&mut out, false);
        }
        out
    }

    /// Emits whatever text is held (at the end of generation).
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.flush(&mut out, true);
        // A marker left open inside a `tools` element passed on as text is text too.
        if self.place == Place::ToolsText
            && let Some((opening, text)) = self.tag.take()
        {
            let marker = if opening { OPEN } else { CLOSE };
            out.push(Delta::Content(format!(
                "{marker}{}",
                String::from_utf8_lossy(&text)
            )));
        }
        out
    }

    fn flush(&mut self, out: &mut Vec<Delta>, all: bool) {
        let text = take_text(&mut self.pending, all);
        if text.is_empty() {
            return;
        }
        match self.place {
            Place::Think => out.push(Delta::Reasoning(text)),
            Place::Response | Place::ToolsText => out.push(Delta::Content(text)),
            Place::Argument => {
                if let Some((_, _, value)) = &mut self.argument {
                    value.push_str(&text);
                }
            }
            Place::Json => {
                if let Some(json) = &mut self.json {
                    json.push_str(&text);
                }
            }
            Place::Tools | Place::Elsewhere => {}
        }
    }

    fn enter(&mut self, opening: bool, tag: &str, out: &mut Vec<Delta>) {
        let (name, attributes) = parse_tag(tag);
        let as_text =
            self.place == Place::ToolsText || (self.calls_as_text && opening && name == "tools");
        if as_text {
            let marker = if opening { OPEN } else { CLOSE };
            out.push(Delta::Content(format!("{marker}{tag}{SEP}")));
            // After the element, as after a parsed one: nothing more is content.
            self.place = if !opening && name == "tools" {
                Place::Elsewhere
            } else {
                Place::ToolsText
            };
            return;
        }
        match (opening, name.as_str()) {
            (true, "think") => self.place = Place::Think,
            // The response opener ends reasoning whether or not the think closer came; text
            // after the think closer is content even without the opener.
            (true, "response") | (false, "think") => self.place = Place::Response,
            (true, "tools") => self.place = Place::Tools,
            (true, "call") => {
                self.call = Some(ToolCall {
                    id: None,
                    name: attribute(&attributes, "tool"),
                    arguments: Value::Object(Default::default()),
                });
                self.place = Place::Tools;
            }
            (true, "argument") => {
                self.argument = Some((
                    attribute(&attributes, "key"),
                    attribute(&attributes, "type"),
                    String::new(),
                ));
                self.place = Place::Argument;
            }
            (false, "argument") => {
                if let (Some((key, kind, text)), Some(call)) =
                    (self.argument.take(), &mut self.call)
                {
                    let value = if kind == "string" {
                        Value::String(text)
                    } else {
                        serde_json::from_str(&text).unwrap_or(Value::String(text))
                    };
                    if let Some(map) = call.arguments.as_object_mut() {
                        map.insert(key, value);
                    }
                }
                self.place = Place::Tools;
            }
            (true, "json") => {
                self.json = Some(String::new());
                self.place = Place::Json;
            }
            (false, "json") => {
                if let (Some(text), Some(call)) = (self.json.take(), &mut self.call) {
                    call.arguments = Value::String(text);
                }
                self.place = Place::Tools;
            }
            (false, "call") => {
                if let Some(call) = self.call.take() {
                    out.push(Delta::ToolCall(call));
                }
                self.place = Place::Tools;
            }
            _ => self.place = Place::Elsewhere,
        }
    }
}

/// `name key="v" key2="w"` into the name and the unescaped attributes.
fn parse_tag(tag: &str) -> (String, Vec<(String, String)>) {
    let tag = tag.trim();
    let (name, mut rest) = tag.split_once(' ').unwrap_or((tag, ""));
    let mut attributes = Vec::new();
    while let Some((key, after)) = rest.split_once("=\"") {
        let Some((value, tail)) = after.split_once('"') else {
            break;
        };
        attributes.push((key.trim().to_owned(), unescape(value)));
        rest = tail;
    }
    (name.to_owned(), attributes)
}

/// The inverse of [`super::escape`], in one pass so `&amp;quot;` stays `&quot;`.
fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(tail) = rest.strip_prefix("&amp;") {
            out.push('&');
            rest = tail;
        } else if let Some(tail) = rest.strip_prefix("&quot;") {
            out.push('"');
            rest = tail;
        } else {
            out.push('&');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

fn attribute(attributes: &[(String, String)], key: &str) -> String {
    attributes
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// The text of `pending`'s bytes (generated output, a token's bytes at a time), taken from it:
/// each invalid sequence as U+FFFD, and, unless `all`, a character the bytes end inside of left
/// for the next token to complete.
pub fn take_text(pending: &mut Vec<u8>, all: bool) -> String {
    // Only an incomplete last character waits: an invalid sequence can never become valid, and
    // holding it would hold back all the text after it.
    let wait = match pending.utf8_chunks().last() {
        Some(chunk) if !all && pending.ends_with(chunk.invalid()) => {
            let incomplete =
                std::str::from_utf8(chunk.invalid()).is_err_and(|e| e.error_len().is_none());
            if incomplete { chunk.invalid().len() } else { 0 }
        }
        _ => 0,
    };
    let whole = pending.len() - wait;
    let text = String::from_utf8_lossy(&pending[..whole]).into_owned();
    pending.drain(..whole);
    text
}
