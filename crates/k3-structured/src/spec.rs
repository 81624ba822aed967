//! What a request constrains ([`Spec`]), how ([`Options`], [`Limits`]), and the llguidance
//! grammar that says it in XTML: the answer inside the `response` element the generation
//! prompt opened (after free reasoning when thinking is on), or a `tools` element with one
//! call whose `json` block follows the tool's parameter schema.

use std::time::Duration;

use k3_model::chat::escape;
use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use serde_json::{Value, json};

use crate::error::Error;

/// A constraint on the model's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON following this schema (OpenAI's `json_schema.schema`).
    JsonSchema(Value),
    /// Text following this grammar in llguidance's Lark syntax (its `start` rule).
    Lark(String),
    /// A call to this tool (`tool_choice` naming a function): the XTML `tools` element with
    /// one call whose arguments are a `json` block following `parameters` (an object schema;
    /// `{}` or `null` for any object).
    ToolCall {
        /// The tool's name.
        name: String,
        /// Its parameters' JSON Schema.
        parameters: Value,
    },
    /// A call to one of these tools (`tool_choice: "required"`), as [`Spec::ToolCall`].
    AnyToolCall(Vec<(String, Value)>),
    /// Free text, then optionally a call to one of these tools, as [`Spec::ToolCall`] (tools
    /// marked `strict: true` under `tool_choice: "auto"`: their arguments follow their
    /// parameters whenever the model calls them; give `{}` as the parameters of a tool that is
    /// not strict).
    TextOrToolCall(Vec<(String, Value)>),
    /// Every id of the vocabulary (those the tokenizer has no bytes for too), the end token
    /// anywhere: no constraint at all, through the constrained path (to show that a mask
    /// allowing everything changes nothing).
    Any,
}

/// How a constraint applies to one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options {
    /// The generation prompt left a `think` element open: the output begins with free
    /// reasoning up to the think closer, and the constraint applies to what follows. Off:
    /// the prompt left `response` open and the output starts with the answer.
    pub thinking: bool,
    /// Bounds on the work.
    pub limits: Limits,
}

/// Per-request bounds on the work a constraint may cost.
///
/// llguidance bounds each step by work counts ("fuel"), which stop a pathological schema or
/// grammar; the durations are checked when a step returns, so a request whose constraint is
/// too slow on this machine fails with [`crate::Error::CompileTime`] or
/// [`crate::Error::MaskTime`] instead of slowing every sequence in the batch.
///
/// Defaults, from `examples/mask_time.rs` on a 2-core AMD EPYC (release build, random-logit
/// sequences, nested test schema and a forced tool call): over a 163,840-id vocabulary whose
/// every id has bytes, compiling (with the first mask) takes ~2-3 ms and a mask ~10-50 µs on
/// average, 1.2 ms at the 99th percentile and under 6 ms at worst. So 1 s to compile and 50 ms
/// per mask leave ample room for real schemas while still stopping one that would stall
/// every sequence sharing the decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Most wall-clock time one compile may take.
    pub compile: Duration,
    /// Most wall-clock time one token mask may take.
    pub mask: Duration,
    /// Most symbols in the compiled grammar (llguidance's `max_grammar_size`).
    pub grammar_size: usize,
    /// Lexer work allowed while compiling (llguidance's `initial_lexer_fuel`, ~50k per ms).
    pub compile_fuel: u64,
    /// Lexer work allowed for one mask (llguidance's `step_lexer_fuel`, ~14k per ms).
    pub mask_fuel: u64,
}

impl Default for Limits {
    fn default() -> Self {
        let llguidance = llguidance::api::ParserLimits::default();
        Self {
            compile: Duration::from_secs(1),
            mask: Duration::from_millis(50),
            grammar_size: llguidance.max_grammar_size,
            compile_fuel: llguidance.initial_lexer_fuel,
            mask_fuel: llguidance.step_lexer_fuel,
        }
    }
}

impl Limits {
    pub(crate) fn parser_limits(&self) -> llguidance::api::ParserLimits {
        llguidance::api::ParserLimits {
            max_grammar_size: self.grammar_size,
            initial_lexer_fuel: self.compile_fuel,
            step_lexer_fuel: self.mask_fuel,
            // Errors carry the message, not the parser's state and the whole grammar.
            verbose_errors: false,
            ..Default::default()
        }
    }
}

/// The name a user's Lark grammar goes by inside the XTML wrapper.
const ANSWER_GRAMMAR: &str = "answer";

/// The markup the grammar writes after a JSON, Lark or free-text answer: the `response` and
/// `message` closers (`<|end_of_msg|>` follows). A caller that completes an answer itself (the
/// engine closing a JSON answer before `max_tokens`) keeps room for it.
pub const ANSWER_TRAILER: &str = "<|close|>response<|sep|><|close|>message<|sep|>";

