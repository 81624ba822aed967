//! Structured outputs: what a chat request's `response_format`, `tool_choice` and strict tools
//! constrain its answer to ([`OutputConstraint`]), chosen while validating. The grammar is
//! compiled later, on the blocking pool, where a schema the library refuses becomes a 400
//! (`crate::engine::prompt`).
//!
//! Precedence, one constraint per request: a forced call (`tool_choice` naming a function, or
//! `"required"`) first; then a JSON `response_format`; then tools marked `strict: true`, whose
//! arguments are constrained whenever the model calls them (free text otherwise).

use k3_model::chat::{ResponseFormat, ToolChoice};
use k3_structured::Spec;
use serde_json::Value;

use super::error::ApiError;

/// What a request's answer is constrained to.
#[derive(Debug, Clone)]
pub struct OutputConstraint {
    /// The grammar's source.
    pub spec: Spec,
    /// The output begins in reasoning, which stays free: the constraint applies to the answer
    /// after it.
    pub thinking: bool,
    /// The request field it comes from (`response_format`, `tool_choice`, `tools`), named in
    /// the 400 when the library refuses it.
    pub field: &'static str,
}

/// The constraint a chat request asks for, if any. `tools` has been checked
/// (`chat::check_tools`): a list of function tools with names.
pub(super) fn output_constraint(
    tool_choice: &ToolChoice,
    tools: Option<&Value>,
    response_format: &ResponseFormat,
    thinking: bool,
) -> Result<Option<OutputConstraint>, ApiError> {
    let tools = tool_list(tools);
    let constraint = |spec, field| {
        Some(OutputConstraint {
            spec,
            thinking,
            field,
        })
    };
    match tool_choice {
        ToolChoice::Function(name) => {
            let Some(tool) = tools.iter().find(|t| &t.name == name) else {
                let known: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice names the function {name:?}, which is not in tools ({})",
                        if known.is_empty() {
                            "none given".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            };
            return Ok(constraint(
                Spec::ToolCall {
                    name: tool.name.clone(),
                    parameters: tool.parameters.clone(),
                },
                "tool_choice",
            ));
        }
        ToolChoice::Required => {
            let tools = tools.into_iter().map(|t| (t.name, t.parameters)).collect();
            return Ok(constraint(Spec::AnyToolCall(tools), "tool_choice"));
        }
        ToolChoice::Auto | ToolChoice::None => {}
    }
    match response_format {
        ResponseFormat::JsonObject => return Ok(constraint(Spec::JsonObject, "response_format")),
        ResponseFormat::JsonSchema(Value::Null) => {
            return Err(ApiError::invalid(
                "response_format",
                "response_format json_schema needs json_schema.schema, a JSON Schema",
            ));
        }
        ResponseFormat::JsonSchema(schema @ (Value::Object(_) | Value::Bool(_))) => {
            return Ok(constraint(
                Spec::JsonSchema(schema.clone()),
                "response_format",
            ));
        }
        ResponseFormat::JsonSchema(other) => {
            return Err(ApiError::invalid(
                "response_format",
                format!(
                    "response_format json_schema.schema must be a JSON Schema object, got {other}"
                ),
            ));
        }
        ResponseFormat::Text => {}
    }
    if *tool_choice == ToolChoice::Auto && tools.iter().any(|t| t.strict) {
        // Free text, or a call whose arguments follow its tool's parameters where the tool
        // is strict (any object where it is not).
        let tools = tools
            .into_iter()
            .map(|t| {
                let parameters = if t.strict {
                    t.parameters
                } else {
                    serde_json::json!({"type": "object"})
                };
                (t.name, parameters)
            })
            .collect();
        return Ok(constraint(Spec::TextOrToolCall(tools), "tools"));
    }
    Ok(None)
}

/// A tool of the request's `tools`.
struct Tool {
    name: String,
    /// Its parameters' schema (an object schema when absent).
    parameters: Value,
    /// `strict: true`: its arguments are constrained whenever the model calls it.
    strict: bool,
}

/// The tools of a checked `tools` list.
fn tool_list(tools: Option<&Value>) -> Vec<Tool> {
    let Some(Value::Array(entries)) = tools else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            let function = entry.get("function")?;
            Some(Tool {
                name: function.get("name")?.as_str()?.to_owned(),
                parameters: match function.get("parameters") {
                    Some(p @ Value::Object(_)) => p.clone(),
                    _ => serde_json::json!({"type": "object"}),
                },
                strict: function.get("strict").and_then(Value::as_bool) == Some(true),
            })
        })
        .collect()
}
