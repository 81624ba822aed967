//! The HTTP side: `app(state)` builds the router — `POST /v1/chat/completions` and
//! `/v1/completions` (JSON or SSE), `GET /v1/models`, `/health`, `/metrics` — over an
//! [`EngineHandle`]. Every error is OpenAI's error object with its status.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{ApiError, ChatRequest, CompletionRequest, Limits, ValidRequest};
use crate::engine::{EngineHandle, Event, Job, SubmitError, TokenLogprob, prompt_ids};

/// Largest request body accepted (413 above).
pub const MAX_BODY: usize = 4 << 20;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub limits: Arc<Limits>,
}

/// The router over `state`.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// A JSON body or the error explaining why not (413 too large, 400 malformed, 422 wrong shape).
fn body<T>(parsed: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    parsed.map(|Json(v)| v).map_err(|rejection| {
        // axum's own statuses (400 syntax, 422 shape, 413 over the body limit), except that
        // a missing content type is a plain 400 here rather than 415.
        let status = match &rejection {
            JsonRejection::MissingJsonContentType(_) => StatusCode::BAD_REQUEST,
            other => other.status(),
        };
        ApiError::new(
            status,
            format!("invalid request body: {}", rejection.body_text()),
        )
    })
}

async fn chat(
    State(state): State<AppState>,
    parsed: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let request = body(parsed)?.validate(&state.limits)?;
    run(state, request, true).await
}

async fn completions(
    State(state): State<AppState>,
    parsed: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let request = body(parsed)?.validate(&state.limits)?;
    run(state, request, false).await
}

/// Tokenizes, checks the context, queues, and answers as a stream or one JSON body.
async fn run(state: AppState, request: ValidRequest, chat: bool) -> Result<Response, ApiError> {
    if !state.engine.ready.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        ));
    }
    let ids = prompt_ids(&state.engine.tokenizer, &request.prompt);
    let context = state.limits.context;
    if ids.len() + request.max_tokens > context {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the context of {context} tokens",
                ids.len(),
                request.max_tokens
            ),
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stream = request.stream;
    let logprobs = request.logprobs;
    state
        .engine
        .submit(Job {
            request,
            prompt_ids: ids,
            events: tx,
        })
        .map_err(|e| match e {
            SubmitError::Full => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "the server is at capacity (admission queue full); retry later",
            ),
            SubmitError::Stopped => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
            }
        })?;
    let id = format!("{}-{:x}", if chat { "chatcmpl" } else { "cmpl" }, unique());
    let model = state.limits.model_name.clone();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if stream {
        let mut first = true;
        let events = UnboundedReceiverStream::new(rx).map(move |event| {
            let chunk = stream_chunk(&id, &model, created, chat, &event, first, logprobs);
            first = false;
            Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string()))
        });
        let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
        Ok(Sse::new(events.chain(done))
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        let mut rx = rx;
        let mut collected = Collected::default();
        while let Some(event) = rx.recv().await {
            if let Some(error) = collected.add(event) {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error));
            }
        }
        Ok(Json(collected.body(&id, &model, created, chat, logprobs)).into_response())
    }
}

fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn tool_calls_json(calls: &[k3_model::chat::ToolCall], first_index: usize) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"index": first_index + i, "id": format!("call_{}", first_index + i), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments_json()}})
            })
            .collect(),
    )
}

fn logprobs_json(entries: &[TokenLogprob]) -> Value {
    json!({"content": entries.iter().map(|e| json!({
        "token": e.token, "logprob": e.logprob, "bytes": e.token.as_bytes(),
        "top_logprobs": e.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
    })).collect::<Vec<_>>()})
}

/// One SSE chunk for `event`.
fn stream_chunk(
    id: &str,
    model: &str,
    created: u64,
    chat: bool,
    event: &Event,
    first: bool,
    logprobs: bool,
) -> Value {
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let choice = match event {
        Event::Delta {
            reasoning,
            content,
            tool_calls,
            logprobs: lps,
        } => {
            let lp = if logprobs {
                logprobs_json(lps)
            } else {
                Value::Null
            };
            if chat {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if !reasoning.is_empty() {
                    delta["reasoning_content"] = json!(reasoning);
                }
                if !content.is_empty() || (reasoning.is_empty() && tool_calls.is_empty()) {
                    delta["content"] = json!(content);
                }
                if !tool_calls.is_empty() {
                    delta["tool_calls"] = tool_calls_json(tool_calls, 0);
                }
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null})
            } else {
                json!({"index": 0, "text": content, "logprobs": lp, "finish_reason": null})
            }
        }
        Event::Done {
            finish_reason,
            prompt_tokens,
            completion_tokens,
            ..
        } => {
            let choice = if chat {
                json!({"index": 0, "delta": {}, "finish_reason": finish_reason})
            } else {
                json!({"index": 0, "text": "", "finish_reason": finish_reason})
            };
            return json!({"id": id, "object": object, "created": created, "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}});
        }
        Event::Error(message) => {
            return json!({"error": {"message": message, "type": "server_error", "param": null, "code": "500"}});
        }
    };
    json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
}

