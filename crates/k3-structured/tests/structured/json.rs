//! JSON answers: any object, and a nested schema, greedy and at temperature 1, thinking off
//! and on; each output parsed by k3-model's output parser and validated by `jsonschema`.

use k3_structured::{Error, Grammar, Options, Spec};
use serde_json::{Value, json};

use crate::generate::{generate, seeds};
use crate::vocab;

/// Objects, arrays, enums, bounded numbers, required keys, no additional properties.
pub(crate) fn nested_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}
                },
                "required": ["city"],
                "additionalProperties": false
            },
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "role", "address"],
        "additionalProperties": false
    })
}

/// `text` as a JSON value; `None` for valid JSON holding a number past f64's range (JSON has
/// no bound; an unbounded `number` may say `1e999`), which serde_json can check but not hold.
pub(crate) fn parse_json(text: &str) -> Option<Value> {
    match serde_json::from_str(text) {
        Ok(value) => Some(value),
        Err(e) => {
            assert!(
                e.to_string().contains("number out of range"),
                "{e}: {text:?}"
            );
            serde_json::from_str::<serde::de::IgnoredAny>(text)
                .unwrap_or_else(|e| panic!("{e}: {text:?}"));
            None
        }
    }
}

/// 50 sequences greedy and 50 at temperature 1 under `spec`; each content must be JSON
/// valid against `schema`, with nothing else around it.
fn check(spec: &Spec, schema: &Value, thinking: bool, salt: u64) {
    let validator = jsonschema::validator_for(schema).unwrap();
    let options = Options {
        thinking,
        ..Options::default()
    };
    let grammar = Grammar::compile(&vocab(), spec, &options).unwrap();
    let mut reasoned = 0;
    for temperature in [0.0, 1.0] {
        for seed in seeds(salt, 50) {
            let out = generate(&grammar, temperature, seed, thinking);
            let Some(value) = parse_json(&out.content) else {
                assert!(
                    out.content.trim_start().starts_with('{'),
                    "{:?}",
                    out.content
                );
                continue;
            };
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            assert!(
                errors.is_empty(),
                "seed {seed}: {value} breaks the schema: {errors:?}"
            );
            assert!(out.calls.is_empty());
            if !thinking {
                assert!(out.reasoning.is_empty());
            }
            reasoned += usize::from(!out.reasoning.is_empty());
        }
    }
    if thinking {
        assert!(reasoned > 0, "the reasoning was free, yet always empty");
    }
}

#[test]
fn json_object_outputs_are_objects() {
    check(&Spec::JsonObject, &json!({"type": "object"}), false, 1);
}

#[test]
fn nested_schema_outputs_validate() {
    check(
        &Spec::JsonSchema(nested_schema()),
        &nested_schema(),
        false,
        2,
    );
}

#[test]
fn with_thinking_the_reasoning_is_free_and_the_answer_validates() {
    check(
        &Spec::JsonSchema(nested_schema()),
        &nested_schema(),
        true,
        3,
    );
}

#[test]
fn a_lark_grammar_constrains_the_answer() {
    let spec = Spec::Lark("start: \"yes\" | \"no\" | NUMBER\nNUMBER: /[1-9][0-9]{0,2}/\n".into());
    for thinking in [false, true] {
        let options = Options {
            thinking,
            ..Options::default()
        };
        let grammar = Grammar::compile(&vocab(), &spec, &options).unwrap();
        for seed in seeds(4, 20) {
            let out = crate::generate::generate(&grammar, 1.0, seed, thinking);
            let ok = out.content == "yes"
                || out.content == "no"
                || (out.content.len() <= 3
                    && out.content.parse::<u32>().is_ok_and(|n| n > 0)
                    && !out.content.starts_with('0'));
            assert!(ok, "seed {seed}: {:?}", out.content);
        }
    }
}

#[test]
fn an_unsupported_keyword_is_named() {
    let schema = json!({"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": true}
    }});
    let err = Grammar::compile(
        &vocab(),
        &Spec::JsonSchema(schema.clone()),
        &Options::default(),
    )
    .unwrap_err();
    assert_eq!(
        err,
        Error::Unsupported {
            keyword: "uniqueItems".into()
        }
    );
    assert!(err.to_string().contains("uniqueItems"), "{err}");
    // The same in a tool's parameters.
    let spec = Spec::ToolCall {
        name: "f".into(),
        parameters: schema,
    };
    assert!(matches!(
        Grammar::compile(&vocab(), &spec, &Options::default()),
        Err(Error::Unsupported { keyword }) if keyword == "uniqueItems"
    ));
}

#[test]
fn malformed_schemas_and_grammars_are_invalid() {
    let unsatisfiable = json!({"type": "integer", "minimum": 5, "maximum": 1});
    for spec in [
        Spec::JsonSchema(unsatisfiable),
        Spec::JsonSchema(json!({"type": "object", "properties": {"x": {"type": "strung"}}})),
        Spec::Lark("start: undefined_rule\n".into()),
        Spec::AnyToolCall(Vec::new()),
    ] {
        let err = Grammar::compile(&vocab(), &spec, &Options::default()).unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{spec:?}: {err:?}");
    }
}

/// What the grammar writes after a JSON answer is `ANSWER_TRAILER`, then the end token (the
/// engine keeps room for exactly that when it closes an answer itself).
#[test]
fn the_answer_trailer_is_what_follows_a_json_answer() {
    let grammar = Grammar::compile(&vocab(), &Spec::JsonObject, &Options::default()).unwrap();
    let mut matcher = k3_structured::Matcher::new(&grammar);
    let text = format!("{{\"a\": [1, null]}}{}", k3_structured::ANSWER_TRAILER);
    assert_eq!(crate::feed(&mut matcher, &text), None, "{text}");
    assert!(matcher.is_finished());
    assert!(
        matcher
            .mask()
            .unwrap()
            .allows(crate::special("<|end_of_msg|>"))
    );
}
