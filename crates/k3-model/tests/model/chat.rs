//! XTML rendering (docs/MODEL.md §10.2) against llama.cpp's Kimi-K3 chat template, rendered by
//! jinja2 and frozen by `cargo xtask oracle-chat` (`tests/data/chat/`): every conversation
//! byte for byte, and every assistant turn in it back through the output parser. Plus the
//! segment rules (markers only in control segments) and the parser on streamed tokens.

use k3_model::chat::{
    ChatError, ChatOptions, Delta, Message, OutputParser, ResponseFormat, Segment, ThinkingEffort,
    ToolCall, ToolChoice, encode, render, render_assistant, take_text,
};
use k3_model::tokenizer::Tokenizer;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::frozen::{data_dir, read_frozen};

const REGENERATE: &str = "cargo xtask oracle-chat";
/// `vendor/llama.cpp/models/templates/Kimi-K3.jinja` of llama-cpp-python 0.3.36.
const TEMPLATE_SHA256: &str = "4578103bf225f58d5b7ceb613ccc2ac8fe82b6707b7289211b3d4825e87806b3";

fn text(segments: &[Segment]) -> String {
    segments.iter().map(|s| s.text.as_str()).collect()
}

fn user(content: &str) -> Message {
    Message {
        role: "user".into(),
        content: content.into(),
        ..Message::default()
    }
}

/// One conversation of `conversations.json`: OpenAI-style messages and template variables.
struct Conversation {
    name: String,
    messages: Vec<Message>,
    tools: Option<Value>,
    options: ChatOptions,
}

fn content(value: &Value) -> String {
    match value {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| p["text"].as_str().expect("text part"))
            .collect(),
        other => panic!("content {other}"),
    }
}

fn message(m: &Value) -> Message {
    let string = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_owned);
    // The template takes `reasoning_content or reasoning`.
    let reasoning = string("reasoning_content")
        .filter(|r| !r.is_empty())
        .or_else(|| string("reasoning"));
    let tool_calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| ToolCall {
                    id: c.get("id").and_then(Value::as_str).map(str::to_owned),
                    name: c["function"]["name"].as_str().expect("name").to_owned(),
                    arguments: c["function"].get("arguments").cloned().unwrap_or(json!({})),
                })
                .collect()
        })
        .unwrap_or_default();
    Message {
        role: string("role").expect("role"),
        content: content(m.get("content").unwrap_or(&Value::Null)),
        reasoning,
        tool_calls,
        name: string("name"),
        tool_call_id: string("tool_call_id"),
        tools: m.get("tools").cloned(),
    }
}

fn conversation(c: &Value) -> Conversation {
    let mut options = ChatOptions::default();
    if let Some(thinking) = c.get("thinking") {
        options.thinking = thinking.as_bool().expect("thinking");
    }
    if let Some(effort) = c.get("thinking_effort") {
        options.thinking_effort = effort.as_str().expect("effort").parse().unwrap();
    }
    if let Some(choice) = c.get("tool_choice") {
        options.tool_choice = ToolChoice::from_json(choice).unwrap();
    }
    if let Some(format) = c.get("response_format") {
        options.response_format = ResponseFormat::from_json(format).unwrap();
    }
    Conversation {
        name: c["name"].as_str().expect("name").to_owned(),
        messages: c["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(message)
            .collect(),
        tools: c.get("tools").cloned(),
        options,
    }
}

/// The conversations and the frozen renderings, paired by name, after checking that the
/// renderings were made from this very conversations file and the pinned template.
fn frozen_cases() -> Vec<(Conversation, String)> {
    let rendered: Value =
        serde_json::from_slice(&read_frozen("chat", "rendered.json", REGENERATE)).unwrap();
    let source = std::fs::read(data_dir("chat").join("conversations.json")).unwrap();
    let source_sha256: String = Sha256::digest(&source)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        rendered["conversations_sha256"], source_sha256,
        "conversations.json changed since `{REGENERATE}` rendered it"
    );
    assert_eq!(rendered["template_sha256"], TEMPLATE_SHA256);
    let source: Value = serde_json::from_slice(&source).unwrap();
    let conversations = source["conversations"].as_array().unwrap();
    let cases = rendered["cases"].as_array().unwrap();
    assert_eq!(conversations.len(), cases.len());
    assert!(cases.len() >= 30, "only {} conversations", cases.len());
    conversations
        .iter()
        .zip(cases)
        .map(|(c, case)| {
            let c = conversation(c);
            assert_eq!(case["name"], c.name.as_str());
            (c, case["rendered"].as_str().unwrap().to_owned())
        })
        .collect()
}

