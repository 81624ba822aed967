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
