//! The chat's data: messages, tool calls, segments, the template's options and what it
//! refuses.

use std::fmt;
use std::str::FromStr;

use serde_json::Value;

/// One encoded-on-its-own piece of a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The segment's text.
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
    /// The message text (for a tool result, the result).
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
    /// The call's id, which a tool result's `tool_call_id` names; `None` when the call has none.
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// A JSON object, a string, or null (see above).
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
    /// `low`.
    Low,
    /// `high`.
    High,
    /// `max`, the default.
    #[default]
    Max,
}

impl ThinkingEffort {
    /// The template's spelling: `low`, `high` or `max`.
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
    /// `auto`, the default: the model decides; renders nothing.
    #[default]
    Auto,
    /// `none`: a system message asks for no tool call.
    None,
    /// `required`: a system message asks for a tool call.
    Required,
    /// `{"type": "function", "function": {"name": N}}`: one named function; renders nothing (as in
    /// the reference).
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
    /// `text`, the default: free text; renders nothing.
    #[default]
    Text,
    /// `json_object`: a system message asks for a JSON object.
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
    /// How much to think, when thinking is on (`max` by default).
    pub thinking_effort: ThinkingEffort,
    /// Whether and which tools the model should call.
    pub tool_choice: ToolChoice,
    /// The shape the answer should take.
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
    /// `thinking_effort` is not `low`, `high` or `max`; holds the value given.
    #[error("unsupported thinking_effort {0:?}; supported values are low, high and max")]
    ThinkingEffort(String),
    #[error(
        "unsupported tool_choice {0}; expected \"auto\", \"none\", \"required\" or \
         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
    )]
    /// `tool_choice` is not one of OpenAI's forms; holds it as JSON text.
    ToolChoice(String),
    #[error(
        "unsupported response_format {0}; expected {{\"type\": \"text\" | \"json_object\" | \
         \"json_schema\"}}"
    )]
    /// `response_format` has no known `type`; holds it as JSON text.
    ResponseFormat(String),
    #[error(
        "tool call {index} of message {message} has arguments {found}; expected a JSON object \
         or a string"
    )]
    /// A tool call's arguments are neither a JSON object, a string nor null.
    Arguments {
        /// The message, 0-based.
        message: usize,
        /// The call within the message, 0-based.
        index: usize,
        /// The arguments as JSON text.
        found: String,
    },
    #[error(
        "tool result in message {message} has no tool name: give it a name, or a tool_call_id \
         of a call in the preceding assistant message, or answer at most as many calls as it \
         made"
    )]
    /// A tool result names no tool and no call of the preceding assistant message gives it one.
    ToolName {
        /// The tool result's message, 0-based.
        message: usize,
    },
}
