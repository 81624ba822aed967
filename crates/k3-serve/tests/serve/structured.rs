//! Structured outputs through the router, on the random-weight `tiny` model (which would never
//! write JSON by itself): `response_format` `json_object` and a nested `json_schema`, and a
//! forced tool call, greedy and at temperature 1; every answer parses and validates against
//! its schema with the `jsonschema` crate (a validator independent of llguidance). Output
//! identity: a constrained request leaves an unconstrained one batched with it unchanged.
//!
//! `K3_STRUCTURED_MODEL=DIR` and `--ignored` run the same suite on another checkpoint with
//! `K3_STRUCTURED_REQUESTS` requests per case (the acceptance run: 100 on k3-0.40b).

use std::time::Duration;

use axum::http::StatusCode;
use k3_model::experts::ExpertOptions;
use serde_json::{Value, json};

use crate::router::{call, config, state_unready};

/// The nested schema: objects, arrays, enums, bounded numbers, required keys and
/// `additionalProperties: false`.
pub(crate) fn nested_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["alpha", "beta", "gamma delta"]},
            "score": {"type": "integer", "minimum": -5, "maximum": 120},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["x", "y", "z"]},
                "maxItems": 4
            },
            "child": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "level": {"type": "integer", "minimum": 0, "maximum": 9},
                    "note": {"enum": ["none", null, 3]}
                },
                "required": ["ok", "level"],
                "additionalProperties": false
            }
        },
        "required": ["name", "score", "tags", "child"],
        "additionalProperties": false
    })
}

/// The tool a forced call names, and another one it must not call.
fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {
                    "direction": {"type": "string", "enum": ["up", "down"]},
                    "steps": {"type": "integer", "minimum": 1, "maximum": 9},
                    "fast": {"type": "boolean"}
                },
                "required": ["direction", "steps"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {"name": "stop", "parameters": {"type": "object"}}}
    ])
}

/// Posts `body` to the chat endpoint.
async fn chat(state: &k3_serve::server::AppState, body: &Value) -> (StatusCode, String) {
    chat_text(state, body.to_string()).await
}

/// Posts a chat body, already text.
async fn chat_text(state: &k3_serve::server::AppState, body: String) -> (StatusCode, String) {
    call(state, "POST", "/v1/chat/completions", Some(body)).await
}

/// `body` with `extra`'s fields set (replacing any of the same name).
fn with_fields(mut body: Value, extra: &Value) -> Value {
    for (k, v) in extra.as_object().expect("an object of fields") {
        body[k] = v.clone();
    }
    body
}

/// One case of the suite: the request's extra fields and the schema its answer must follow
/// (`None`: any JSON object).
struct Case {
    name: &'static str,
    extra: Value,
    schema: Option<Value>,
    tool: bool,
}

fn cases() -> Vec<Case> {
    let move_parameters = tools()[0]["function"]["parameters"].clone();
    vec![
        Case {
            name: "json_object",
            extra: json!({"response_format": {"type": "json_object"}}),
            schema: None,
            tool: false,
        },
        Case {
            name: "json_schema",
            extra: json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "nested", "schema": nested_schema(), "strict": true}}}),
            schema: Some(nested_schema()),
            tool: false,
        },
        Case {
            name: "required tool call",
            extra: json!({"tools": [tools()[0].clone()], "tool_choice": "required"}),
            schema: Some(tools()[0]["function"]["parameters"].clone()),
            tool: true,
        },
        Case {
            name: "forced tool call",
            extra: json!({"tools": tools(),
                "tool_choice": {"type": "function", "function": {"name": "move"}}}),
            schema: Some(move_parameters),
            tool: true,
        },
    ]
}

