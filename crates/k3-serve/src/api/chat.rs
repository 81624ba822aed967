//! A chat request's validation: its messages parsed into ours, the template's options
//! (thinking, effort, tool choice, response format) checked, the conversation rendered.

use k3_model::chat::{
    ChatError, ChatOptions, Message, ResponseFormat, ToolCall, ToolChoice, render_split,
};
use serde_json::Value;

use super::{ApiError, ChatRequest, Limits, Prompt, ValidRequest};

impl ChatRequest {
    pub fn validate(self, limits: &Limits) -> Result<ValidRequest, ApiError> {
        let checked = self.common.validate(limits)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| parse_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let kwargs = self.chat_template_kwargs.as_ref();
        let thinking = kwargs
            .and_then(|k| k.get("thinking"))
            .and_then(Value::as_bool)
            .unwrap_or(limits.thinking);
        if let Some(tools) = &self.tools
            && !tools.is_array()
        {
            return Err(ApiError::invalid("tools", "tools must be a list"));
        }
        let effort = match self
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
        let tool_choice = match &self.tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(v) => ToolChoice::from_json(v)
                .map_err(|e| ApiError::invalid("tool_choice", e.to_string()))?,
        };
        let has_tools = self
            .tools
            .as_ref()
            .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        match &tool_choice {
            // Neither the chat template nor our decoder can make the model call one given
            // function (llama.cpp does it with a grammar): refused rather than ignored.
            ToolChoice::Function(name) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice naming a function ({name:?}) is not supported; use \"required\" or \"auto\""
                    ),
                ));
            }
            ToolChoice::Required if !has_tools => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice \"required\" needs a non-empty tools list",
                ));
            }
            _ => {}
        }
        let response_format = match &self.response_format {
            None | Some(Value::Null) => ResponseFormat::Text,
            Some(v) => ResponseFormat::from_json(v)
                .map_err(|e| ApiError::invalid("response_format", e.to_string()))?,
        };
        let options = ChatOptions {
            thinking,
            thinking_effort: effort,
            tool_choice,
            response_format,
        };
        let (segments, system_segments) = render_split(&messages, self.tools.as_ref(), &options)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        Ok(checked.with(Prompt::Chat {
            segments,
            system_segments,
            thinking,
        }))
    }
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