/// A whole answer, gathered from events.
#[derive(Debug, Default)]
struct Collected {
    reasoning: String,
    content: String,
    tool_calls: Vec<k3_model::chat::ToolCall>,
    logprobs: Vec<TokenLogprob>,
    finish: Option<(&'static str, usize, usize)>,
}

impl Collected {
    /// Adds an event; an error's message comes back.
    fn add(&mut self, event: Event) -> Option<String> {
        match event {
            Event::Delta {
                reasoning,
                content,
                tool_calls,
                logprobs,
            } => {
                self.reasoning.push_str(&reasoning);
                self.content.push_str(&content);
                self.tool_calls.extend(tool_calls);
                self.logprobs.extend(logprobs);
                None
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                self.finish = Some((finish_reason, prompt_tokens, completion_tokens));
                None
            }
            Event::Error(message) => Some(message),
        }
    }

    fn body(&self, id: &str, model: &str, created: u64, chat: bool, logprobs: bool) -> Value {
        let (finish, prompt, completion) = self.finish.unwrap_or(("stop", 0, 0));
        let finish = if !self.tool_calls.is_empty() && finish == "stop" {
            "tool_calls"
        } else {
            finish
        };
        let lp = if logprobs {
            logprobs_json(&self.logprobs)
        } else {
            Value::Null
        };
        let choice = if chat {
            let mut message = json!({"role": "assistant", "content": self.content});
            if !self.reasoning.is_empty() {
                message["reasoning_content"] = json!(self.reasoning);
            }
            if !self.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&self.tool_calls, 0);
            }
            json!({"index": 0, "message": message, "logprobs": lp, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": self.content, "logprobs": lp, "finish_reason": finish})
        };
        json!({"id": id, "object": if chat { "chat.completion" } else { "text_completion" },
               "created": created, "model": model, "choices": [choice],
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
    }
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.limits.model_name, "object": "model", "created": 0, "owned_by": "k3",
        "max_model_len": state.limits.context,
    }]}))
}

async fn health(State(state): State<AppState>) -> Response {
    if state.engine.ready.load(Ordering::Acquire) {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        )
        .into_response()
    }
}

/// Prometheus text format.
async fn metrics(State(state): State<AppState>) -> Response {
    let m = &state.engine.metrics;
    let generated = m.generated_tokens.load(Ordering::Relaxed);
    let decode_s = m.decode_ns.load(Ordering::Relaxed) as f64 / 1e9;
    let mut text = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    metric(
        "k3_requests_total",
        "counter",
        "Requests admitted to the engine.",
        m.requests.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "k3_requests_rejected_total",
        "counter",
        "Requests refused with 429 (queue full).",
        m.rejected.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "k3_prompt_tokens_total",
        "counter",
        "Prompt tokens prefilled.",
        m.prompt_tokens.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "k3_generated_tokens_total",
        "counter",
        "Tokens generated.",
        generated.to_string(),
    );
    metric(
        "k3_decode_tokens_per_second",
        "gauge",
        "Generated tokens per second of decode-step time.",
        format!(
            "{:.3}",
            if decode_s > 0.0 {
                generated as f64 / decode_s
            } else {
                0.0
            }
        ),
    );
    metric(
        "k3_queue_depth",
        "gauge",
        "Requests waiting for a batch slot.",
        m.queue_depth.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "k3_active_sequences",
        "gauge",
        "Sequences in the running batch.",
        m.active.load(Ordering::Relaxed).to_string(),
    );
    let store = *m.store.lock().unwrap_or_else(|p| p.into_inner());
    let store = store.unwrap_or_default();
    metric(
        "k3_expert_cache_hits_total",
        "counter",
        "Routed-expert uses served from memory.",
        store.hits.to_string(),
    );
    metric(
        "k3_expert_cache_misses_total",
        "counter",
        "Routed-expert uses that needed a read.",
        store.misses.to_string(),
    );
    metric(
        "k3_expert_bytes_read_total",
        "counter",
        "Bytes of experts read from disk.",
        store.bytes_read.to_string(),
    );
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}
