//! Tests of `answer.rs`.

use super::*;
use axum::response::IntoResponse;
use axum::response::sse::Sse;
use http_body_util::BodyExt;

fn delta(text: &str) -> Event {
    Event::Delta {
        reasoning: String::new(),
        content: text.into(),
        tool_calls: Vec::new(),
        logprobs: Vec::new(),
    }
}

/// A job whose channel closes before its finish (the engine went away) is an error, in a
/// whole answer and in a stream, never a normal "stop".
#[tokio::test]
async fn a_job_dropped_unfinished_is_an_error() {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(delta("partial")).unwrap();
    drop(tx);
    let error = collect(rx).await.unwrap_err();
    assert_eq!(error.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error.message, ENGINE_GONE);

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(delta("partial")).unwrap();
    drop(tx);
    let chunks = Chunks::new(rx, "id".into(), "m".into(), 0, false, false, false);
    let body = Sse::new(chunks).into_response().into_body();
    let text = String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 3, "{text}");
    assert!(data[0].contains("partial"));
    let error: Value = serde_json::from_str(data[1]).unwrap();
    assert_eq!(error["error"]["message"], ENGINE_GONE);
    assert_eq!(data[2], "[DONE]");
}

/// The `data:` payloads of `chunks` streamed to the end.
async fn streamed(chunks: Chunks) -> Vec<Value> {
    let body = Sse::new(chunks).into_response().into_body();
    let text = String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn done(reason: &'static str) -> Event {
    Event::Done {
        finish_reason: reason,
        prompt_tokens: 3,
        completion_tokens: 2,
        cached_tokens: 0,
        prefill: std::time::Duration::ZERO,
        decode: std::time::Duration::ZERO,
        passes: 1,
    }
}

/// An answer that made a tool call and ended on its own finishes with `tool_calls`, streamed
/// as whole (a client's agent loop waits for it); cut by `max_tokens` it stays `length`; with
/// no call, `stop`.
#[tokio::test]
async fn a_tool_call_finishes_the_same_streamed_or_whole() {
    let call = Event::Delta {
        reasoning: String::new(),
        content: String::new(),
        tool_calls: vec![k3_model::chat::ToolCall {
            id: None,
            name: "noargs".into(),
            arguments: json!({}),
        }],
        logprobs: Vec::new(),
    };
    for (events, expected) in [
        (vec![call.clone(), done("stop")], "tool_calls"),
        (
            vec![delta("x"), call.clone(), delta(""), done("stop")],
            "tool_calls",
        ),
        (vec![call.clone(), done("length")], "length"),
        (vec![delta("x"), done("stop")], "stop"),
    ] {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in &events {
            tx.send(e.clone()).unwrap();
        }
        drop(tx);
        let whole = collect(rx).await.unwrap().body("id", "m", 0, true, false);
        assert_eq!(whole["choices"][0]["finish_reason"], expected, "{events:?}");

        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        drop(tx);
        let chunks = streamed(Chunks::new(
            rx,
            "id".into(),
            "m".into(),
            0,
            true,
            false,
            false,
        ))
        .await;
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], expected, "{chunks:?}");
    }
}

fn token(bytes: &[u8]) -> TokenLogprob {
    TokenLogprob {
        token: String::from_utf8_lossy(bytes).into_owned(),
        bytes: bytes.to_vec(),
        logprob: -1.0,
        top: Vec::new(),
    }
}

/// Completions' `text_offset`s index the completion's text: a character split over tokens
/// counts once (its tokens all begin where it does), an invalid byte is one U+FFFD; chat's
/// `bytes` are the tokens' own, which joined give the text's UTF-8.
#[test]
fn offsets_and_bytes_follow_the_text_not_each_tokens_own_decoding() {
    // "aé" + an invalid byte + "b" + "😀" split over 3 tokens + "c".
    let tokens = [
        token(b"a"),
        token(&[0xC3]),
        token(&[0xA9]),
        token(&[0xFF]),
        token(b"b"),
        token(&[0xF0, 0x9F]),
        token(&[0x98]),
        token(&[0x80, b'c']),
    ];
    let text = "aé\u{FFFD}b😀c";
    let v = logprobs_json(&tokens, false, &mut TextOffset::default());
    assert_eq!(v["text_offset"], json!([0, 1, 1, 2, 3, 4, 4, 4]), "{v}");
    // Each offset is a character boundary of the text, and the text after it starts with
    // what that token completes.
    let chars: Vec<char> = text.chars().collect();
    assert_eq!(chars[3], 'b');
    // Split across calls (a stream's events), the offsets are the same.
    let mut offset = TextOffset::default();
    let first = logprobs_json(&tokens[..2], false, &mut offset);
    let rest = logprobs_json(&tokens[2..], false, &mut offset);
    let mut joined = first["text_offset"].as_array().unwrap().clone();
    joined.extend(rest["text_offset"].as_array().unwrap().iter().cloned());
    assert_eq!(Value::Array(joined), v["text_offset"]);

    let chat = logprobs_json(&tokens, true, &mut TextOffset::default());
    let bytes: Vec<u8> = chat["content"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&bytes), text);
    assert_eq!(chat["content"][1]["token"], "\u{FFFD}");
    assert_eq!(chat["content"][1]["bytes"], json!([0xC3]));
}
