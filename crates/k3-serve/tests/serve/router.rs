//! The router through `tower::ServiceExt::oneshot`: endpoints and every error class.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_model::builder::EngineOptions;
use k3_model::experts::ExpertOptions;
use k3_serve::api::Limits;
use k3_serve::api::MAX_STOP_BYTES;
use k3_serve::engine::{EngineConfig, spawn, wait_ready};
use k3_serve::server::{AppState, MAX_BODY, app};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::validation::assert_completion_logprobs;

pub(crate) fn state(queue: usize, max_batch: usize, context: usize) -> AppState {
    let experts = ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    };
    state_on(crate::tiny(), experts, queue, max_batch, context)
}

fn state_on(
    model_dir: std::path::PathBuf,
    experts: ExpertOptions,
    queue: usize,
    max_batch: usize,
    context: usize,
) -> AppState {
    let state = state_unready(
        config(model_dir, experts, queue, max_batch, context),
        context,
    );
    assert!(wait_ready(&state.engine, Duration::from_secs(60)));
    state
}

pub(crate) fn config(
    model_dir: std::path::PathBuf,
    experts: ExpertOptions,
    queue: usize,
    max_batch: usize,
    context: usize,
) -> EngineConfig {
    EngineConfig {
        model_dir,
        options: EngineOptions {
            pool: numa_sched::PoolOptions {
                threads: Some(1),
                ..Default::default()
            },
            experts,
            max_batch,
            ctx: context,
            ..EngineOptions::default()
        },
        queue,
        step_tokens: 8,
        prompt_cache: Default::default(),
        panic_on_prompt: None,
        scripted_answers: Vec::new(),
        hold_load: false,
        max_mask: std::time::Duration::from_millis(200),
        spec: Default::default(),
    }
}

/// The state over an engine that may still be loading (or have failed to).
pub(crate) fn state_unready(config: EngineConfig, context: usize) -> AppState {
    let (engine, _thread) = spawn(config).unwrap();
    AppState {
        engine,
        responses: Default::default(),
        limits: Arc::new(Limits {
            model_names: vec!["tiny".into()],
            max_tokens_default: 16,
            context,
            thinking_effort: k3_model::chat::ThinkingEffort::Max,
            thinking: true,
            vocab_size: 1024,
            max_compile: std::time::Duration::from_secs(2),
            max_mask: std::time::Duration::from_millis(200),
            created: 1_700_000_000,
        }),
    }
}

pub(crate) async fn call(
    state: &AppState,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> (StatusCode, String) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, Body::from))
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