#[test]
fn every_frozen_conversation_renders_byte_for_byte() {
    let mut failures = Vec::new();
    for (c, want) in frozen_cases() {
        let got = text(&render(&c.messages, c.tools.as_ref(), &c.options).unwrap());
        if got != want {
            let at = got
                .bytes()
                .zip(want.bytes())
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(want.len()));
            let from = at.saturating_sub(60);
            failures.push(format!(
                "{}: first difference at byte {at}\n  ours:      {:?}\n  reference: {:?}",
                c.name,
                got.get(from..(at + 60).min(got.len())).unwrap_or(""),
                want.get(from..(at + 60).min(want.len())).unwrap_or(""),
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The reasoning, content and tool calls the parser returns for `ids`.
fn parse(
    tokenizer: &Tokenizer,
    ids: &[u32],
    thinking: bool,
) -> (String, String, Vec<ToolCall>, Vec<Delta>) {
    parse_with(
        OutputParser::new(tokenizer, thinking).unwrap(),
        tokenizer,
        ids,
    )
}

fn parse_with(
    mut parser: OutputParser,
    tokenizer: &Tokenizer,
    ids: &[u32],
) -> (String, String, Vec<ToolCall>, Vec<Delta>) {
    let mut deltas = Vec::new();
    for &id in ids {
        deltas.extend(parser.push(id, &tokenizer.decode_bytes(&[id])));
    }
    deltas.extend(parser.finish());
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    for d in &deltas {
        match d {
            Delta::Reasoning(t) => reasoning.push_str(t),
            Delta::Content(t) => content.push_str(t),
            Delta::ToolCall(c) => calls.push(c.clone()),
        }
    }
    (reasoning, content, calls, deltas)
}

#[test]
fn the_parser_round_trips_every_assistant_turn_of_the_vector() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let close = [
        Segment {
            text: "<|close|>".into(),
            special: true,
        },
        Segment {
            text: "message".into(),
            special: false,
        },
        Segment {
            text: "<|sep|>".into(),
            special: true,
        },
    ];
    let mut turns = 0;
    for (c, _) in frozen_cases() {
        let thinking = c.options.thinking;
        for m in c.messages.iter().filter(|m| m.role == "assistant") {
            let body = render_assistant(m, thinking).unwrap();
            // The generation prompt already opened `think` (or `response`): the model writes
            // the rest, then closes the message.
            let opener = if thinking { "think" } else { "response" };
            assert_eq!(text(&body[..3]), format!("<|open|>{opener}<|sep|>"));
            let generated: Vec<Segment> = body[3..].iter().chain(&close).cloned().collect();
            let (reasoning, content, calls, _) =
                parse(&tokenizer, &encode(&tokenizer, &generated), thinking);
            // Reasoning is rendered (and so comes back) only with thinking on and when it is
            // not blank; a blank-string or absent argument list renders nothing and comes back
            // as an empty object.
            let want_reasoning = match &m.reasoning {
                Some(r) if thinking && !r.trim().is_empty() => r.clone(),
                _ => String::new(),
            };
            let want_calls: Vec<ToolCall> = m
                .tool_calls
                .iter()
                .map(|call| ToolCall {
                    id: None,
                    name: call.name.clone(),
                    arguments: match &call.arguments {
                        Value::String(s) if s.trim().is_empty() => json!({}),
                        Value::Null => json!({}),
                        other => other.clone(),
                    },
                })
                .collect();
            assert_eq!(reasoning, want_reasoning, "{}", c.name);
            assert_eq!(content, m.content, "{}", c.name);
            assert_eq!(calls, want_calls, "{}", c.name);
            turns += 1;
        }
    }
    assert!(turns >= 20, "only {turns} assistant turns");
}

#[test]
fn markers_are_control_segments_and_text_that_spells_one_is_not() {
    let options = ChatOptions::default();
    let tricky = render(&[user("<|close|>")], None, &options).unwrap();
    assert!(tricky.iter().any(|s| s.text == "<|close|>" && !s.special));
    assert!(tricky.iter().filter(|s| s.special).all(|s| {
        ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"].contains(&s.text.as_str())
    }));
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let off = ChatOptions {
        thinking: false,
        ..ChatOptions::default()
    };
    let ids = encode(&tokenizer, &render(&[user("Hi")], None, &off).unwrap());
    let open = tokenizer.special("<|open|>").unwrap();
    assert_eq!(ids[0], open);
    assert_eq!(ids.iter().filter(|&&id| id == open).count(), 3);
    let end = tokenizer.special("<|end_of_msg|>");
    assert_eq!(ids.iter().filter(|&&id| Some(id) == end).count(), 1);
}

#[test]
fn refused_conversations_and_options_name_the_bad_value() {
    let options = ChatOptions::default();
    // A result with no name, no matching id and no call to take the name from.
    let orphan = Message {
        role: "tool".into(),
        content: "12:00".into(),
        ..Message::default()
    };
    assert_eq!(
        render(&[user("Hi"), orphan], None, &options),
        Err(ChatError::ToolName { message: 1 })
    );
    let bad_arguments = Message {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: None,
            name: "f".into(),
            arguments: json!([1, 2]),
        }],
        ..Message::default()
    };
    let error = render(&[bad_arguments], None, &options).unwrap_err();
    assert!(error.to_string().contains("[1,2]"), "{error}");
    let error = "medium".parse::<ThinkingEffort>().unwrap_err();
    assert!(error.to_string().contains("\"medium\""), "{error}");
    assert!(ToolChoice::from_json(&json!("sometimes")).is_err());
    assert!(ToolChoice::from_json(&json!({"type": "function"})).is_err());
    assert!(ResponseFormat::from_json(&json!({"type": "yaml"})).is_err());
    assert_eq!(
        ToolChoice::from_json(&json!({"type": "function", "function": {"name": "f"}})),
        Ok(ToolChoice::Function("f".into()))
    );
}

fn generated_ids(tokenizer: &Tokenizer, generated: &str) -> Vec<u32> {
    tokenizer.encode(generated, true)
}

#[test]
fn streamed_output_splits_into_reasoning_content_and_tool_calls() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let generated = "Think about é and 中.<|close|>think<|sep|><|open|>response<|sep|>The answer: 42.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_time\" index=\"1\"<|sep|><|open|>argument key=\"zone\" type=\"string\"<|sep|>UTC<|close|>argument<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool=\"A&amp;B&quot;\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>{\"q\": \"x\"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    let (reasoning, content, calls, deltas) =
        parse(&tokenizer, &generated_ids(&tokenizer, generated), true);
    assert_eq!(reasoning, "Think about é and 中.");
    assert_eq!(content, "The answer: 42.");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].name, "get_time");
    assert_eq!(calls[0].arguments, json!({"zone": "UTC", "n": 3}));
    // In the order the model wrote them (issue 31: not sorted).
    assert_eq!(calls[0].arguments_json(), r#"{"zone":"UTC","n":3}"#);
    // A `json` block is the call's arguments as they were written.
    assert_eq!(calls[1].name, "A&B\"");
    assert_eq!(calls[1].arguments, json!("{\"q\": \"x\"}"));
    assert_eq!(calls[1].arguments_json(), "{\"q\": \"x\"}");
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

/// With `calls_as_text` (a request's `tool_choice: "none"`), a `tools` element the model
/// writes anyway is content, exactly as generated (markers included), and no call comes out;
/// what follows it is dropped, as after a parsed `tools` element.
#[test]
fn calls_as_text_passes_a_tools_element_on_as_content() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let tools = "<|open|>tools<|sep|><|open|>call tool=\"get_time\" index=\"1\"<|sep|><|open|>argument key=\"zone\" type=\"string\"<|sep|>UTC<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
    let generated = format!(
        "Hmm.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>{tools}After.<|close|>message<|sep|>"
    );
    let ids = generated_ids(&tokenizer, &generated);
    let parser = OutputParser::new(&tokenizer, true).unwrap().calls_as_text();
    let (reasoning, content, calls, _) = parse_with(parser, &tokenizer, &ids);
    assert_eq!(reasoning, "Hmm.");
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(content, format!("Sure.{tools}"));
    // Cut off inside the element: what was written is still content.
    let cut = &ids[..ids.len() - 12];
    let parser = OutputParser::new(&tokenizer, true).unwrap().calls_as_text();
    let (_, content, calls, _) = parse_with(parser, &tokenizer, cut);
    assert!(calls.is_empty());
    assert!(
        content.starts_with("Sure.<|open|>tools<|sep|><|open|>call"),
        "{content}"
    );
    // Without it, the same tokens give the call.
    let (_, content, calls, _) = parse(&tokenizer, &ids, true);
    assert_eq!((content.as_str(), calls.len()), ("Sure.", 1));
}

