//! The output's text as its tokens' bytes make it: characters split over tokens, invalid
//! bytes and a character cut by the end, in both endpoints, streamed and whole; and bodies
//! sent with a content coding the server does not decode.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_serve::server::app;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::router::{call, error_of, state};

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The concatenated `field` of every chunk of an SSE body, and the last chunk's finish.
fn streamed_text(body: &str, field: &str) -> (String, Value) {
    let mut text = String::new();
    let mut finish = Value::Null;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk = json_of(data);
        let choice = &chunk["choices"][0];
        let piece = match field {
            "text" => &choice["text"],
            _ => &choice["delta"][field],
        };
        text.push_str(piece.as_str().unwrap_or(""));
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    (text, finish)
}

/// `tiny`'s tokens 0-255 are the bytes 0-255: biased to 0xC3 and 0xA9 (the two bytes of
/// "é"), greedy output is a run of them in some order, so characters split over tokens, lone
/// continuation bytes and, where the last token is 0xC3, a character cut by the end. Whatever
/// the order, the text is the tokens' bytes (`logprobs`' `bytes`, joined) decoded with each
/// invalid or cut sequence as U+FFFD, streamed or whole, in both endpoints; before, a
/// completion lost every byte from the first invalid one on, and chat lost a cut character.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_invalid_and_cut_characters_come_out_as_their_bytes_say() {
    let s = state(8, 4, 512);
    let bias = json!({"195": 100, "169": 100});
    for (max_tokens, seed) in [(6, 1), (7, 2), (9, 23)] {
        let base = json!({"prompt": "Once upon", "max_tokens": max_tokens, "seed": seed,
                          "logit_bias": bias, "logprobs": 1});
        let (st, t) = call(&s, "POST", "/v1/completions", Some(base.to_string())).await;
        assert_eq!(st, StatusCode::OK, "{t}");
        let whole = json_of(&t);
        let choice = &whole["choices"][0];
        let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), max_tokens, "{t}");
        let text = choice["text"].as_str().unwrap();
        // Every token's byte is in the text: an "é" for each pair 0xC3 0xA9, U+FFFD for each
        // byte outside one.
        let pairs = text.chars().filter(|&c| c == '\u{e9}').count();
        let lone = text.chars().filter(|&c| c == '\u{FFFD}').count();
        assert_eq!(pairs + lone, text.chars().count(), "{t}");
        assert_eq!(2 * pairs + lone, max_tokens, "{t}");
        // The offsets are character positions inside the text, in order.
        let chars = text.chars().count() as u64;
        let offsets = choice["logprobs"]["text_offset"].as_array().unwrap();
        assert!(
            offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()),
            "{t}"
        );
        assert!(offsets.iter().all(|o| o.as_u64().unwrap() < chars), "{t}");

        let mut streamed = base.clone();
        streamed["stream"] = json!(true);
        let (_, body) = call(&s, "POST", "/v1/completions", Some(streamed.to_string())).await;
        let (stream_text, finish) = streamed_text(&body, "text");
        assert_eq!((stream_text.as_str(), finish), (text, json!("length")));

        // Chat, with the same bias: its `bytes` joined decode to its content.
        let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": max_tokens, "seed": seed, "logit_bias": bias,
                          "logprobs": true, "chat_template_kwargs": {"thinking": false}});
        let (st, t) = call(&s, "POST", "/v1/chat/completions", Some(chat.to_string())).await;
        assert_eq!(st, StatusCode::OK, "{t}");
        let whole = json_of(&t);
        let choice = &whole["choices"][0];
        let entries = choice["logprobs"]["content"].as_array().unwrap();
        let bytes: Vec<u8> = entries
            .iter()
            .flat_map(|e| e["bytes"].as_array().unwrap().clone())
            .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
            .collect();
        assert_eq!(bytes.len(), max_tokens, "one byte a token: {t}");
        let content = choice["message"]["content"].as_str().unwrap();
        assert_eq!(content, String::from_utf8_lossy(&bytes), "{t}");
        let mut streamed = chat.clone();
        streamed["stream"] = json!(true);
        let (_, body) = call(
            &s,
            "POST",
            "/v1/chat/completions",
            Some(streamed.to_string()),
        )
        .await;
        assert_eq!(streamed_text(&body, "content").0, content);
    }
}

/// A body sent compressed is refused with 415 (and `Accept-Encoding: identity`), not read as
/// broken JSON, nor a plain body under a compressed label read as if it were plain; an
/// `identity` coding is no coding. A transfer coding other than chunked is a 501.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_body_is_refused_as_an_unsupported_coding() {
    let s = state(8, 4, 512);
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    for (coding, expected) in [
        (Some(("content-encoding", "gzip")), 415),
        (Some(("content-encoding", "identity, br")), 415),
        (Some(("content-encoding", "identity")), 200),
        (Some(("transfer-encoding", "gzip, chunked")), 501),
        (Some(("transfer-encoding", "chunked")), 200),
        (None, 200),
    ] {
        for uri in ["/v1/completions", "/v1/chat/completions"] {
            let body = match uri {
                "/v1/completions" => body.clone(),
                _ => json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                    .to_string(),
            };
            let mut request = Request::builder()
                .method("POST")
                .uri(uri)
                .header("content-type", "application/json");
            if let Some((name, coding)) = coding {
                request = request.header(name, coding);
            }
            let response = app(s.clone())
                .oneshot(request.body(Body::from(body)).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let accept = response.headers().get("accept-encoding").cloned();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            let text = String::from_utf8_lossy(&bytes);
            assert_eq!(status.as_u16(), expected, "{coding:?} {uri}: {text}");
            if expected == 415 {
                assert_eq!(error_of(status, &text).0, 415);
                assert!(text.contains("Content-Encoding"), "{text}");
                assert_eq!(accept.unwrap(), "identity");
            } else if expected == 501 {
                assert_eq!(error_of(status, &text).0, 501);
                assert!(text.contains("Transfer-Encoding gzip"), "{text}");
            }
        }
    }
}
