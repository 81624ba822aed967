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

mod parser;
mod pyjson;

use std::fmt;
use std::str::FromStr;

use serde_json::Value;

pub use parser::{Delta, OutputParser};

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
    /// `system`, `user`, `assistant` or `tool`; other roles are not rendered (as in the
    /// reference).
    pub role: String,
    pub content: String,
    /// A past assistant turn's reasoning (`think`), rendered when thinking is on.
    pub reasoning: Option<String>,
    /// A past assistant turn's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `name` attribute on user, system and assistant messages (when not empty); for a tool
    /// result, the tool's name.
    pub name: Option<String>,
    /// For a tool result: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// For a system message: tools added mid-conversation (a JSON array of tool schemas),
    /// rendered as a "New Tools Available" declaration instead of the message.
    pub tools: Option<Value>,
}

/// A tool call: its id (to match results), the tool's name and its arguments: a JSON object
/// (one `argument` element per key) or a string (a `json` block holding it as it is; a blank
/// string or null renders nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    pub arguments: Value,
}

impl ToolCall {
    /// The arguments as OpenAI's JSON-string `arguments`: a string as it is, anything else as
    /// its JSON text.
    pub fn arguments_json(&self) -> String {
        match &self.arguments {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        }
    }
}

/// How much to think (the template's `thinking_effort`; the reference also names `medium`
/// in its wording but refuses it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ThinkingEffort {
    Low,
    High,
    #[default]
    Max,
}

impl ThinkingEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::High => "high",
            Self::Max => "max",
        }
    }
}

impl FromStr for ThinkingEffort {
    type Err = ChatError;

    fn from_str(text: &str) -> Result<Self, ChatError> {
        match text {
            "low" => Ok(Self::Low),
            "high" => Ok(Self::High),
            "max" => Ok(Self::Max),
            _ => Err(ChatError::ThinkingEffort(text.to_owned())),
        }
    }
}

impl fmt::Display for ThinkingEffort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// OpenAI's `tool_choice`. `required` and `none` add a system message after the conversation;
/// `auto` and a named function add nothing (the reference template renders nothing for them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Function(String),
}

impl ToolChoice {
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name": N}}`.
    pub fn from_json(value: &Value) -> Result<Self, ChatError> {
        match value {
            Value::String(s) if s == "auto" => Ok(Self::Auto),
            Value::String(s) if s == "none" => Ok(Self::None),
            Value::String(s) if s == "required" => Ok(Self::Required),
            Value::Object(map) if map.get("type").and_then(Value::as_str) == Some("function") => {
                match map
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                {
                    Some(name) => Ok(Self::Function(name.to_owned())),
                    None => Err(ChatError::ToolChoice(value.to_string())),
                }
            }
            _ => Err(ChatError::ToolChoice(value.to_string())),
        }
    }
}

/// OpenAI's `response_format`. `json_object` and `json_schema` add a system message after the
/// conversation (the schema written as the template's `json_sorted`); `text` adds nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ResponseFormat {
    #[default]
    Text,
    JsonObject,
    /// The schema (JSON null when the request carries none).
    JsonSchema(Value),
}

impl ResponseFormat {
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": W}`; the schema is
    /// taken from `W` as the template does: `W.schema` if present, else `W.json_schema`, else
    /// `W` itself.
    pub fn from_json(value: &Value) -> Result<Self, ChatError> {
        let bad = || ChatError::ResponseFormat(value.to_string());
        let kind = value.get("type").and_then(Value::as_str).ok_or_else(bad)?;
        match kind {
            "text" => Ok(Self::Text),
            "json_object" => Ok(Self::JsonObject),
            "json_schema" => {
                let schema = match value.get("json_schema") {
                    None | Some(Value::Null) => Value::Null,
                    Some(Value::Object(wrapper)) if wrapper.contains_key("schema") => {
                        wrapper["schema"].clone()
                    }
                    Some(Value::Object(wrapper)) if wrapper.contains_key("json_schema") => {
                        wrapper["json_schema"].clone()
                    }
                    Some(wrapper) => wrapper.clone(),
                };
                Ok(Self::JsonSchema(schema))
            }
            _ => Err(bad()),
        }
    }
}

/// How to render a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Thinking on (the default): a `thinking-effort` system message first, past reasoning
    /// kept, and the generation prompt opens `think`; off: no reasoning anywhere and the
    /// generation prompt opens `response`.
    pub thinking: bool,
    pub thinking_effort: ThinkingEffort,
    pub tool_choice: ToolChoice,
    pub response_format: ResponseFormat,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            thinking: true,
            thinking_effort: ThinkingEffort::Max,
            tool_choice: ToolChoice::Auto,
            response_format: ResponseFormat::Text,
        }
    }
}

