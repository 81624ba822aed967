//! Tool calls end to end, with the model's answer scripted (the random `tiny` model never
//! writes a call by itself; `EngineConfig::scripted_answers` forces one, token by token,
//! through the real engine, output parser and prompt cache):
//! - a call's argument keys keep the model's order from the generated tokens, through the
//!   answer's JSON, back into the next turn's rendering, so the next turn resumes from the
//!   answer's own snapshot (before, the keys came back sorted, the re-rendered call differed
//!   from what the model wrote, and the turn resumed from the end of the previous prompt);
//! - under `tool_choice: "none"` a call the model makes anyway comes back as content text,
//!   never as a tool call (before, it came back as a call).

use k3_model::chat::{Message, Segment, ToolCall, encode, render_assistant};
use k3_model::tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::{PLAIN, cached_tokens, call, limits, prompt_tokens, server_with, tiny, warm_options};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "search", "description": "Web search.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "count": {"type": "integer"}}}}}])
}

fn messages() -> Value {
    json!([{"role": "system", "content": "Use the tools when they help."},
           {"role": "user", "content": "What is the weather in Oslo?"}])
}

fn body(messages: Value, tool_choice: Option<&str>) -> Value {
    let mut body = json!({"model": "tiny", "messages": messages, "tools": tools(),
                          "max_tokens": 200, "temperature": 0});
    if let Some(choice) = tool_choice {
        body["tool_choice"] = json!(choice);
    }
    body
}

/// The prompt tokens the server gives `body`.
fn prompt_ids(tokenizer: &Tokenizer, body: &Value) -> Vec<u32> {
    let valid = k3_serve::api::ChatRequest::from_json(body)
        .unwrap()
        .validate(&limits())
        .unwrap();
    let segments = k3_serve::engine::prompt_segments(&valid.prompt);
    k3_serve::engine::encode_segments(tokenizer, &segments)
}

/// The call the script makes: its keys deliberately not in sorted order.
fn the_call() -> ToolCall {
    let arguments: Value =
        serde_json::from_str(r#"{"query": "Oslo weather", "count": 3}"#).unwrap();
    ToolCall {
        id: None,
        name: "search".into(),
        arguments,
    }
}

/// The tokens of an assistant turn that reasons, then calls [`the_call`], as the model writes
/// them after the generation prompt (which opened `think`): the template's own rendering of
/// that message without its `think` opener, then the message's close and `<|end_of_msg|>`.
fn scripted_answer(tokenizer: &Tokenizer) -> Vec<u32> {
    let message = Message {
        role: "assistant".into(),
        reasoning: Some("I should look it up.".into()),
        tool_calls: vec![the_call()],
        ..Message::default()
    };
    let segments = render_assistant(&message, true).unwrap();
    let opener = segments
        .iter()
        .position(|s| s.special && s.text == "<|sep|>")
        .unwrap();
    let special = |text: &str| Segment {
        text: text.into(),
        special: true,
    };
    let mut answer: Vec<Segment> = segments[opener + 1..].to_vec();
    answer.extend([
        special("<|close|>"),
        Segment {
            text: "message".into(),
            special: false,
        },
        special("<|sep|>"),
        special("<|end_of_msg|>"),
    ]);
    encode(tokenizer, &answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_keeps_its_key_order_and_the_next_turn_resumes_from_the_answer() {
    let tokenizer = Tokenizer::from_dir(&tiny()).unwrap();
    let first = body(messages(), None);
    let prompt = prompt_ids(&tokenizer, &first);
    let answer = scripted_answer(&tokenizer);
    let state = server_with(
        tiny(),
        PLAIN,
        warm_options(),
        vec![(prompt.clone(), answer.clone())],
    );
    let (status, text) = call(&state, "/v1/chat/completions", Some(first)).await;
    assert_eq!(status.as_u16(), 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{reply}");
    // The keys in the model's order, not sorted.
    let arguments = calls[0]["function"]["arguments"].as_str().unwrap();
    assert_eq!(arguments, r#"{"query":"Oslo weather","count":3}"#);
    assert_eq!(reply["usage"]["completion_tokens"], answer.len());

    // The client sends the answer back as it got it, with the tool's result.
    let mut next = messages();
    let list = next.as_array_mut().unwrap();
    list.push(
        json!({"role": "assistant", "content": choice["message"]["content"],
                     "reasoning_content": choice["message"]["reasoning_content"],
                     "tool_calls": calls}),
    );
    list.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "Rain, 4 C."}));
    let second = body(next, None);
    let second_ids = prompt_ids(&tokenizer, &second);
    // The rendering of the call is the generated tokens, byte for byte.
    assert_eq!(&second_ids[..prompt.len()], &prompt[..]);
    assert_eq!(
        &second_ids[prompt.len()..prompt.len() + answer.len()],
        &answer[..]
    );
    let (status, text) = call(&state, "/v1/chat/completions", Some(second)).await;
    assert_eq!(status.as_u16(), 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    // Resumed from the end of the answer: the prompt and every answer token but the last
    // (the session's state after the tokens it consumed).
    assert_eq!(
        cached_tokens(&reply) as usize,
        prompt.len() + answer.len() - 1,
        "{reply}"
    );
    assert_eq!(prompt_tokens(&reply) as usize, second_ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_tool_choice_none_a_call_comes_back_as_content() {
    let tokenizer = Tokenizer::from_dir(&tiny()).unwrap();
    let request = body(messages(), Some("none"));
    let prompt = prompt_ids(&tokenizer, &request);
    let answer = scripted_answer(&tokenizer);
    let state = server_with(tiny(), PLAIN, warm_options(), vec![(prompt, answer)]);
    let (status, text) = call(&state, "/v1/chat/completions", Some(request.clone())).await;
    assert_eq!(status.as_u16(), 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{reply}");
    assert!(choice["message"].get("tool_calls").is_none(), "{reply}");
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(
        content.starts_with("<|open|>tools<|sep|><|open|>call tool=\"search\" index=\"1\"<|sep|>"),
        "{content}"
    );
    assert!(content.contains("Oslo weather"), "{content}");
    assert!(content.ends_with("<|close|>tools<|sep|>"), "{content}");
    assert_eq!(
        choice["message"]["reasoning_content"],
        "I should look it up."
    );

    // Streamed: no chunk carries a tool call either.
    let mut streamed = request;
    streamed["stream"] = json!(true);
    let (status, text) = call(&state, "/v1/chat/completions", Some(streamed)).await;
    assert_eq!(status.as_u16(), 200, "{text}");
    let mut joined = String::new();
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        assert!(delta.get("tool_calls").is_none(), "{chunk}");
        joined.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!(joined, content);
}
