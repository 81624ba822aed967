//! A conversation rendered as the reference template does: the system block, the messages,
//! the tool results matched to their calls, the generation prompt; and an assistant turn's
//! body alone (what the model generates).

use serde_json::Value;

use super::markup::{END_OF_MSG, JSON_RAW, Writer, py_trim, truthy};
use super::pyjson;
use super::types::{
    ChatError, ChatOptions, Message, ResponseFormat, Segment, ToolCall, ToolChoice,
};
use crate::tokenizer::Tokenizer;

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