/// Checks one answer of `case`: content JSON (or the call's arguments) that validates.
fn check_answer(case: &Case, status: StatusCode, text: &str) -> Result<(), String> {
    if status != StatusCode::OK {
        return Err(format!("{status}: {text}"));
    }
    let body: Value = serde_json::from_str(text).map_err(|e| format!("{e}: {text}"))?;
    let message = &body["choices"][0]["message"];
    let answer = if case.tool {
        let calls = message["tool_calls"]
            .as_array()
            .filter(|c| c.len() == 1)
            .ok_or_else(|| format!("not one tool call: {message}"))?;
        let function = &calls[0]["function"];
        if function["name"] != "move" {
            return Err(format!("called {}", function["name"]));
        }
        function["arguments"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    } else {
        message["content"].as_str().unwrap_or_default().to_owned()
    };
    let value: Value = match serde_json::from_str(&answer) {
        Ok(value) => value,
        // JSON's grammar bounds no number (RFC 8259 §6); serde_json's f64 does. Such an
        // answer is held to the syntax alone (IgnoredAny scans numbers without their value)
        // and to being an object, which is all `json_object` asks.
        Err(e) if e.to_string().contains("number out of range") && case.schema.is_none() => {
            serde_json::from_str::<serde::de::IgnoredAny>(&answer)
                .map_err(|e| format!("not JSON ({e}): {answer:?}"))?;
            return if answer.trim_start().starts_with('{') {
                Ok(())
            } else {
                Err(format!("not an object: {answer:?}"))
            };
        }
        Err(e) => return Err(format!("not JSON ({e}): {answer:?}")),
    };
    let schema = case.schema.clone().unwrap_or(json!({"type": "object"}));
    let validator = jsonschema::validator_for(&schema).map_err(|e| e.to_string())?;
    if let Err(e) = validator.validate(&value) {
        return Err(format!("{answer} does not validate: {e}"));
    }
    Ok(())
}

/// Runs every case `requests` times greedy and at temperature 1 (different seeds), batched
/// `batch` at a time, thinking off; returns the failures.
async fn run_suite(
    state: &k3_serve::server::AppState,
    model: &str,
    requests: usize,
    batch: usize,
) -> Vec<String> {
    let mut failures = Vec::new();
    for case in cases() {
        for temperature in [0.0, 1.0] {
            for start in (0..requests).step_by(batch) {
                let calls: Vec<_> = (start..(start + batch).min(requests)).map(|i| {
                    let body = with_fields(json!({
                        "model": model,
                        "messages": [{"role": "user", "content": format!("Request {i}: answer in JSON.")}],
                        "max_tokens": 160,
                        "temperature": temperature,
                        "seed": i,
                        "chat_template_kwargs": {"thinking": false},
                    }), &case.extra);
                    let state = state.clone();
                    tokio::spawn(async move {
                        chat(&state, &body).await
                    })
                }).collect();
                for (i, answer) in calls.into_iter().enumerate() {
                    let (status, text) = answer.await.expect("the request's task");
                    if let Err(e) = check_answer(&case, status, &text) {
                        failures.push(format!(
                            "{} at temperature {temperature}, request {}: {e}",
                            case.name,
                            start + i
                        ));
                    }
                }
            }
        }
    }
    failures
}

/// A ready engine on `dir` holding `context` tokens per sequence, whole prompts in one step
/// (so the steps' counts show the decode batching), set up further by `setup`.
fn engine_state(
    dir: std::path::PathBuf,
    context: usize,
    setup: impl FnOnce(&mut k3_serve::engine::EngineConfig),
) -> k3_serve::server::AppState {
    let experts = ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    };
    let mut engine = config(dir, experts, 64, 8, context);
    engine.step_tokens = 512;
    setup(&mut engine);
    let state = state_unready(engine, context);
    assert!(k3_serve::engine::wait_ready(
        &state.engine,
        Duration::from_secs(600)
    ));
    state
}

