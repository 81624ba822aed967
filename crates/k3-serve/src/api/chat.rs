//! `POST /v1/chat/completions`: the request's fields, its messages parsed into ours, the
//! template's options (thinking, effort, tool choice, response format) and the tools checked,
//! the conversation rendered.

use k3_model::chat::{
    ChatError, ChatOptions, Message, ResponseFormat, ToolCall, ToolChoice, render_split,
};
use serde::Deserialize;
use serde_json::Value;

use super::common::{CommonFields, Logprobs};
use super::error::ApiError;
use super::fields::{field_names, kind_of, object, typed, unknown};
use super::limits::Limits;
use super::structured::output_constraint;
use super::valid::{Prompt, ValidRequest};

/// The most alternatives per token a chat request may ask for (`top_logprobs`, OpenAI's
/// limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// The chat endpoint's own fields.
#[derive(Debug, Deserialize)]
struct ChatFields {
    messages: Vec<Value>,
    tools: Option<Value>,
    /// `{"thinking": false}` turns thinking off (default on); `{"thinking_effort": E}` as the
    /// top-level field.
    chat_template_kwargs: Option<Value>,
    /// `low`, `high` or `max` (default: the server's `--thinking-effort`).
    thinking_effort: Option<Value>,
    /// `auto`, `none`, `required` or a named function; rendered as the chat template does, and
    /// `required` or a named function forced by constrained decoding.
    tool_choice: Option<Value>,
    /// `text`, `json_object` or `json_schema`; the JSON types are enforced by constrained
    /// decoding.
    response_format: Option<Value>,
    /// Log-probabilities of the chosen tokens.
    logprobs: Option<bool>,
    /// Alternatives per token, 0 to [`MAX_TOP_LOGPROBS`] (needs `logprobs: true`).
    top_logprobs: Option<i64>,
}

/// `POST /v1/chat/completions`, read from its JSON body.
#[derive(Debug)]
pub struct ChatRequest {
    fields: ChatFields,
    common: CommonFields,
    ignored: Vec<String>,
}

impl ChatRequest {
    /// The request in `body`: a field of the wrong type is a 400 naming it; fields this
    /// server does not read are kept in [`Self::ignored`].
    pub fn from_json(body: &Value) -> Result<Self, ApiError> {
        let map = object(body)?;
        let fields: ChatFields = typed(body)?;
        let mut ignored = unknown(
            map,
            &[field_names::<ChatFields>(), field_names::<CommonFields>()],
        );
        // The template's options this server does not read are ignored too.
        if let Some(Value::Object(kwargs)) = &fields.chat_template_kwargs {
            ignored.extend(
                kwargs
                    .keys()
                    .filter(|k| !matches!(k.as_str(), "thinking" | "thinking_effort"))
                    .map(|k| format!("chat_template_kwargs.{k}")),
            );
        }
        Ok(Self {
            fields,
            common: typed(body)?,
            ignored,
        })
    }

    /// The fields of the body that this server does not read, in the body's order (options
    /// inside `chat_template_kwargs` as `chat_template_kwargs.NAME`).
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }

    /// Checks the request against `limits` and renders its messages with the chat template:
    /// the request the engine takes, or the 400 (404 for an unknown `model`) naming the field.
    pub fn validate(self, limits: &Limits) -> Result<ValidRequest, ApiError> {
        let fields = self.fields;
        let top = match fields.top_logprobs {
            None => 0,
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
                ));
            }
        };
        let logprobs = fields.logprobs.unwrap_or(false);
        if top > 0 && !logprobs {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        let checked = self
            .common
            .validate(limits, Logprobs { on: logprobs, top })?;
        if fields.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let messages = fields
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| parse_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let kwargs = match &fields.chat_template_kwargs {
            None | Some(Value::Null) => None,
            Some(Value::Object(kwargs)) => Some(kwargs),
            Some(other) => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    format!(
                        "chat_template_kwargs must be an object, got {}",
                        kind_of(other)
                    ),
                ));
            }
        };
        let thinking = match kwargs.and_then(|k| k.get("thinking")) {
            None | Some(Value::Null) => limits.thinking,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs.thinking",
                    format!("chat_template_kwargs.thinking must be a boolean, got {other}"),
                ));
            }
        };
        if let Some(tools) = &fields.tools {
            check_tools("tools", tools)?;
        }
        let effort = match fields
            .thinking_effort
            .as_ref()
            .or_else(|| kwargs.and_then(|k| k.get("thinking_effort")))
        {
            None | Some(Value::Null) => limits.thinking_effort,
            Some(Value::String(s)) => s
                .parse()
                .map_err(|e: ChatError| ApiError::invalid("thinking_effort", e.to_string()))?,
            Some(other) => {
                return Err(ApiError::invalid(
                    "thinking_effort",
                    format!("thinking_effort must be low, high or max, got {other}"),
                ));
            }
        };
        let tool_choice = match &fields.tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(v) => ToolChoice::from_json(v)
                .map_err(|e| ApiError::invalid("tool_choice", e.to_string()))?,
        };
        let has_tools = fields
            .tools
            .as_ref()
            .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        if tool_choice == ToolChoice::Required && !has_tools {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice \"required\" needs a non-empty tools list",
            ));
        }
        let response_format = match &fields.response_format {
            None | Some(Value::Null) => ResponseFormat::Text,
            Some(v) => ResponseFormat::from_json(v)
                .map_err(|e| ApiError::invalid("response_format", e.to_string()))?,
        };
        let constraint = output_constraint(
            &tool_choice,
            fields.tools.as_ref(),
            &response_format,
            thinking,
        )?;
        // A call the model makes anyway under "none" comes back as text, not as a call.
        let tool_calls = tool_choice != ToolChoice::None;
        let options = ChatOptions {
            thinking,
            thinking_effort: effort,
            tool_choice,
            response_format,
        };
        let (segments, system_segments) = render_split(&messages, fields.tools.as_ref(), &options)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        Ok(checked
            .with(Prompt::Chat {
                segments,
                system_segments,
                thinking,
                tool_calls,
            })
            .constrained(constraint))
    }
}