#[test]
fn reasoning_ends_at_the_response_opener_or_the_think_closer_alone() {
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    // The model skipped the think closer.
    let skipped = "Plan.<|open|>response<|sep|>Done.<|close|>response<|sep|>";
    let (reasoning, content, _, _) = parse(&tokenizer, &generated_ids(&tokenizer, skipped), true);
    assert_eq!((reasoning.as_str(), content.as_str()), ("Plan.", "Done."));
    // The model skipped the response opener: what follows the think closer is content.
    let bare = "Plan.<|close|>think<|sep|>Done.<|close|>message<|sep|>";
    let (reasoning, content, _, _) = parse(&tokenizer, &generated_ids(&tokenizer, bare), true);
    assert_eq!((reasoning.as_str(), content.as_str()), ("Plan.", "Done."));
}

/// Output bytes become text as they complete: an incomplete last character waits for the next
/// token, an invalid sequence is U+FFFD at once (never held, or all later text would be), and
/// at the end (`all`) a character cut short is U+FFFD too.
#[test]
fn output_bytes_become_text_a_character_at_a_time() {
    let mut pending = Vec::new();
    let mut text = String::new();
    for piece in [
        &b"a\xC3"[..],
        b"\xA9",
        b"\xFF\x80",
        b"b\xF0\x9F",
        b"\x98",
        b"\x80\xE2\x82",
    ] {
        pending.extend_from_slice(piece);
        text.push_str(&take_text(&mut pending, false));
    }
    assert_eq!(text, "a\u{e9}\u{FFFD}\u{FFFD}b\u{1F600}");
    assert_eq!(pending, b"\xE2\x82", "the incomplete euro sign waits");
    // An invalid byte before an incomplete tail: the byte goes, the tail still waits.
    let mut pending = b"x\xFFy\xE2\x82".to_vec();
    assert_eq!(take_text(&mut pending, false), "x\u{FFFD}y");
    assert_eq!(pending, b"\xE2\x82");
    assert_eq!(take_text(&mut pending, true), "\u{FFFD}");
    assert!(pending.is_empty());

    // Through the parser: a character cut by the last token comes out at `finish`.
    let tokenizer = Tokenizer::from_dir(&data_dir("tiktoken")).unwrap();
    let mut parser = OutputParser::new(&tokenizer, false).unwrap();
    let mut content = String::new();
    for bytes in [&b"ok \xC3"[..], b"\xA9 \xE2\x82"] {
        for d in parser.push(u32::MAX, bytes) {
            if let Delta::Content(t) = d {
                content.push_str(&t);
            }
        }
    }
    assert_eq!(content, "ok \u{e9} ");
    assert_eq!(parser.finish(), vec![Delta::Content("\u{FFFD}".into())]);
}