/// A conversation the reference template refuses to render.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    #[error("unsupported thinking_effort {0:?}; supported values are low, high and max")]
    ThinkingEffort(String),
    #[error(
        "unsupported tool_choice {0}; expected \"auto\", \"none\", \"required\" or \
         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
    )]
    ToolChoice(String),
    #[error(
        "unsupported response_format {0}; expected {{\"type\": \"text\" | \"json_object\" | \
         \"json_schema\"}}"
    )]
    ResponseFormat(String),
    #[error(
        "tool call {index} of message {message} has arguments {found}; expected a JSON object \
         or a string"
    )]
    Arguments {
        message: usize,
        index: usize,
        found: String,
    },
    #[error(
        "tool result in message {message} has no tool name: give it a name, or a tool_call_id \
         of a call in the preceding assistant message, or answer at most as many calls as it \
         made"
    )]
    ToolName { message: usize },
}

const OPEN: &str = "<|open|>";
const CLOSE: &str = "<|close|>";
const SEP: &str = "<|sep|>";
/// The end-of-turn token (docs/MODEL.md §9.3), the default stop token.
pub const END_OF_MSG: &str = "<|end_of_msg|>";

const TOOLS_HEADER: &str = "# Tools\nHere are the available tools, described in JSONSchema.\n\n";
const NEW_TOOLS_HEADER: &str = "## New Tools Available\nThe system dynamically extends the \
    toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are \
    the specs for the extended tools.\n\n";
const JSON_RAW: &str = "Your response must be raw JSON data without markdown code blocks \
    (```json) or any additional formatting.";

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

    /// A whole message with `body` (the template's `internal_system_message` and plain
    /// messages).
    fn message(&mut self, attributes: &[(&str, &str)], body: &str) {
        self.element("message", attributes, body);
        self.special(END_OF_MSG);
    }

    fn system(&mut self, kind: &str, body: &str) {
        self.message(&[("role", "system"), ("type", kind)], py_trim(body));
    }

    fn tool_declaration(&mut self, tools: &Value, dynamic: bool) {
        self.message(
            &[("role", "system"), ("type", "tool-declare")],
            &tool_declaration_body(tools, dynamic),
        );
    }
}

/// Attribute escaping, as the template's `escape_attr`: `&` and `"` only.
pub fn escape(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// The body of the tool-declaration message for `tools` (a JSON array of tool schemas).
pub fn tool_declaration(tools: &Value) -> String {
    tool_declaration_body(tools, false)
}

fn tool_declaration_body(tools: &Value, dynamic: bool) -> String {
    let header = if dynamic {
        NEW_TOOLS_HEADER
    } else {
        TOOLS_HEADER
    };
    format!("{header}```json\n{}\n```", pyjson::sorted(tools))
}

/// Jinja's truthiness for a JSON value (`{% if tools %}`).
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Python's `str.strip()` (the template's `trim`): also strips U+001C..U+001F, which Rust's
/// `trim` keeps.
fn py_trim(text: &str) -> &str {
    text.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

/// The prompt for `messages` (after a tool-declaration message when `tools` is given), ending
/// with the generation prompt: an open assistant message and an open `think` element
/// (thinking on), or an open `response`.
pub fn render(
    messages: &[Message],
    tools: Option<&Value>,
    options: &ChatOptions,
) -> Result<Vec<Segment>, ChatError> {
    render_split(messages, tools, options).map(|(segments, _)| segments)
}

/// [`render`], and how many of its first segments are the system block: the tool
/// declaration, the thinking-effort message and the leading system messages. Two
/// conversations with the same system messages, tools and options share those segments.
pub fn render_split(
    messages: &[Message],
    tools: Option<&Value>,
    options: &ChatOptions,
) -> Result<(Vec<Segment>, usize), ChatError> {
    let leading_system = messages.iter().take_while(|m| m.role == "system").count();
    let mut system_block = None;
    let mut w = Writer::default();
    if let Some(tools) = tools.filter(|t| truthy(t)) {
        w.tool_declaration(tools, false);
    }
    if options.thinking {
        let effort = options.thinking_effort;
        w.system(
            "thinking-effort",
            &format!(
                "`thinking_effort` guides on how much to think in your thinking channel (not \
                 including the response channel), supported values include `low`, `medium`, \
                 `high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."
            ),
        );
    }
    // The latest assistant message's calls and how many results have answered them.
    let mut calls: &[ToolCall] = &[];
    let mut tool_index = 0usize;
    for (i, m) in messages.iter().enumerate() {
        if i == leading_system {
            system_block = Some(w.segments.len());
        }
        match m.role.as_str() {
            "system" if m.tools.as_ref().is_some_and(truthy) => {
                if let Some(tools) = &m.tools {
                    w.tool_declaration(tools, true);
                }
            }
            "user" | "system" => w.message(&named(&m.role, m), &m.content),
            "assistant" => {
                calls = &m.tool_calls;
                tool_index = 0;
                w.open("message", &named("assistant", m));
                write_assistant(&mut w, i, m, options.thinking)?;
                w.close("message");
                w.special(END_OF_MSG);
            }
            "tool" if i == 0 || messages[i - 1].role != "tool" => {
                let run_len = messages[i..]
                    .iter()
                    .take_while(|r| r.role == "tool")
                    .count();
                let run = &messages[i..i + run_len];
                let matches = |r: &Message, call: &ToolCall| {
                    r.tool_call_id.is_some() && call.id.is_some() && r.tool_call_id == call.id
                };
                let all_matched = run.iter().all(|r| calls.iter().any(|c| matches(r, c)));
                if all_matched {
                    // In the order of the calls, each id once, every result answering it.
                    let mut emitted: Vec<&str> = Vec::new();
                    for call in calls {
                        let Some(id) = call.id.as_deref() else {
                            continue;
                        };
                        if emitted.contains(&id) {
                            continue;
                        }
                        emitted.push(id);
                        for r in run.iter().filter(|r| matches(r, call)) {
                            tool_index += 1;
                            write_tool_result(&mut w, &call.name, tool_index, &r.content);
                        }
                    }
                } else {
                    for (offset, r) in run.iter().enumerate() {
                        tool_index += 1;
                        let name = match (&r.name, calls.get(tool_index - 1)) {
                            (Some(name), _) => name.as_str(),
                            (None, Some(call)) => call.name.as_str(),
                            (None, None) => {
                                return Err(ChatError::ToolName {
                                    message: i + offset,
                                });
                            }
                        };
                        write_tool_result(&mut w, name, tool_index, &r.content);
                    }
                }
            }
            _ => {}
        }
    }
    let system_block = system_block.unwrap_or(w.segments.len());
    match options.tool_choice {
        ToolChoice::Required => w.system(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the \
             next message.",
        ),
        ToolChoice::None => w.system(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in \
             the next message.",
        ),
        ToolChoice::Auto | ToolChoice::Function(_) => {}
    }
    match &options.response_format {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => w.system(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{JSON_RAW}"),
        ),
        ResponseFormat::JsonSchema(schema) => w.system(
            "response-format",
            &format!(
                "The system is invoked with `response_format=json_schema`.\n{JSON_RAW}\nThe JSON \
                 data must match the following schema:\n```json\n{}\n```",
                pyjson::sorted(schema)
            ),
        ),
    }
    w.open("message", &[("role", "assistant")]);
    w.open(
        if options.thinking {
            "think"
        } else {
            "response"
        },
        &[],
    );
    Ok((w.segments, system_block))
}

/// `role`, and `name` when the message has a non-empty one.
fn named<'a>(role: &'a str, m: &'a Message) -> Vec<(&'a str, &'a str)> {
    let mut attributes = vec![("role", role)];
    if let Some(name) = m.name.as_deref().filter(|n| !n.is_empty()) {
        attributes.push(("name", name));
    }
    attributes
}