impl<'de> Deserialize<'de> for ChatRequest {
    /// Through [`ChatRequest::from_json`]; its error's message becomes serde's.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let body = Value::deserialize(deserializer)?;
        Self::from_json(&body).map_err(|e| serde::de::Error::custom(e.message))
    }
}

/// A `tools` list as OpenAI takes it: each entry `{"type": "function", "function": {"name":
/// N, ...}}` with a non-empty name, an optional string `description` and an optional object
/// `parameters` (a JSON Schema). `param` names the list (`tools`, `messages[3].tools`).
fn check_tools(param: &str, tools: &Value) -> Result<(), ApiError> {
    let Value::Array(entries) = tools else {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be a list, got {}", kind_of(tools)),
        ));
    };
    for (i, entry) in entries.iter().enumerate() {
        let at = format!("{param}[{i}]");
        let fail = |field: &str, message: String| {
            let name = if field.is_empty() {
                at.clone()
            } else {
                format!("{at}.{field}")
            };
            Err(ApiError::invalid(&name, format!("{name}: {message}")))
        };
        let Value::Object(tool) = entry else {
            return fail(
                "",
                format!("a tool must be an object, got {}", kind_of(entry)),
            );
        };
        match tool.get("type") {
            Some(Value::String(kind)) if kind == "function" => {}
            Some(other) => {
                return fail(
                    "type",
                    format!("only tools of type \"function\" are supported, got {other}"),
                );
            }
            None => return fail("type", "missing; it must be \"function\"".into()),
        }
        let Some(Value::Object(function)) = tool.get("function") else {
            return fail(
                "function",
                "must be an object with the function's name, description and parameters".into(),
            );
        };
        match function.get("name") {
            Some(Value::String(name)) if !name.is_empty() => {}
            Some(Value::String(_)) => return fail("function.name", "must not be empty".into()),
            Some(other) => {
                return fail(
                    "function.name",
                    format!("must be a string, got {}", kind_of(other)),
                );
            }
            None => return fail("function.name", "missing".into()),
        }
        match function.get("description") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(other) => {
                return fail(
                    "function.description",
                    format!("must be a string, got {}", kind_of(other)),
                );
            }
        }
        match function.get("parameters") {
            None | Some(Value::Null | Value::Object(_)) => {}
            Some(other) => {
                return fail(
                    "function.parameters",
                    format!("must be a JSON Schema object, got {}", kind_of(other)),
                );
            }
        }
    }
    Ok(())
}

/// One OpenAI message into ours: `role`, `content` (a string or text parts), `name`,
/// `reasoning_content` (or `reasoning`), `tool_calls` (id, function name and arguments: a JSON-string that
/// holds an object is read as that object, as llama.cpp does before rendering; another string
/// stays a string), for tool results `tool_call_id`, and for system messages `tools`.
fn parse_message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let role = m["role"]
        .as_str()
        .ok_or_else(|| ApiError::invalid(&param, format!("{param} has no role")))?;
    if !matches!(role, "system" | "user" | "assistant" | "tool" | "developer") {
        return Err(ApiError::invalid(
            &param,
            format!("{param}: unknown role {role:?}"),
        ));
    }
    let content = match &m["content"] {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| {
                p["text"].as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid(
                        &param,
                        format!("{param}: only text content parts are supported"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?
            .concat(),
        _ => {
            return Err(ApiError::invalid(
                &param,
                format!("{param}: content must be a string or a list of text parts"),
            ));
        }
    };
    let tool_calls = match &m["tool_calls"] {
        Value::Array(calls) => calls
            .iter()
            .map(|c| {
                let f = &c["function"];
                let name = f["name"].as_str().unwrap_or_default().to_owned();
                let arguments = match &f["arguments"] {
                    Value::String(s) => match serde_json::from_str::<Value>(s) {
                        Ok(object @ Value::Object(_)) => object,
                        _ => Value::String(s.clone()),
                    },
                    other @ (Value::Object(_) | Value::Null) => other.clone(),
                    other => {
                        return Err(ApiError::invalid(
                            &param,
                            format!("{param}: tool call arguments must be an object or a string, got {other}"),
                        ));
                    }
                };
                let id = c["id"].as_str().map(str::to_owned);
                Ok(ToolCall { id, name, arguments })
            })
            .collect::<Result<Vec<_>, ApiError>>()?,
        _ => Vec::new(),
    };
    Ok(Message {
        role: if role == "developer" {
            "system".into()
        } else {
            role.into()
        },
        content,
        // The template takes `reasoning_content or reasoning`.
        reasoning: m["reasoning_content"]
            .as_str()
            .filter(|r| !r.is_empty())
            .or_else(|| m["reasoning"].as_str())
            .map(str::to_owned),
        tool_calls,
        name: m["name"].as_str().map(str::to_owned),
        tool_call_id: m["tool_call_id"].as_str().map(str::to_owned),
        tools: match &m["tools"] {
            Value::Null => None,
            tools @ Value::Array(_) if role == "system" || role == "developer" => {
                check_tools(&format!("{param}.tools"), tools)?;
                Some(tools.clone())
            }
            _ => {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param}: tools are a list, on a system message"),
                ));
            }
        },
    })
}