pub(crate) fn chat_body(extra: Value) -> String {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

/// `(status, error.param, error.type)` of an error answer.
pub(crate) fn error_of(status: StatusCode, text: &str) -> (u16, Value, Value) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{text}"
    );
    (
        status.as_u16(),
        v["error"]["param"].clone(),
        v["error"]["type"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_answer() {
    let s = state(8, 4, 512);
    let (status, text) = call(&s, "GET", "/health", None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (_, text) = call(&s, "GET", "/v1/models", None).await;
    let models: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(
        models["data"][0]["created"], 1_700_000_000,
        "Limits::created"
    );

    let (status, text) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let usage = &v["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 6);
    let reason = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(
        ["length", "stop", "tool_calls"].contains(&reason),
        "{reason}"
    );

    // The same request again: greedy decoding gives the same answer.
    let (_, again) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["choices"], v["choices"]);

    let body = json!({"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "temperature": 0.7, "seed": 3, "logprobs": 2});
    let (status, text) = call(&s, "POST", "/v1/completions", Some(body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_completion_logprobs(&v["choices"][0]["logprobs"], 5, 2);

    // Streaming: SSE chunks, the last data line [DONE].
    let (status, text) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({"stream": true}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let first: Value = serde_json::from_str(data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let done: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert!(done["choices"][0]["finish_reason"].is_string(), "{done}");

    let (status, text) = call(&s, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    for name in [
        "k3_requests_admitted_total 4",
        "k3_generated_tokens_total",
        "k3_queue_depth",
        "k3_expert_cache_hits_total",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_class_has_its_status_and_body() {
    let s = state(8, 4, 512);
    let post = |body: String| call(&s, "POST", "/v1/chat/completions", Some(body));
    let (st, t) = post("{not json".into()).await;
    assert_eq!(error_of(st, &t).0, 400);
    let (st, t) = post(json!({"messages": 5}).to_string()).await;
    assert_eq!(
        error_of(st, &t),
        (400, json!("messages"), json!("invalid_request_error"))
    );
    let (st, t) = post(chat_body(json!({"model": "other"}))).await;
    assert_eq!(
        error_of(st, &t),
        (404, json!("model"), json!("not_found_error"))
    );
    let (st, t) = post(chat_body(json!({"max_tokens": 0}))).await;
    assert_eq!(
        error_of(st, &t),
        (400, json!("max_tokens"), json!("invalid_request_error"))
    );
    let (st, t) = post(chat_body(json!({"temperature": 5.0}))).await;
    assert_eq!(error_of(st, &t).1, "temperature");
    let (st, t) = post(chat_body(json!({"top_p": 0}))).await;
    assert_eq!(error_of(st, &t).1, "top_p");
    let (st, t) = post(chat_body(json!({"max_tokens": 511}))).await;
    let (code, param, _) = error_of(st, &t);
    assert_eq!((code, param), (400, json!("max_tokens")));
    assert!(t.contains("exceeds the context"), "{t}");
    let (st, t) = post(json!({"messages": []}).to_string()).await;
    assert_eq!(error_of(st, &t).1, "messages");
    let (st, t) = post(chat_body(
        json!({"messages": [{"role": "wizard", "content": "x"}]}),
    ))
    .await;
    assert_eq!(error_of(st, &t).0, 400);
    let huge = format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
        "a".repeat(MAX_BODY + 10)
    );
    let (st, t) = post(huge).await;
    assert_eq!(error_of(st, &t).0, 413);
    let (st, t) = call(&s, "GET", "/v1/nothing", None).await;
    assert_eq!(error_of(st, &t).0, 404);
    // Not ready: 503 from the health check and from generation.
    s.engine.ready.store(false, Ordering::Release);
    let (st, t) = call(&s, "GET", "/health", None).await;
    assert_eq!(error_of(st, &t).0, 503);
    let (st, t) = post(chat_body(json!({}))).await;
    assert_eq!(error_of(st, &t).0, 503);
    s.engine.ready.store(true, Ordering::Release);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429() {
    // One sequence at a time, one waiting: the third concurrent request is refused.
    let s = state(1, 1, 8192);
    let long = chat_body(json!({"max_tokens": 4000, "stream": true}));
    let first = tokio::spawn({
        let s = s.clone();
        let long = long.clone();
        async move { call(&s, "POST", "/v1/chat/completions", Some(long)).await }
    });
    while s.engine.metrics.active.load(Ordering::Relaxed) < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let second = tokio::spawn({
        let s = s.clone();
        async move { call(&s, "POST", "/v1/chat/completions", Some(long)).await }
    });
    while s.engine.metrics.queue_depth.load(Ordering::Relaxed) < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (st, t) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    assert_eq!(
        error_of(st, &t),
        (429, Value::Null, json!("rate_limit_error"))
    );
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(second.await.unwrap().0, StatusCode::OK);
    assert!(s.engine.metrics.rejected.load(Ordering::Relaxed) >= 1);
}

/// An expert that fails to load (here: a NaN scale byte) fails the request that needed it with
/// a 500 naming the file and the expert; the server answers the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unloadable_expert_is_a_500_and_the_server_carries_on() {
    let dir = std::env::temp_dir().join(format!("k3-serve-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(crate::tiny()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    // Every expert read on use (cache 0), through the store.
    let experts = ExpertOptions {
        cache_experts: Some(0),
        usage_cache: false,
        ..ExpertOptions::default()
    };
    let s = state_on(dir.clone(), experts, 8, 4, 512);
    let (status, _) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // Poison every expert: the first byte of its gate's scales becomes 0xFF (NaN in E8M0),
    // which the store's validation of a landed expert refuses. (Truncating a shard would pull
    // the mapped trunk tensors that follow the experts out from under the model.)
    let ckpt = expert_store::Checkpoint::open(&dir).unwrap();
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let layout =
        k3_model::inventory::expert_layout(&k3_model::K3Config::from_json(&config).unwrap());
    for loc in ckpt.expert_table(&layout).unwrap().values() {
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&loc.path)
            .unwrap()
            .write_all_at(&[0xFF], loc.tensors[1].start as u64)
            .unwrap();
    }
    drop(ckpt);
    let (st, t) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    assert_eq!(error_of(st, &t).0, 500, "{t}");
    assert!(
        t.contains("expert") && t.contains("layer") && t.contains(".safetensors"),
        "{t}"
    );
    // The engine is still there: health and the next request are answered.
    let (st, _) = call(&s, "GET", "/health", None).await;
    assert_eq!(st, StatusCode::OK);
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    let (st, _) = call(&s, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(st, StatusCode::INTERNAL_SERVER_ERROR);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A chat body validated without an engine: the rendered prompt text, or the error.
fn rendered_prompt(
    body: Value,
    effort: k3_model::chat::ThinkingEffort,
) -> Result<String, (Value, String)> {
    let limits = Limits {
        model_names: vec!["tiny".into()],
        max_tokens_default: 16,
        context: 512,
        thinking_effort: effort,
        thinking: true,
        vocab_size: 1024,
        max_compile: std::time::Duration::from_secs(2),
        max_mask: std::time::Duration::from_millis(200),
        created: 1_700_000_000,
    };
    let request: k3_serve::api::ChatRequest = serde_json::from_value(body).unwrap();
    match request.validate(&limits) {
        Ok(valid) => match valid.prompt {
            k3_serve::api::Prompt::Chat { segments, .. } => {
                Ok(segments.iter().map(|s| s.text.as_str()).collect())
            }
            other => panic!("a chat request gave a completion's prompt: {other:?}"),
        },
        Err(e) => Err((json!(e.param), e.message)),
    }
}

fn chat_json(extra: Value) -> Value {
    serde_json::from_str(&chat_body(extra)).unwrap()
}

#[test]
fn thinking_effort_is_a_request_field_with_a_server_default() {
    use k3_model::chat::ThinkingEffort;
    let default_low = rendered_prompt(chat_json(json!({})), ThinkingEffort::Low).unwrap();
    assert!(
        default_low.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>")
    );
    assert!(
        default_low.contains("`thinking_effort=low`"),
        "{default_low}"
    );
    let high = rendered_prompt(
        chat_json(json!({"thinking_effort": "high"})),
        ThinkingEffort::Low,
    )
    .unwrap();
    assert!(high.contains("`thinking_effort=high`"), "{high}");
    let kwargs = chat_json(json!({"chat_template_kwargs": {"thinking_effort": "max"}}));
    assert!(
        rendered_prompt(kwargs, ThinkingEffort::Low)
            .unwrap()
            .contains("`thinking_effort=max`")
    );
    let off =
        chat_json(json!({"chat_template_kwargs": {"thinking": false}, "thinking_effort": "high"}));
    assert!(
        !rendered_prompt(off, ThinkingEffort::Max)
            .unwrap()
            .contains("thinking-effort")
    );
    for bad in [json!("medium"), json!(3)] {
        let (param, message) = rendered_prompt(
            chat_json(json!({"thinking_effort": bad})),
            ThinkingEffort::Max,
        )
        .unwrap_err();
        assert_eq!(param, "thinking_effort");
        assert!(message.contains(&bad.to_string()), "{message}");
    }
    let kwargs = chat_json(json!({"chat_template_kwargs": {"thinking_effort": "extreme"}}));
    assert_eq!(
        rendered_prompt(kwargs, ThinkingEffort::Max).unwrap_err().0,
        "thinking_effort"
    );
}

#[test]
fn tool_choice_and_response_format_are_rendered_or_refused() {
    use k3_model::chat::ThinkingEffort::Max;
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let required = rendered_prompt(
        chat_json(json!({"tools": tools, "tool_choice": "required"})),
        Max,
    )
    .unwrap();
    assert!(
        required.contains(
            "type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`."
        ),
        "{required}"
    );
    let none = rendered_prompt(
        chat_json(json!({"tools": tools, "tool_choice": "none"})),
        Max,
    )
    .unwrap();
    assert!(none.contains("`tool_choice=none`"), "{none}");
    let auto = rendered_prompt(
        chat_json(json!({"tools": tools, "tool_choice": "auto"})),
        Max,
    )
    .unwrap();
    assert!(!auto.contains("tool-choice"));
    for bad in [
        json!({"tool_choice": "required"}),
        json!({"tools": tools, "tool_choice": "sometimes"}),
        json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    ] {
        assert_eq!(
            rendered_prompt(chat_json(bad), Max).unwrap_err().0,
            "tool_choice"
        );
    }
    // A named function renders nothing (as in the reference); constrained decoding forces
    // the call (tests/serve/structured.rs).
    let named = rendered_prompt(
        chat_json(
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ),
        Max,
    )
    .unwrap();
    assert!(!named.contains("tool-choice"), "{named}");
    // The JSON formats render the template's system message (k3-model's frozen chat vector
    // checks how) and are enforced by constrained decoding; a json_schema without a schema
    // is refused.
    let schema =
        json!({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}});
    for format in [json!({"type": "json_object"}), schema] {
        let prompt = rendered_prompt(chat_json(json!({"response_format": format})), Max).unwrap();
        assert!(prompt.contains("response-format"), "{prompt}");
    }
    let (param, message) = rendered_prompt(
        chat_json(json!({"response_format": {"type": "json_schema"}})),
        Max,
    )
    .unwrap_err();
    assert_eq!(param, "response_format");
    assert!(message.contains("schema"), "{message}");
    let text =
        rendered_prompt(chat_json(json!({"response_format": {"type": "text"}})), Max).unwrap();
    assert!(!text.contains("response-format"));
    let (param, _) =
        rendered_prompt(chat_json(json!({"response_format": {"type": "yaml"}})), Max).unwrap_err();
    assert_eq!(param, "response_format");
}

#[test]
fn names_ids_and_string_arguments_reach_the_renderer() {
    use k3_model::chat::ThinkingEffort::Max;
    let messages = json!([
        {"role": "user", "name": "alice", "content": "Hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "call_8", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_8", "content": "G"},
        {"role": "tool", "tool_call_id": "call_7", "content": "F"},
    ]);
    let prompt = rendered_prompt(chat_json(json!({"messages": messages})), Max).unwrap();
    assert!(
        prompt.contains("<|open|>message role=\"user\" name=\"alice\"<|sep|>Hi"),
        "{prompt}"
    );
    // A JSON-object string is read as the object (llama.cpp does the same); any other string
    // is the call's `json` block as it is.
    assert!(prompt.contains("<|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"x\" type=\"number\"<|sep|>1<|close|>argument<|sep|>"), "{prompt}");
    assert!(prompt.contains("<|open|>call tool=\"g\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|>"), "{prompt}");
    // Results matched to calls by id, in the calls' order, numbered from 1.
    assert!(prompt.contains("<|open|>message role=\"tool\" tool=\"f\" index=\"1\"<|sep|>F<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"tool\" tool=\"g\" index=\"2\"<|sep|>G"), "{prompt}");
    let orphan = json!([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]);
    let (param, message) =
        rendered_prompt(chat_json(json!({"messages": orphan})), Max).unwrap_err();
    assert_eq!(param, "messages");
    assert!(message.contains("message 1"), "{message}");
    let array_arguments = json!([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}]);
    assert_eq!(
        rendered_prompt(chat_json(json!({"messages": array_arguments})), Max)
            .unwrap_err()
            .0,
        "messages[0]"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_format_fields_are_answered_through_the_router() {
    let s = state(8, 4, 512);
    let prompt_tokens = |text: &str| -> u64 {
        let v: Value = serde_json::from_str(text).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let (st, plain) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({"response_format": {"type": "text"}}))),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{plain}");
    let body = chat_body(json!({"tool_choice": "none", "thinking_effort": "low"}));
    let (st, none) = call(&s, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(st, StatusCode::OK, "{none}");
    assert!(prompt_tokens(&none) > prompt_tokens(&plain) + 10);
    let body = chat_body(
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
    );
    let (st, text) = call(&s, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(error_of(st, &text).1, "response_format", "{text}");
    let body = chat_body(json!({"thinking_effort": "medium"}));
    let (st, text) = call(&s, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(error_of(st, &text).0, 400, "{text}");
    assert_eq!(error_of(st, &text).1, "thinking_effort", "{text}");
}

#[test]
fn past_reasoning_is_read_from_reasoning_content_or_reasoning() {
    use k3_model::chat::ThinkingEffort::Max;
    for key in ["reasoning_content", "reasoning"] {
        let messages = json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", key: "Greet back."},
            {"role": "user", "content": "Bye"},
        ]);
        let prompt = rendered_prompt(chat_json(json!({"messages": messages})), Max).unwrap();
        assert!(
            prompt.contains("<|open|>think<|sep|>Greet back.<|close|>think<|sep|>"),
            "{key}: {prompt}"
        );
    }
}
fn no_usage_cache() -> ExpertOptions {
    ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    }
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The `data:` payloads of an SSE body.
fn sse_data(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect()
}

/// Finding 1: an empty completion prompt starts from [BOS] and is answered; the engine goes
/// on answering (it used to die on it, with every later request refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_prompt_is_answered_and_the_engine_carries_on() {
    let s = state(8, 4, 512);
    for stream in [false, true] {
        let body = json!({"prompt": "", "max_tokens": 4, "stream": stream}).to_string();
        let (st, t) = call(&s, "POST", "/v1/completions", Some(body)).await;
        assert_eq!(st, StatusCode::OK, "{t}");
        if stream {
            let data = sse_data(&t);
            assert_eq!(data.last(), Some(&"[DONE]"), "{t}");
            assert!(t.contains("\"finish_reason\":\""), "{t}");
        } else {
            let v = json_of(&t);
            assert_eq!(v["usage"]["prompt_tokens"], 1, "[BOS] alone: {t}");
            assert!(
                v["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
                "{t}"
            );
        }
    }
    for i in 0..10 {
        let body = json!({"prompt": format!("request {i}"), "max_tokens": 3}).to_string();
        let (st, t) = call(&s, "POST", "/v1/completions", Some(body)).await;
        assert_eq!(st, StatusCode::OK, "request {i}: {t}");
        let finish = json_of(&t)["choices"][0]["finish_reason"].clone();
        assert!(finish == "length" || finish == "stop", "{t}");
    }
    let (st, _) = call(&s, "GET", "/health", None).await;
    assert_eq!(st, StatusCode::OK);
}

/// A panic in one request's work (injected: the engine's test hook panics in the sampling of
/// the prompt "boom") fails that request with a 500 error object, or an error chunk in a
/// stream, and the engine serves the next ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_request_fails_it_alone() {
    for after in [0, 2] {
        let mut c = config(crate::tiny(), no_usage_cache(), 8, 4, 512);
        c.panic_on_prompt = Some(("boom".into(), after));
        let s = state_unready(c, 512);
        assert!(wait_ready(&s.engine, Duration::from_secs(60)));
        let boom =
            |stream: bool| json!({"prompt": "boom", "max_tokens": 6, "stream": stream}).to_string();
        // Another request in the same batch, before and after.
        let other = json!({"prompt": "fine", "max_tokens": 24}).to_string();
        let (alongside, (st, t)) = tokio::join!(
            call(&s, "POST", "/v1/completions", Some(other.clone())),
            call(&s, "POST", "/v1/completions", Some(boom(false)))
        );
        assert_eq!(error_of(st, &t).0, 500, "{t}");
        assert!(
            t.contains("internal error") && t.contains("injected fault"),
            "{t}"
        );
        assert_eq!(alongside.0, StatusCode::OK, "{}", alongside.1);
        assert!(
            json_of(&alongside.1)["usage"]["completion_tokens"]
                .as_u64()
                .unwrap()
                >= 1
        );

        let (st, t) = call(&s, "POST", "/v1/completions", Some(boom(true))).await;
        assert_eq!(
            st,
            StatusCode::OK,
            "a stream's status is sent before the panic"
        );
        let data = sse_data(&t);
        assert_eq!(data.last(), Some(&"[DONE]"), "{t}");
        let error = json_of(data[data.len() - 2]);
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("injected fault"),
            "{t}"
        );
        assert!(!t.contains("finish_reason\":\""), "no normal finish: {t}");

        for _ in 0..3 {
            let (st, t) = call(&s, "POST", "/v1/completions", Some(other.clone())).await;
            assert_eq!(st, StatusCode::OK, "{t}");
        }
        let (st, _) = call(&s, "GET", "/health", None).await;
        assert_eq!(st, StatusCode::OK);
    }
}

/// A copy of the tiny checkpoint with its first shard cut to half.
pub(crate) fn damaged_copy(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("k3-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut shards = Vec::new();
    for entry in std::fs::read_dir(crate::tiny()).unwrap() {
        let path = entry.unwrap().path();
        let to = dir.join(path.file_name().unwrap());
        std::fs::copy(&path, &to).unwrap();
        if to.extension().is_some_and(|e| e == "safetensors") {
            shards.push(to);
        }
    }
    shards.sort();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&shards[0])
        .unwrap();
    file.set_len(file.metadata().unwrap().len() / 2).unwrap();
    dir
}

/// A model that fails to load: the wait says why at once, `/health` is 503 with an error
/// object, `/metrics` says the engine is down, and generation is 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_reported_and_health_says_so() {
    let dir = damaged_copy("router-damaged");
    let s = state_unready(config(dir.clone(), no_usage_cache(), 8, 4, 512), 512);
    let start = std::time::Instant::now();
    let why = s
        .engine
        .wait_loaded(Some(Duration::from_secs(60)))
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(why.contains(".safetensors"), "{why}");
    while s.engine.alive.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (st, t) = call(&s, "GET", "/health", None).await;
    assert_eq!(error_of(st, &t).0, 503);
    assert!(t.contains("stopped"), "{t}");
    let (_, t) = call(&s, "GET", "/metrics", None).await;
    assert!(t.contains("\nk3_engine_up 0\n"), "{t}");
    let (st, t) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({}))),
    )
    .await;
    assert_eq!(error_of(st, &t).0, 503);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Finding 6: every non-2xx answer carries the error object: 405 (wrong method, OPTIONS),
/// 404, 413, 415, 429 (above), 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_has_an_error_object() {
    let s = state(8, 4, 512);
    for (method, uri) in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/health"),
        ("OPTIONS", "/v1/chat/completions"),
        ("DELETE", "/v1/models"),
    ] {
        let (st, t) = call(&s, method, uri, None).await;
        assert_eq!(
            error_of(st, &t),
            (405, Value::Null, json!("invalid_request_error")),
            "{method} {uri}"
        );
        assert!(t.contains(method), "{t}");
    }
    let (st, t) = call(&s, "POST", "/v1/nothing", Some("{}".into())).await;
    assert_eq!(error_of(st, &t).0, 404);
    let request = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "text/plain")
        .body(Body::from(json!({"prompt": "x"}).to_string()))
        .unwrap();
    let response = app(s.clone()).oneshot(request).await.unwrap();
    let st = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(error_of(st, &String::from_utf8_lossy(&bytes)).0, 415);
    let (_, t) = call(&s, "GET", "/metrics", None).await;
    assert!(t.contains("\nk3_engine_up 1\n"), "{t}");
}

/// Finding 7: fields that are not implemented are refused by name; `stream: null` is false.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_refused_by_name() {
    let s = state(8, 4, 512);
    let completion = |extra: Value| {
        let mut body = json!({"prompt": "Once", "max_tokens": 2, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    for (extra, field) in [
        (json!({"echo": true}), "echo"),
        (json!({"suffix": "end"}), "suffix"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"logit_bias": {"1024": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"logit_bias": [1]}), "logit_bias"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"stream": true, "stream_options": {"other": true}}),
            "stream_options",
        ),
    ] {
        let (st, t) = call(
            &s,
            "POST",
            "/v1/completions",
            Some(completion(extra.clone())),
        )
        .await;
        assert_eq!(error_of(st, &t).0, 400, "{extra}: {t}");
        assert_eq!(error_of(st, &t).1, field, "{extra}: {t}");
    }
    for extra in [
        json!({"echo": false, "suffix": "", "best_of": 1}),
        json!({"echo": null, "suffix": null, "best_of": null, "stream": null, "logit_bias": null}),
    ] {
        let (st, t) = call(
            &s,
            "POST",
            "/v1/completions",
            Some(completion(extra.clone())),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{extra}: {t}");
    }
    let (st, t) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({"stream": null}))),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{t}");
    assert_eq!(json_of(&t)["object"], "chat.completion");
}

/// `logit_bias` moves the choice: +100 on "A" and "B" makes greedy output a string of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_steers_the_sampler() {
    let s = state(8, 4, 512);
    let body = json!({"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                      "logit_bias": {"65": 100, "66": 100}})
    .to_string();
    let (st, t) = call(&s, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(st, StatusCode::OK, "{t}");
    let text = json_of(&t)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(text.len(), 12, "{text:?}");
    assert!(text.bytes().all(|b| b == b'A' || b == b'B'), "{text:?}");
}

/// `stream_options.include_usage`: the usage comes in a chunk of its own (no choices) before
/// `[DONE]`, with `"usage": null` in the others; without it there is no usage in a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_streamed_only_when_asked() {
    let s = state(8, 4, 512);
    let (_, t) = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(chat_body(json!({"stream": true}))),
    )
    .await;
    assert!(!t.contains("\"usage\""), "{t}");
    let asked = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (st, t) = call(&s, "POST", "/v1/chat/completions", Some(asked)).await;
    assert_eq!(st, StatusCode::OK, "{t}");
    let data = sse_data(&t);
    assert_eq!(data.last(), Some(&"[DONE]"));
    let usage = json_of(data[data.len() - 2]);
    assert_eq!(usage["choices"], json!([]), "{t}");
    assert!(
        usage["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{t}"
    );
    for chunk in &data[..data.len() - 2] {
        let v = json_of(chunk);
        assert!(v["usage"].is_null() && v.get("usage").is_some(), "{chunk}");
    }
}

/// Finding 5: stop strings over the limit are refused (cheaply: the body is 3.2 MB); a stop
/// spanning tokens cuts there, in content and in reasoning, streamed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_are_bounded_and_cut_across_tokens() {
    let s = state(8, 4, 512);
    let huge = json!({"prompt": "x", "max_tokens": 2, "stop": vec!["ab".repeat(400_000); 4]});
    let start = std::time::Instant::now();
    let (st, t) = call(&s, "POST", "/v1/completions", Some(huge.to_string())).await;
    assert_eq!(error_of(st, &t).1, "stop", "{t}");
    assert!(t.contains(&MAX_STOP_BYTES.to_string()), "{t}");
    assert!(start.elapsed() < Duration::from_secs(2));

    // Output over {A, B} (one byte a token), then a stop taken from its middle.
    let bias = json!({"65": 100, "66": 100});
    let plain =
        json!({"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "logit_bias": bias});
    let (_, t) = call(&s, "POST", "/v1/completions", Some(plain.to_string())).await;
    let full = json_of(&t)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let stop = full[5..8].to_owned();
    let want = &full[..full.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut body = plain.clone();
        body["stop"] = json!([stop]);
        body["stream"] = json!(stream);
        let (st, t) = call(&s, "POST", "/v1/completions", Some(body.to_string())).await;
        assert_eq!(st, StatusCode::OK, "{t}");
        let (text, finish) = if stream {
            let mut text = String::new();
            let mut finish = Value::Null;
            for chunk in sse_data(&t).iter().filter(|c| **c != "[DONE]") {
                let v = json_of(chunk);
                text.push_str(v["choices"][0]["text"].as_str().unwrap());
                if !v["choices"][0]["finish_reason"].is_null() {
                    finish = v["choices"][0]["finish_reason"].clone();
                }
            }
            (text, finish)
        } else {
            let v = json_of(&t);
            (
                v["choices"][0]["text"].as_str().unwrap().to_owned(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(
            (text.as_str(), finish),
            (want, json!("stop")),
            "full {full:?}, stop {stop:?}"
        );
    }

    // With thinking on, the forced output is all reasoning: the stop applies there too.
    let chat = |stop: Option<&str>| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
                              "temperature": 0, "logit_bias": bias});
        if let Some(stop) = stop {
            body["stop"] = json!(stop);
        }
        body.to_string()
    };
    let (_, t) = call(&s, "POST", "/v1/chat/completions", Some(chat(None))).await;
    let full = json_of(&t)["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap_or_else(|| panic!("no reasoning: {t}"))
        .to_owned();
    assert_eq!(full.len(), 12, "{full:?}");
    let stop = full[6..9].to_owned();
    let (_, t) = call(&s, "POST", "/v1/chat/completions", Some(chat(Some(&stop)))).await;
    let v = json_of(&t);
    let got = v["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap_or("");
    assert_eq!(got, &full[..full.find(&stop).unwrap()], "{t}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

/// `--no-think` is the server's default for chat requests that do not say; a request's
/// `chat_template_kwargs.thinking` still decides for itself.
#[test]
fn thinking_defaults_to_the_server_setting() {
    let thinks = |server_default: bool, extra: Value| {
        let limits = Limits {
            model_names: vec!["tiny".into()],
            max_tokens_default: 16,
            context: 512,
            thinking_effort: k3_model::chat::ThinkingEffort::Max,
            thinking: server_default,
            vocab_size: 1024,
            max_compile: std::time::Duration::from_secs(2),
            max_mask: std::time::Duration::from_millis(200),
            created: 1_700_000_000,
        };
        let request: k3_serve::api::ChatRequest = serde_json::from_value(chat_json(extra)).unwrap();
        match request.validate(&limits).unwrap().prompt {
            k3_serve::api::Prompt::Chat { thinking, .. } => thinking,
            other => panic!("a chat request gave a completion's prompt: {other:?}"),
        }
    };
    assert!(thinks(true, json!({})));
    assert!(!thinks(false, json!({})));
    assert!(thinks(
        false,
        json!({"chat_template_kwargs": {"thinking": true}})
    ));
    assert!(!thinks(
        true,
        json!({"chat_template_kwargs": {"thinking": false}})
    ));
}
