//! The HTTP side: `app(state)` builds the router — `POST /v1/chat/completions` and
//! `/v1/completions` (JSON or SSE), `GET /v1/models`, `/health`, `/metrics` — over an
//! [`EngineHandle`]. Every error is OpenAI's error object with its status, 404 and 405
//! included. Prompts are tokenized on the blocking pool, after a length check that needs no
//! tokenizing, so no prompt holds up the async threads.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{ApiError, ChatRequest, CompletionRequest, Limits, ValidRequest};
use crate::engine::{
    EngineHandle, Event, Job, SubmitError, TokenLogprob, encode_segments, min_prompt_tokens,
    prompt_segments,
};

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
        .fallback(|uri: Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no such route: {}", uri.path()),
            )
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on {}", uri.path()),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// A JSON body or the error explaining why not (413 too large, 400 malformed, 422 wrong
/// shape, 415 not declared as JSON: axum's own statuses).
fn body<T>(parsed: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    parsed.map(|Json(v)| v).map_err(|rejection| {
        ApiError::new(
            rejection.status(),
            format!("invalid request body: {}", rejection.body_text()),
        )
    })
}

/// 503 unless the engine serves.
fn check_engine(engine: &EngineHandle) -> Result<(), ApiError> {
    if !engine.alive.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine has stopped (see the server's log)",
        ));
    }
    if !engine.ready.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        ));
    }
    Ok(())
}

/// The prompt's tokens, on the blocking pool: first a bound from its byte length (so an
/// over-long prompt is refused without tokenizing it), then the tokens, then the exact check.
async fn tokenize(
    state: &AppState,
    request: ValidRequest,
) -> Result<(ValidRequest, Vec<u32>), ApiError> {
    let tokenizer = Arc::clone(&state.engine.tokenizer);
    let context = state.limits.context;
    let too_long = move |tokens: String, max_tokens: usize| {
        ApiError::invalid(
            "max_tokens",
            format!(
                "the prompt ({tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context of {context} tokens"
            ),
        )
    };
    tokio::task::spawn_blocking(move || {
        let segments = prompt_segments(&request.prompt);
        let least = min_prompt_tokens(&tokenizer, &segments);
        if least + request.max_tokens > context {
            return Err(too_long(format!("at least {least}"), request.max_tokens));
        }
        let ids = encode_segments(&tokenizer, &segments);
        if ids.is_empty() {
            return Err(ApiError::invalid(
                "prompt",
                "the prompt has no tokens, and the tokenizer has no [BOS] token to begin from",
            ));
        }
        if ids.len() + request.max_tokens > context {
            return Err(too_long(ids.len().to_string(), request.max_tokens));
        }
        Ok((request, ids))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("tokenizing the prompt failed: {e}"),
        )
    })?
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
    check_engine(&state.engine)?;
    let (request, ids) = tokenize(&state, request).await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stream = request.stream;
    let include_usage = request.include_usage;
    let logprobs = request.logprobs;
    let id = format!("{}-{:x}", if chat { "chatcmpl" } else { "cmpl" }, unique());
    state
        .engine
        .submit(Job {
            request,
            prompt_ids: ids,
            events: tx,
            log_id: Some(id.clone()),
            submitted: std::time::Instant::now(),
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
    let model = state.limits.model_name().to_owned();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if stream {
        let chunks = Chunks::new(rx, id, model, created, chat, logprobs, include_usage);
        Ok(Sse::new(chunks)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        let collected = collect(rx).await?;
        Ok(Json(collected.body(&id, &model, created, chat, logprobs)).into_response())
    }
}

/// All of a job's events. An error event is a 500, and so is the channel closing before the
/// finish (the engine dropped the job): never a normal finish.
async fn collect(mut events: UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut collected = Collected::default();
    while let Some(event) = events.recv().await {
        if let Some(error) = collected.add(event) {
            return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error));
        }
    }
    if collected.finish.is_none() {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ENGINE_GONE,
        ));
    }
    Ok(collected)
}

/// Why a request ended without its finish.
const ENGINE_GONE: &str = "the engine stopped before finishing this request";

/// A job's SSE chunks: one per event, a usage chunk when asked, an error chunk if the engine
/// drops the job unfinished, and `[DONE]` last.
struct Chunks {
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    id: String,
    model: String,
    created: u64,
    chat: bool,
    logprobs: bool,
    include_usage: bool,
    first: bool,
    /// A finish or an error was sent.
    ended: bool,
    /// `[DONE]` was queued.
    done: bool,
}

impl Chunks {
    fn new(
        events: UnboundedReceiver<Event>,
        id: String,
        model: String,
        created: u64,
        chat: bool,
        logprobs: bool,
        include_usage: bool,
    ) -> Self {
        Self {
            events,
            queue: VecDeque::new(),
            id,
            model,
            created,
            chat,
            logprobs,
            include_usage,
            first: true,
            ended: false,
            done: false,
        }
    }

    fn push(&mut self, chunk: Value) {
        self.queue
            .push_back(SseEvent::default().data(chunk.to_string()));
    }

    fn on_event(&mut self, event: Option<Event>) {
        let Some(event) = event else {
            if !self.ended {
                self.push(error_chunk(ENGINE_GONE));
            }
            self.queue.push_back(SseEvent::default().data("[DONE]"));
            self.done = true;
            return;
        };
        let mut chunk = stream_chunk(
            &self.id,
            &self.model,
            self.created,
            self.chat,
            &event,
            self.first,
            self.logprobs,
        );
        self.first = false;
        if self.include_usage && chunk.get("choices").is_some() {
            chunk["usage"] = Value::Null;
        }
        self.push(chunk);
        match event {
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                self.ended = true;
                if self.include_usage {
                    let object = if self.chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    self.push(
                        json!({"id": self.id, "object": object, "created": self.created,
                        "model": self.model, "choices": [],
                        "usage": usage_json(prompt_tokens, completion_tokens)}),
                    );
                }
            }
            Event::Error(_) => self.ended = true,
            Event::Delta { .. } => {}
        }
    }
}

impl tokio_stream::Stream for Chunks {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            let event = std::task::ready!(self.events.poll_recv(cx));
            self.on_event(event);
        }
    }
}

fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn error_chunk(message: &str) -> Value {
    json!({"error": {"message": message, "type": "server_error", "param": null, "code": "500"}})
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
        // The usage goes in a chunk of its own, when asked (`stream_options`).
        Event::Done { finish_reason, .. } => {
            if chat {
                json!({"index": 0, "delta": {}, "finish_reason": finish_reason})
            } else {
                json!({"index": 0, "text": "", "finish_reason": finish_reason})
            }
        }
        Event::Error(message) => return error_chunk(message),
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
               "usage": usage_json(prompt, completion)})
    }
}

/// Every name the model is served as (the reported one first), each with when the server
/// started serving it.
async fn models(State(state): State<AppState>) -> Json<Value> {
    let limits = &state.limits;
    let data: Vec<Value> = limits
        .model_names
        .iter()
        .map(|name| {
            json!({"id": name, "object": "model", "created": limits.created, "owned_by": "k3",
                   "max_model_len": limits.context})
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn health(State(state): State<AppState>) -> Response {
    match check_engine(&state.engine) {
        Ok(()) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
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
        "k3_engine_up",
        "gauge",
        "1 while the engine serves; 0 while the model loads or after the engine stopped.",
        u8::from(check_engine(&state.engine).is_ok()).to_string(),
    );
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
