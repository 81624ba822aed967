//! Request validation as OpenAI does it (issue 31): a field of the wrong type or out of range
//! is a 400 naming it, fields the server does not read are listed (a warning and the
//! `X-Ignored-Fields` header) instead of dropped silently, the JSON response formats are
//! refused until decoding can be constrained, and completions' log-probabilities come in the
//! completions API's shape (`tokens`, `token_logprobs`, `top_logprobs` maps, `text_offset`).

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_serve::server::{AppState, app};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::router::{call, chat_body, error_of, state};

/// Checks a completions `logprobs` object: `n` tokens, each with its log-probability, a map of
/// at most `top + 1` alternatives that holds the chosen token with the same log-probability,
/// and character offsets that advance by each token's text.
pub(crate) fn assert_completion_logprobs(logprobs: &Value, n: usize, top: usize) {
    let tokens = logprobs["tokens"].as_array().expect("tokens");
    let token_logprobs = logprobs["token_logprobs"]
        .as_array()
        .expect("token_logprobs");
    let tops = logprobs["top_logprobs"].as_array().expect("top_logprobs");
    let offsets = logprobs["text_offset"].as_array().expect("text_offset");
    assert_eq!(tokens.len(), n, "{logprobs}");
    assert_eq!(
        (token_logprobs.len(), tops.len(), offsets.len()),
        (n, n, n),
        "{logprobs}"
    );
    assert!(
        logprobs.get("content").is_none(),
        "not chat-shaped: {logprobs}"
    );
    let mut offset = offsets[0].as_u64().unwrap();
    for i in 0..n {
        let token = tokens[i].as_str().unwrap();
        let lp = token_logprobs[i].as_f64().unwrap();
        assert!(lp <= 0.0, "{logprobs}");
        let map = tops[i]
            .as_object()
            .expect("a map from token text to logprob");
        assert!(map.len() <= top + 1 && !map.is_empty(), "{logprobs}");
        assert_eq!(
            map[token].as_f64(),
            Some(lp),
            "the chosen token is in its map"
        );
        // Highest first.
        let values: Vec<f64> = map.values().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(offsets[i].as_u64(), Some(offset), "{logprobs}");
        offset += token.chars().count() as u64;
        if top > 0 {
            assert!(
                values[0] >= lp,
                "the first alternative is the most likely: {logprobs}"
            );
        }
    }
}

async fn post(state: &AppState, uri: &str, body: Value) -> (StatusCode, String) {
    call(state, "POST", uri, Some(body.to_string())).await
}

/// Every malformed field of the outside probe is a 400 naming the field, with OpenAI's error
/// object; before, each was answered 200 (or 422 without the field's name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_types_and_ranges_are_400s_naming_the_field() {
    let s = state(8, 4, 512);
    let chat = |extra: Value| -> Value { serde_json::from_str(&chat_body(extra)).unwrap() };
    let chat_cases = [
        (json!({"tools": [{}]}), "tools[0].type"),
        (json!({"tools": [1]}), "tools[0]"),
        (json!({"tools": [{"type": "nope"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tools": {"type": "function"}}), "tools"),
        (json!({"chat_template_kwargs": "x"}), "chat_template_kwargs"),
        (
            json!({"chat_template_kwargs": {"thinking": "x"}}),
            "chat_template_kwargs.thinking",
        ),
        (
            json!({"chat_template_kwargs": {"thinking": 0}}),
            "chat_template_kwargs.thinking",
        ),
        (json!({"logprobs": 1e308}), "logprobs"),
        (json!({"logprobs": 1}), "logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"max_tokens": 1.5}), "max_tokens"),
        (json!({"cache_salt": ""}), "cache_salt"),
        (json!({"cache_salt": 7}), "cache_salt"),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}),
            "response_format",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "system", "content": "s", "tools": [{"type": "x"}]},
                                {"role": "user", "content": "u"}]}),
            "messages[0].tools[0].type",
        ),
    ];
    for (extra, param) in chat_cases {
        let (status, text) = post(&s, "/v1/chat/completions", chat(extra.clone())).await;
        assert_eq!(
            error_of(status, &text),
            (400, json!(param), json!("invalid_request_error")),
            "{extra}: {text}"
        );
    }
    for logprobs in [
        json!(-1),
        json!(21),
        json!(6),
        json!(1.5),
        json!(true),
        json!(1e9),
    ] {
        let body = json!({"prompt": "Once", "max_tokens": 2, "logprobs": logprobs});
        let (status, text) = post(&s, "/v1/completions", body).await;
        assert_eq!(
            error_of(status, &text),
            (400, json!("logprobs"), json!("invalid_request_error")),
            "logprobs {logprobs}: {text}"
        );
    }
    // The edges that are fine.
    for extra in [
        json!({"chat_template_kwargs": {"thinking": false}}),
        json!({"chat_template_kwargs": null, "tools": [], "logprobs": false}),
        json!({"logprobs": true, "top_logprobs": 20}),
        json!({"response_format": {"type": "text"}, "cache_salt": "team-a"}),
        json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                          "parameters": {"type": "object"}}}]}),
    ] {
        let (status, text) = post(&s, "/v1/chat/completions", chat(extra.clone())).await;
        assert_eq!(status, StatusCode::OK, "{extra}: {text}");
    }
    for logprobs in [json!(0), json!(5), Value::Null] {
        let body = json!({"prompt": "Once", "max_tokens": 2, "logprobs": logprobs});
        let (status, text) = post(&s, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::OK, "logprobs {logprobs}: {text}");
    }
    // A body that is JSON but not an object.
    let (status, text) = post(&s, "/v1/chat/completions", json!([1, 2])).await;
    assert_eq!(error_of(status, &text).0, 400);
}