fn write_tool_result(w: &mut Writer, tool: &str, index: usize, content: &str) {
    let index = index.to_string();
    w.message(
        &[("role", "tool"), ("tool", tool), ("index", &index)],
        content,
    );
}

/// The body of an assistant message as it appears in a prompt: `think` (thinking on), then
/// `response`, then `tools` when it made calls. Generated output is this text after the
/// generation prompt's opener, followed by the message's close.
pub fn render_assistant(message: &Message, thinking: bool) -> Result<Vec<Segment>, ChatError> {
    let mut w = Writer::default();
    write_assistant(&mut w, 0, message, thinking)?;
    Ok(w.segments)
}

fn write_assistant(
    w: &mut Writer,
    message_index: usize,
    m: &Message,
    thinking: bool,
) -> Result<(), ChatError> {
    if thinking {
        w.open("think", &[]);
        if let Some(reasoning) = m.reasoning.as_deref().filter(|r| !py_trim(r).is_empty()) {
            w.text(reasoning);
        }
        w.close("think");
    }
    w.element("response", &[], &m.content);
    if m.tool_calls.is_empty() {
        return Ok(());
    }
    w.open("tools", &[]);
    for (i, call) in m.tool_calls.iter().enumerate() {
        let index = (i + 1).to_string();
        w.open("call", &[("tool", &call.name), ("index", &index)]);
        match &call.arguments {
            Value::Object(arguments) => {
                for (key, value) in arguments {
                    let (kind, text) = argument_text(value);
                    w.element("argument", &[("key", key), ("type", kind)], &text);
                }
            }
            Value::String(text) if !py_trim(text).is_empty() => {
                w.element("json", &[("type", "object")], text);
            }
            Value::String(_) | Value::Null => {}
            other => {
                return Err(ChatError::Arguments {
                    message: message_index,
                    index: i,
                    found: other.to_string(),
                });
            }
        }
        w.close("call");
    }
    w.close("tools");
    Ok(())
}

/// An argument's `type` attribute and body: a string as it is, anything else as Python's
/// `json.dumps` writes it.
fn argument_text(value: &Value) -> (&'static str, String) {
    let kind = match value {
        Value::String(s) => return ("string", s.clone()),
        Value::Number(_) => "number",
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    (kind, pyjson::dumps(value))
}

/// The token ids of `segments`, each encoded on its own.
pub fn encode(tokenizer: &Tokenizer, segments: &[Segment]) -> Vec<u32> {
    segments
        .iter()
        .flat_map(|s| tokenizer.encode(&s.text, s.special))
        .collect()
}
