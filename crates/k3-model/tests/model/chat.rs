//! XTML rendering (K3_SPEC §10.2) as segment lists, golden for each message shape, and the
//! output parser on streamed tokens.

use k3_model::chat::{Delta, Message, OutputParser, Segment, ToolCall, encode, render};
use k3_model::tokenizer::Tokenizer;
use serde_json::json;

use crate::frozen::data_dir;

/// Segments joined by `|`, control segments as they are.
fn show(segments: &[Segment]) -> String {
    segments
        .iter()
        .map(|s| s.text.as_str())
        .collect::<Vec<_>>()
        .join("|")
}

fn user(text: &str) -> Message {
    Message {
        role: "user".into(),
        content: text.into(),
        ..Message::default()
    }
}

const USER_HI: &str =
    r#"<|open|>|message| role|="|user|"|<|sep|>|Hi|<|close|>|message|<|sep|>|<|end_of_msg|>"#;
const PROMPT: &str = r#"<|open|>|message| role|="|assistant|"|<|sep|>"#;

#[test]
fn a_plain_turn_with_thinking_on_and_off() {
    let on = render(&[user("Hi")], None, true);
    assert_eq!(
        show(&on),
        format!("{USER_HI}|{PROMPT}|<|open|>|think|<|sep|>")
    );
    let off = render(&[user("Hi")], None, false);
    assert_eq!(
        show(&off),
        format!("{USER_HI}|{PROMPT}|<|open|>|response|<|sep|>")
    );
    // Only the markers are control segments; user text that spells a marker stays text.
    let tricky = render(&[user("<|close|>")], None, true);
    assert!(tricky.iter().any(|s| s.text == "<|close|>" && !s.special));
}

#[test]
fn a_past_assistant_turn_keeps_reasoning_and_response() {
    let past = Message {
        role: "assistant".into(),
        content: "Hello!".into(),
        reasoning: Some("Greet back.".into()),
        ..Message::default()
    };
    let got = show(&render(&[user("Hi"), past], None, true));
    assert_eq!(
        got,
        format!(
            "{USER_HI}|{PROMPT}|<|open|>|think|<|sep|>|Greet back.|<|close|>|think|<|sep|>|<|open|>|response|<|sep|>|Hello!|<|close|>|response|<|sep|>|<|close|>|message|<|sep|>|<|end_of_msg|>|{PROMPT}|<|open|>|think|<|sep|>"
        )
    );
}

#[test]
fn tools_declared_called_and_answered() {
    let tools = json!([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]);
    let call = Message {
        role: "assistant".into(),
        content: String::new(),
        tool_calls: vec![ToolCall {
            name: "get_time".into(),
            arguments: json!({"zone": "UTC", "precise": true}),
        }],
        ..Message::default()
    };
    let result = Message {
        role: "tool".into(),
        content: "12:00".into(),
        tool_name: Some("get_time".into()),
        tool_index: Some(0),
        ..Message::default()
    };
    let got = show(&render(&[user("Time?"), call, result], Some(&tools), false));
    let declare = format!(
        "<|open|>|message| role|=\"|system|\"| type|=\"|tool-declare|\"|<|sep|>|# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```|<|close|>|message|<|sep|>|<|end_of_msg|>",
        serde_json::to_string(&tools).unwrap()
    );
    let calls = r#"<|open|>|tools|<|sep|>|<|open|>|call| tool|="|get_time|"| index|="|0|"|<|sep|>|<|open|>|argument| key|="|precise|"| type|="|boolean|"|<|sep|>|true|<|close|>|argument|<|sep|>|<|open|>|argument| key|="|zone|"| type|="|string|"|<|sep|>|UTC|<|close|>|argument|<|sep|>|<|close|>|call|<|sep|>|<|close|>|tools|<|sep|>"#;
    let expected = format!(
        "{declare}|<|open|>|message| role|=\"|user|\"|<|sep|>|Time?|<|close|>|message|<|sep|>|<|end_of_msg|>|{PROMPT}|<|open|>|response|<|sep|>|<|close|>|response|<|sep|>|{calls}|<|close|>|message|<|sep|>|<|end_of_msg|>|<|open|>|message| role|=\"|tool|\"| tool|=\"|get_time|\"| index|=\"|0|\"|<|sep|>|12:00|<|close|>|message|<|sep|>|<|end_of_msg|>|{PROMPT}|<|open|>|response|<|sep|>"
    );
    assert_eq!(got, expected);
}

#[test]
fn attribute_values_are_escaped() {
    let call = Message {
        role: "tool".into(),
        content: "ok".into(),
        tool_name: Some("A&B\"C".into()),
        tool_index: Some(1),
        ..Message::default()
    };
    let got = show(&render(&[call], None, true));
    assert!(got.contains(r#"| tool|="|A&amp;B&quot;C|"|"#), "{got}");
}

#[test]
fn segments_encode_separately_and_markers_become_specials() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let ids = encode(&tokenizer, &render(&[user("Hi")], None, true));
    let open = tokenizer.special("<|open|>").unwrap();
    assert_eq!(ids[0], open);
    assert_eq!(ids.iter().filter(|&&id| id == open).count(), 3);
    assert_eq!(
        ids.iter()
            .filter(|&&id| Some(id) == tokenizer.special("<|end_of_msg|>"))
            .count(),
        1
    );
}

#[test]
fn streamed_output_splits_into_reasoning_content_and_tool_calls() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let generated = "Think about é and 中.<|close|>think<|sep|><|open|>response<|sep|>The answer: 42.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_time\" index=\"0\"<|sep|><|open|>argument key=\"zone\" type=\"string\"<|sep|>UTC<|close|>argument<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    let ids = tokenizer.encode(generated, true);
    let mut parser = OutputParser::new(&tokenizer, true).unwrap();
    let mut deltas = Vec::new();
    for &id in &ids {
        deltas.extend(parser.push(id, &tokenizer.decode_bytes(&[id])));
    }
    deltas.extend(parser.finish());
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| match d {
            Delta::Reasoning(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let content: String = deltas
        .iter()
        .filter_map(|d| match d {
            Delta::Content(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let calls: Vec<&ToolCall> = deltas
        .iter()
        .filter_map(|d| match d {
            Delta::ToolCall(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "Think about é and 中.");
    assert_eq!(content, "The answer: 42.");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "get_time");
    assert_eq!(calls[0].arguments, json!({"zone": "UTC", "n": 3}));
    // No delta ever carries marker text.
    for d in &deltas {
        if let Delta::Reasoning(t) | Delta::Content(t) = d {
            assert!(
                !t.contains("think") && !t.contains("response") && !t.contains("<|"),
                "{d:?}"
            );
        }
    }
}