/// The llguidance grammar for `spec` as the model writes it in XTML.
pub(crate) fn top_level(spec: &Spec, options: &Options) -> Result<TopLevelGrammar, Error> {
    let mut lark = String::from("%llguidance {}\n");
    // After the prompt's opener: reasoning and the think closer, then the response opener.
    let opened = if options.thinking {
        "REASONING <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> "
    } else {
        ""
    };
    let end = "<|close|> \"message\" <|sep|>";
    let mut answer_grammar = None;
    match spec {
        Spec::Any => return Ok(TopLevelGrammar::from_lark("start: <[*]>*\n".to_owned())),
        Spec::JsonObject | Spec::JsonSchema(_) | Spec::Lark(_) => {
            lark += &format!("start: {opened}answer <|close|> \"response\" <|sep|> {end}\n");
            match spec {
                Spec::JsonObject => {
                    lark += &format!("answer: {}\n", json_rule(&json!({"type": "object"})));
                }
                Spec::JsonSchema(schema) => lark += &format!("answer: {}\n", json_rule(schema)),
                Spec::Lark(text) => {
                    lark += &format!("answer: @{ANSWER_GRAMMAR}\n");
                    answer_grammar = Some(text.clone());
                }
                _ => unreachable!("matched above"),
            }
        }
        Spec::ToolCall { name, parameters } => {
            lark += &tools(opened, "", end, &[(name.clone(), parameters.clone())]);
        }
        Spec::AnyToolCall(given) if given.is_empty() => {
            return Err(Error::Invalid("a call to one of no tools".into()));
        }
        Spec::AnyToolCall(given) => lark += &tools(opened, "", end, given),
        Spec::TextOrToolCall(given) if given.is_empty() => {
            return Err(Error::Invalid("a call to one of no tools".into()));
        }
        Spec::TextOrToolCall(given) => {
            lark += &tools(opened, "TEXT ", end, given);
            lark += "TEXT: /(?s:.*)/\n";
        }
    }
    if options.thinking {
        lark += "REASONING: /(?s:.*)/\n";
    }
    let mut top = TopLevelGrammar::from_lark(lark);
    if let Some(text) = answer_grammar {
        let mut answer = GrammarWithLexer::from_lark(text);
        answer.name = Some(ANSWER_GRAMMAR.to_owned());
        top.grammars.push(answer);
    }
    Ok(top)
}

/// The response (`text`: empty, or `TEXT ` for free text), then a `tools` element holding one
/// call to one of `tools`, its arguments a `json` block (as `write_assistant` renders string
/// arguments); after free text the `tools` element is optional.
fn tools(opened: &str, text: &str, end: &str, tools: &[(String, Value)]) -> String {
    let element = "<|open|> \"tools\" <|sep|> call <|close|> \"tools\" <|sep|>";
    let element = if text.is_empty() {
        element.to_owned()
    } else {
        format!("({element})?")
    };
    let mut lark = format!("start: {opened}{text}<|close|> \"response\" <|sep|> {element} {end}\n");
    let calls: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    lark += &format!("call: {}\n", calls.join(" | "));
    for (i, (name, parameters)) in tools.iter().enumerate() {
        let tag = format!("call tool=\"{}\" index=\"1\"", escape(name));
        lark += &format!(
            "call_{i}: <|open|> {} <|sep|> <|open|> \"json type=\\\"object\\\"\" <|sep|> args_{i} \
             <|close|> \"json\" <|sep|> <|close|> \"call\" <|sep|>\n",
            lark_string(&tag)
        );
        lark += &format!("args_{i}: {}\n", json_rule(&object_schema(parameters)));
    }
    lark
}

/// How the JSON is laid out where the schema does not say (its `x-guidance`): Python's
/// `json.dumps` separators (`", "`, `": "`), the form K3's chat template writes JSON in, and no
/// other whitespace. Flexible whitespace lets a model (a random one always, a trained one
/// sometimes) write newlines and spaces without end until `max_tokens` cuts the JSON.
fn json_rule(schema: &Value) -> String {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        other => other.clone(),
    };
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    format!("%json {schema}")
}

/// A parameter schema made an object schema: `null` or one without `type` gets
/// `"type": "object"` (a `json` block holds an object).
fn object_schema(parameters: &Value) -> Value {
    match parameters {
        Value::Null => serde_json::json!({"type": "object"}),
        Value::Object(map) if !map.contains_key("type") => {
            let mut map = map.clone();
            map.insert("type".into(), "object".into());
            Value::Object(map)
        }
        other => other.clone(),
    }
}

/// A Lark string literal (llguidance reads them as JSON strings).
fn lark_string(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}