fn tiny_state() -> k3_serve::server::AppState {
    engine_state(crate::tiny(), 1024, |_| {})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_answers_parse_and_validate_on_tiny() {
    let state = tiny_state();
    let failures = run_suite(&state, "tiny", 12, 6).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The acceptance run on another checkpoint (`K3_STRUCTURED_MODEL`), in release:
/// `K3_STRUCTURED_MODEL=/path/k3-0.40b cargo test --release -p k3-serve --test serve
/// structured::acceptance -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs K3_STRUCTURED_MODEL; the acceptance run, minutes in release"]
async fn acceptance_on_a_checkpoint() {
    let (dir, requests) = match std::env::var("K3_STRUCTURED_MODEL") {
        Ok(dir) => (
            std::path::PathBuf::from(dir),
            std::env::var("K3_STRUCTURED_REQUESTS")
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(100),
        ),
        Err(_) => (crate::tiny(), 100),
    };
    let state = engine_state(dir, 2048, |engine| engine.options.pool.threads = Some(2));
    let started = std::time::Instant::now();
    let failures = run_suite(&state, "tiny", requests, 8).await;
    println!(
        "{} cases x 2 temperatures x {requests} requests in {:.1} s; {} failures",
        cases().len(),
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A chat job on `state`'s engine, at temperature 1 with `seed` and the top-5 log-probabilities
/// of each token, through the constrained path with `grammar` or without: its text and each
/// token's log-probability line.
async fn sampled_job(
    state: &k3_serve::server::AppState,
    seed: u64,
    grammar: Option<k3_structured::Grammar>,
) -> (String, Vec<String>) {
    use k3_serve::engine::{Event, Job, prompt_ids};
    let request: k3_serve::api::ChatRequest = serde_json::from_value(json!({
        "model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 24, "temperature": 1, "seed": seed, "logprobs": true, "top_logprobs": 5,
        "chat_template_kwargs": {"thinking": false}}))
    .unwrap();
    let request = request.validate(&state.limits).unwrap();
    let ids = prompt_ids(&state.engine.tokenizer, &request.prompt);
    let (events, mut received) = tokio::sync::mpsc::unbounded_channel();
    state
        .engine
        .submit(Job {
            request,
            prompt_ids: ids,
            system_tokens: 0,
            cache_namespace: Default::default(),
            events,
            log_id: None,
            submitted: std::time::Instant::now(),
            state: Default::default(),
            grammar,
        })
        .unwrap();
    let (mut text, mut lines) = (String::new(), Vec::new());
    loop {
        match received.recv().await.expect("the engine ends every job") {
            Event::Delta {
                reasoning,
                content,
                logprobs,
                ..
            } => {
                text.push_str(&reasoning);
                text.push_str(&content);
                lines.extend(logprobs.iter().map(|l| format!("{l:?}")));
            }
            Event::Done { .. } => return (text, lines),
            Event::Error(e) => panic!("the job failed: {e}"),
        }
    }
}

/// A constraint that allows every id (`Spec::Any`, through the mask, the matcher and its mask
/// thread) gives the tokens, log-probabilities and alternatives of no constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_allowing_every_token_changes_nothing() {
    let state = tiny_state();
    let vocabulary = state.engine.vocabulary().unwrap();
    let any = k3_structured::Grammar::compile(
        &vocabulary,
        &k3_structured::Spec::Any,
        &k3_structured::Options::default(),
    )
    .unwrap();
    for seed in 0..4 {
        let free = sampled_job(&state, seed, None).await;
        let constrained = sampled_job(&state, seed, Some(any.clone())).await;
        assert_eq!(constrained, free, "seed {seed}");
        assert_eq!(
            free.1.len(),
            24,
            "seed {seed}: ended early, so it tests less"
        );
    }
}

/// Constrained requests batched with an unconstrained one leave its tokens unchanged: the same
/// text and log-probabilities alone and among four JSON-constrained requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_neighbours_leave_an_unconstrained_request_unchanged() {
    let state = tiny_state();
    let free = json!({
        "model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 24, "temperature": 1, "seed": 9, "logprobs": true, "top_logprobs": 3,
        "chat_template_kwargs": {"thinking": false}});
    let (status, alone) = chat(&state, &free).await;
    assert_eq!(status, StatusCode::OK, "{alone}");
    let answer = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap();
        (
            v["choices"][0]["message"].clone(),
            v["choices"][0]["logprobs"].clone(),
        )
    };
    let mut tasks = Vec::new();
    for i in 0..4 {
        let state = state.clone();
        let body = json!({
            "model": "tiny", "messages": [{"role": "user", "content": format!("JSON {i}")}],
            "max_tokens": 40, "temperature": 1, "seed": i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested_schema()}},
            "chat_template_kwargs": {"thinking": false}});
        tasks.push(tokio::spawn(async move { chat(&state, &body).await }));
    }
    let batched = {
        let state = state.clone();
        let body = free.to_string();
        tokio::spawn(async move { chat_text(&state, body).await })
    };
    for task in tasks {
        let (status, text) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    let (status, batched) = batched.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{batched}");
    assert_eq!(answer(&batched), answer(&alone));
    // The steps did batch them: more than one sequence was fed per decode step on average.
    let m = &state.engine.metrics;
    let steps = m.steps.load(std::sync::atomic::Ordering::Relaxed);
    let decoded = m
        .step_decode_tokens
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(decoded > steps, "{decoded} decode tokens in {steps} steps");
}

