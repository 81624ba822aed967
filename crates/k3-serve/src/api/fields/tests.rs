//! Tests of `fields.rs`.

use super::*;
use serde::Deserialize;
use serde_json::json;

#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct Sample {
    a: Option<i64>,
    #[serde(rename = "bee")]
    b: Option<Vec<String>>,
}

#[test]
fn field_names_are_the_derived_ones() {
    assert_eq!(field_names::<Sample>(), &["a", "bee"]);
    assert!(field_names::<u32>().is_empty());
}

#[test]
fn a_wrong_type_names_its_field() {
    let error = typed::<Sample>(&json!({"a": "x"})).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("a"));
    assert!(
        error.message.contains("invalid type: string"),
        "{}",
        error.message
    );
    let error = typed::<Sample>(&json!({"bee": ["ok", 3]})).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("bee[1]"));
    assert!(typed::<Sample>(&json!({"a": 3, "other": true})).is_ok());
}

#[test]
fn unknown_keys_keep_the_body_order() {
    let body = json!({"zeta": 1, "a": 2, "min_tokens": 3, "bee": 4});
    let body = body.as_object().unwrap();
    assert_eq!(
        unknown(body, &[field_names::<Sample>()]),
        vec!["zeta".to_owned(), "min_tokens".to_owned()]
    );
}
