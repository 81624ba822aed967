//! Forced tool calls: the XTML `tools` element with one call whose `json` block follows the
//! tool's parameters, read back by k3-model's output parser.

use k3_structured::{ANSWER_TRAILER, Grammar, Options, Spec};
use serde_json::{Value, json};

use crate::generate::{generate, seeds};
use crate::json::nested_schema;
use crate::{feed, vocab};

fn weather() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    })
}

/// Generates 50 sequences greedy and 50 at temperature 1 under `spec`; each must parse into
/// exactly one call to a tool of `tools` with arguments valid against its parameters.
fn check(spec: &Spec, tools: &[(&str, Value)], thinking: bool, salt: u64) -> Vec<String> {
    let options = Options {
        thinking,
        ..Options::default()
    };
    let grammar = Grammar::compile(&vocab(), spec, &options).unwrap();
    let mut called = Vec::new();
    for temperature in [0.0, 1.0] {
        for seed in seeds(salt, 50) {
            let out = generate(&grammar, temperature, seed, thinking);
            assert_eq!(out.calls.len(), 1, "seed {seed}: {out:?}");
            assert!(out.content.is_empty(), "seed {seed}: {:?}", out.content);
            let call = &out.calls[0];
            let (_, parameters) = tools
                .iter()
                .find(|(name, _)| *name == call.name)
                .unwrap_or_else(|| panic!("seed {seed}: a call to {:?}", call.name));
            let Value::String(text) = &call.arguments else {
                panic!(
                    "seed {seed}: arguments {:?} are not a json block",
                    call.arguments
                );
            };
            let arguments: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
            let validator = jsonschema::validator_for(parameters).unwrap();
            assert!(
                validator.is_valid(&arguments),
                "seed {seed}: {arguments} breaks {parameters}"
            );
            called.push(call.name.clone());
        }
    }
    called
}

#[test]
fn a_forced_call_parses_into_that_tool_with_valid_arguments() {
    let spec = Spec::ToolCall {
        name: "get_weather".into(),
        parameters: weather(),
    };
    check(&spec, &[("get_weather", weather())], false, 10);
    check(&spec, &[("get_weather", weather())], true, 11);
}

#[test]
fn a_required_call_goes_to_one_of_the_tools() {
    // Names that need escaping in an attribute, and a schema without `"type"`.
    let ping = json!({
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": false
    });
    let tools = [
        ("get_weather", weather()),
        ("A&B\"q", nested_schema()),
        ("ping", ping.clone()),
    ];
    let spec = Spec::AnyToolCall(
        tools
            .iter()
            .map(|(name, p)| ((*name).to_owned(), p.clone()))
            .collect(),
    );
    let any_object = [
        ("get_weather", weather()),
        ("A&B\"q", nested_schema()),
        (
            "ping",
            json!({"type": "object", "properties": ping["properties"].clone(), "additionalProperties": false}),
        ),
    ];
    let called = check(&spec, &any_object, false, 12);
    for (name, _) in &any_object {
        assert!(called.iter().any(|c| c == name), "{name} never called");
    }
}

#[test]
fn the_markup_is_the_renderers() {
    // Greedy output, decoded: the bytes `write_assistant` renders for a json-block call.
    let spec = Spec::ToolCall {
        name: "ping".into(),
        parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}),
    };
    let grammar = Grammar::compile(&vocab(), &spec, &Options::default()).unwrap();
    let out = generate(&grammar, 0.0, 7, false);
    let text = crate::tokenizer().decode(&out.tokens);
    let json_start = text.find('{').unwrap();
    let json_end = text.rfind('}').unwrap() + 1;
    assert_eq!(
        &text[..json_start],
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"ping\" index=\"1\"<|sep|>\
         <|open|>json type=\"object\"<|sep|>"
    );
    assert_eq!(
        &text[json_end..],
        "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
    );
}

#[test]
fn a_tool_without_a_schema_takes_any_object() {
    let spec = Spec::ToolCall {
        name: "ping".into(),
        parameters: Value::Null,
    };
    let grammar = Grammar::compile(&vocab(), &spec, &Options::default()).unwrap();
    for seed in seeds(13, 10) {
        let out = generate(&grammar, 0.0, seed, false);
        let Value::String(text) = &out.calls[0].arguments else {
            panic!("{out:?}");
        };
        assert!(text.starts_with('{') && text.ends_with('}'), "{text:?}");
    }
}

/// A strict tool under `tool_choice: "auto"` (`Spec::TextOrToolCall`): free text may end the
/// answer, or a call may follow it; a strict tool's arguments must follow its parameters, a
/// tool that is not strict takes any object.
#[test]
fn strict_tools_constrain_the_arguments_only_when_called() {
    let spec = Spec::TextOrToolCall(vec![
        ("weather".into(), weather()),
        ("note".into(), json!({})),
    ]);
    let grammar = Grammar::compile(&vocab(), &spec, &Options::default()).unwrap();
    let end = crate::special("<|end_of_msg|>");
    let opened = |tool: &str| {
        format!(
            "Let me check.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"{tool}\" \
             index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>"
        )
    };
    let closed =
        "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";

    // Free text, no call.
    let mut m = k3_structured::Matcher::new(&grammar);
    let text = format!("Any text {{ at all.{ANSWER_TRAILER}");
    assert_eq!(feed(&mut m, &text), None, "{text}");
    assert!(m.mask().unwrap().allows(end));
    m.commit(end).unwrap();
    assert!(m.has_ended());

    // A strict call with valid arguments, then the end.
    let mut m = k3_structured::Matcher::new(&grammar);
    let text = format!(
        "{}{}{closed}",
        opened("weather"),
        r#"{"city": "Oslo", "unit": "celsius"}"#
    );
    assert_eq!(feed(&mut m, &text), None, "{text}");
    assert!(m.mask().unwrap().allows(end));

    // A strict call whose arguments break the schema: refused before the bad key ends.
    let mut m = k3_structured::Matcher::new(&grammar);
    assert_eq!(feed(&mut m, &opened("weather")), None);
    assert!(feed(&mut m, r#"{"town": "Oslo"}"#).is_some());
    let mut m = k3_structured::Matcher::new(&grammar);
    assert_eq!(feed(&mut m, &opened("weather")), None);
    assert!(
        feed(&mut m, r#"{"city": "Oslo"}"#).is_some(),
        "unit is required"
    );

    // The tool that is not strict takes any object.
    let mut m = k3_structured::Matcher::new(&grammar);
    let text = format!(
        "{}{}{closed}",
        opened("note"),
        r#"{"town": [1, 2], "x": null}"#
    );
    assert_eq!(feed(&mut m, &text), None, "{text}");

    // A tool that is not listed is refused.
    let mut m = k3_structured::Matcher::new(&grammar);
    assert!(feed(&mut m, &opened("delete")).is_some());
}