/// What the library refuses is a 400 naming the field and the keyword; a forced call needs
/// its function among the tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_constraints_are_400s_naming_what() {
    let state = tiny_state();
    let unique =
        json!({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": true}}});
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": unique}}}),
            "response_format",
            "uniqueItems",
        ),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "jump"}}}),
            "tool_choice",
            "jump",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "response_format",
            "",
        ),
    ];
    for (extra, param, named) in cases {
        let body = with_fields(
            json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
            &extra,
        );
        let (status, text) = chat(&state, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["param"], param, "{text}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains(named),
            "{text}"
        );
    }
}

/// A constraint whose masks take longer than the limit fails its own request; an
/// unconstrained request running beside it finishes, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mask_past_its_limit_fails_its_request_alone() {
    let mut state = tiny_state();
    let mut limits = (*state.limits).clone();
    limits.max_mask = Duration::from_nanos(1);
    state.limits = std::sync::Arc::new(limits);
    let body = |extra: Value| {
        let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12, "temperature": 0, "chat_template_kwargs": {"thinking": false}});
        with_fields(body, &extra).to_string()
    };
    let constrained = {
        let state = state.clone();
        let body = body(json!({"response_format": {"type": "json_object"}}));
        tokio::spawn(async move { chat_text(&state, body).await })
    };
    let (status, free) = chat_text(&state, body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{free}");
    let (status, text) = constrained.await.unwrap();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{text}");
    assert!(text.contains("--max-mask-ms"), "{text}");
    let (status, again) = chat_text(&state, body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again.len(), free.len());
}

/// With thinking on the reasoning stays free (here scripted: text the schema would refuse,
/// then the think closer and the response opener), and the answer after it is constrained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_thinking_the_reasoning_is_free_and_the_answer_constrained() {
    let tokenizer = k3_model::tokenizer::Tokenizer::from_dir(&crate::tiny()).unwrap();
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Think, then JSON."}],
        "max_tokens": 120, "temperature": 1, "seed": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested_schema()}}});
    let limits = k3_serve::api::Limits {
        model_names: vec!["tiny".into()],
        max_tokens_default: 16,
        context: 2048,
        thinking_effort: k3_model::chat::ThinkingEffort::Max,
        thinking: true,
        vocab_size: 1024,
        max_compile: Duration::from_secs(2),
        max_mask: Duration::from_millis(200),
        created: 0,
    };
    let request: k3_serve::api::ChatRequest = serde_json::from_value(body.clone()).unwrap();
    let request = request.validate(&limits).unwrap();
    let ids = k3_serve::engine::prompt_ids(&tokenizer, &request.prompt);
    let reasoning = "Not JSON {{ at all.";
    let mut script = tokenizer.encode(reasoning, false);
    script.extend(tokenizer.encode("<|close|>think<|sep|><|open|>response<|sep|>", true));
    let state = engine_state(crate::tiny(), 2048, |engine| {
        engine.scripted_answers = vec![(ids, script)];
    });
    let (status, text) = chat(&state, &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], reasoning, "{text}");
    let answer: Value = serde_json::from_str(message["content"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {text}"));
    let validator = jsonschema::validator_for(&nested_schema()).unwrap();
    assert!(validator.is_valid(&answer), "{answer}");
}
