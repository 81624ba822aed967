//! K3's chat format, "XTML" (K3_SPEC §10.2): messages rendered as a list of segments, each
//! encoded on its own (no BPE merge crosses a segment), special tokens only in the renderer's
//! control segments; and the parser that splits generated tokens back into reasoning, content
//! and tool calls as they stream, without ever emitting part of a marker.
//!
//! An element is `<|open|>` NAME (` key` `="` VALUE `"`)* `<|sep|>` BODY `<|close|>` NAME
//! `<|sep|>`; attribute values are XML-escaped. A message ends with `<|end_of_msg|>`.
//! [UNCERTAIN] The spec gives the user turn, the generation prompt, escaping, and the shapes of
//! past assistant turns, tool calls, tool results and tool declarations from fixtures we do not
//! have; where it is silent (a past assistant turn without reasoning has no `think` element;
//! argument values are the JSON value's text, strings unquoted) the choice is marked below.

use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// One encoded-on-its-own piece of a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub text: String,
    /// A control segment: special-token strings in it become special tokens.
    pub special: bool,
}

/// A chat message.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// A past assistant turn's reasoning (`think`).
    pub reasoning: Option<String>,
    /// A past assistant turn's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the tool that produced this result, and the call's index.
    pub tool_name: Option<String>,
    pub tool_index: Option<usize>,
}

/// A tool call: the tool's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

const OPEN: &str = "<|open|>";
const CLOSE: &str = "<|close|>";
const SEP: &str = "<|sep|>";
/// The end-of-turn token (K3_SPEC §9.3), the default stop token.
pub const END_OF_MSG: &str = "<|end_of_msg|>";

/// Builds the segment list.
#[derive(Debug, Default)]
struct Writer {
    segments: Vec<Segment>,
}

impl Writer {
    fn special(&mut self, text: &str) {
        self.segments.push(Segment {
            text: text.to_owned(),
            special: true,
        });
    }

    fn text(&mut self, text: &str) {
        if !text.is_empty() {
            self.segments.push(Segment {
                text: text.to_owned(),
                special: false,
            });
        }
    }

    fn open(&mut self, name: &str, attributes: &[(&str, &str)]) {
        self.special(OPEN);
        self.text(name);
        for (key, value) in attributes {
            self.text(&format!(" {key}"));
            self.text("=\"");
            self.text(&escape(value));
            self.text("\"");
        }
        self.special(SEP);
    }

    fn close(&mut self, name: &str) {
        self.special(CLOSE);
        self.text(name);
        self.special(SEP);
    }

    fn element(&mut self, name: &str, attributes: &[(&str, &str)], body: &str) {
        self.open(name, attributes);
        self.text(body);
        self.close(name);
    }
}

/// XML attribute escaping (`&`, `"`, `<`, `>`).
pub fn escape(value: &str) -> String {
    value
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn unescape(value: &str) -> String {
    value
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// The body of the tool-declaration message for `tools` (a JSON array of tool schemas).
pub fn tool_declaration(tools: &Value) -> String {
    format!(
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
        serde_json::to_string(tools).unwrap_or_default()
    )
}

/// The prompt for `messages` (after a tool-declaration message when `tools` is given), ending
/// with the generation prompt: an open assistant message and an open `think` element
/// (`thinking`), or an open `response`.
pub fn render(messages: &[Message], tools: Option<&Value>, thinking: bool) -> Vec<Segment> {
    let mut w = Writer::default();
    if let Some(tools) = tools {
        w.element(
            "message",
            &[("role", "system"), ("type", "tool-declare")],
            &tool_declaration(tools),
        );
        w.special(END_OF_MSG);
    }
    for m in messages {
        let index = m.tool_index.map(|i| i.to_string());
        let mut attributes = vec![("role", m.role.as_str())];
        if let Some(tool) = &m.tool_name {
            attributes.push(("tool", tool));
        }
        if let Some(index) = &index {
            attributes.push(("index", index));
        }
        w.open("message", &attributes);
        if m.role == "assistant" {
            // [UNCERTAIN] No `think` element when the turn kept no reasoning.
            if let Some(reasoning) = &m.reasoning {
                w.element("think", &[], reasoning);
            }
            w.element("response", &[], &m.content);
            if !m.tool_calls.is_empty() {
                w.open("tools", &[]);
                for (i, call) in m.tool_calls.iter().enumerate() {
                    let index = i.to_string();
                    w.open("call", &[("tool", &call.name), ("index", &index)]);
                    if let Some(arguments) = call.arguments.as_object() {
                        for (key, value) in arguments {
                            let (kind, text) = argument_text(value);
                            w.element("argument", &[("key", key), ("type", kind)], &text);
                        }
                    }
                    w.close("call");
                }
                w.close("tools");
            }
        } else {
            w.text(&m.content);
        }
        w.close("message");
        w.special(END_OF_MSG);
    }
    w.open("message", &[("role", "assistant")]);
    w.open(if thinking { "think" } else { "response" }, &[]);
    w.segments
}

/// An argument's `type` attribute and body. [UNCERTAIN] Strings go in as they are, other JSON
/// values as their JSON text.
fn argument_text(value: &Value) -> (&'static str, String) {
    match value {
        Value::String(s) => ("string", s.clone()),
        Value::Number(n) => ("number", n.to_string()),
        Value::Bool(b) => ("boolean", b.to_string()),
        Value::Null => ("null", "null".into()),
        Value::Array(_) => ("array", value.to_string()),
        Value::Object(_) => ("object", value.to_string()),
    }
}

/// The token ids of `segments`, each encoded on its own.
pub fn encode(tokenizer: &Tokenizer, segments: &[Segment]) -> Vec<u32> {
    segments
        .iter()
        .flat_map(|s| tokenizer.encode(&s.text, s.special))
        .collect()
}

/// What a piece of generated output is.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Think,
    Response,
    Tools,
    Argument,
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
    argument: Option<(String, String, String)>,
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
        })
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
        out
    }

    fn flush(&mut self, out: &mut Vec<Delta>, all: bool) {
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if !all && e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.pending.len(),
        };
        if valid == 0 {
            return;
        }
        let text = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        match self.place {
            Place::Think => out.push(Delta::Reasoning(text)),
            Place::Response => out.push(Delta::Content(text)),
            Place::Argument => {
                if let Some((_, _, value)) = &mut self.argument {
                    value.push_str(&text);
                }
            }
            Place::Tools | Place::Elsewhere => {}
        }
    }

    fn enter(&mut self, opening: bool, tag: &str, out: &mut Vec<Delta>) {
        let (name, attributes) = parse_tag(tag);
        match (opening, name.as_str()) {
            (true, "think") => self.place = Place::Think,
            (true, "response") => self.place = Place::Response,
            (true, "tools") => self.place = Place::Tools,
            (true, "call") => {
                self.call = Some(ToolCall {
                    name: attribute(&attributes, "tool"),
                    arguments: Value::Object(Default::default()),
                })
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
            (false, "call") => {
                if let Some(call) = self.call.take() {
                    out.push(Delta::ToolCall(call));
                }
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

fn attribute(attributes: &[(String, String)], key: &str) -> String {
    attributes
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}