/// Fields the server does not read are accepted, and named in `X-Ignored-Fields` (in the
/// body's order); a request without any has no such header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_fields_are_listed_not_dropped_silently() {
    let s = state(8, 4, 512);
    let send = |uri: &'static str, body: Value| {
        let s = s.clone();
        async move {
            let request = Request::builder()
                .method("POST")
                .uri(uri)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap();
            let response = app(s).oneshot(request).await.unwrap();
            let status = response.status();
            let ignored = response
                .headers()
                .get("x-ignored-fields")
                .map(|v| v.to_str().unwrap().to_owned());
            let _ = response.into_body().collect().await.unwrap();
            (status, ignored)
        }
    };
    let mut body: Value = serde_json::from_str(&chat_body(json!({}))).unwrap();
    for (k, v) in [
        ("min_tokens", json!(3)),
        ("service_tier", json!("auto")),
        ("functions", json!([])),
        ("parallel_tool_calls", json!(false)),
        (
            "chat_template_kwargs",
            json!({"thinking": false, "enable_thinking": true}),
        ),
    ] {
        body[k] = v;
    }
    let (status, ignored) = send("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ignored.as_deref(),
        Some(
            "min_tokens, service_tier, functions, parallel_tool_calls, \
             chat_template_kwargs.enable_thinking"
        )
    );
    let (status, ignored) = send(
        "/v1/completions",
        json!({"prompt": "Once", "max_tokens": 2, "top_logprobs": 3, "anything": {}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ignored.as_deref(), Some("top_logprobs, anything"));
    let (status, ignored) = send(
        "/v1/chat/completions",
        json!({"messages": [
        {"role": "user", "content": "Hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!((status, ignored), (StatusCode::OK, None));
}

/// Completions' `logprobs: N` come back in the completions shape, whole and streamed (the
/// streamed chunks' offsets continue each other), never as chat's `content` list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_logprobs_have_the_completions_shape() {
    let s = state(8, 4, 512);
    let body = json!({"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 3});
    let (status, text) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let whole: Value = serde_json::from_str(&text).unwrap();
    let n = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_completion_logprobs(&whole["choices"][0]["logprobs"], n, 3);
    assert_eq!(whole["choices"][0]["logprobs"]["text_offset"][0], 0);

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, text) = post(&s, "/v1/completions", streamed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let logprobs = &chunk["choices"][0]["logprobs"];
        if logprobs.is_null() {
            continue;
        }
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let part = logprobs[key].as_array().unwrap().clone();
            joined[key].as_array_mut().unwrap().extend(part);
        }
    }
    assert_completion_logprobs(&joined, n, 3);
    // Greedy: the stream's tokens are the whole answer's.
    assert_eq!(joined, whole["choices"][0]["logprobs"]);
}

/// A completions prompt of token ids (OpenAI's array of integers) is fed as given: it answers
/// what the text those ids encode answers, token for token and logprob for logprob; an
/// empty array, a list of prompts, a non-integer and an id outside the vocabulary are 400s
/// naming `prompt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_of_token_ids_answers_as_its_text() {
    let s = state(8, 2, 512);
    let text = "The quick brown fox jumps over the lazy dog";
    let ids = s.engine.tokenizer.encode(text, false);
    assert!(ids.len() > 3, "{ids:?}");
    let ask = |prompt: Value| json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3});
    let (status, by_text) = post(&s, "/v1/completions", ask(json!(text))).await;
    assert_eq!(status, StatusCode::OK, "{by_text}");
    let (status, by_ids) = post(&s, "/v1/completions", ask(json!(ids))).await;
    assert_eq!(status, StatusCode::OK, "{by_ids}");
    let (a, b): (Value, Value) = (
        serde_json::from_str(&by_text).unwrap(),
        serde_json::from_str(&by_ids).unwrap(),
    );
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    assert_eq!(b["usage"]["prompt_tokens"], ids.len());
    for (prompt, says) in [
        (json!([]), "empty array"),
        (json!(["a", "b"]), "one prompt per request"),
        (json!([[1, 2]]), "one prompt per request"),
        (json!([1, 2.5]), "prompt[1]"),
        (json!([1, -3]), "prompt[1]"),
        (json!([1, 1024]), "outside the vocabulary of 1024"),
        (json!({"ids": [1]}), "a string or an array of token ids"),
    ] {
        let (status, text) = post(&s, "/v1/completions", ask(prompt.clone())).await;
        let (code, param, _) = error_of(status, &text);
        assert_eq!((code, param), (400, json!("prompt")), "{prompt}: {text}");
        assert!(text.contains(says), "{prompt}: {text}");
    }
}
