//! The request handlers: the two generation endpoints (read, validate, tokenize on the
//! blocking pool, queue, answer as JSON or SSE), `/v1/models` and `/health`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::header::{ACCEPT_ENCODING, CONTENT_ENCODING, HeaderName, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use k3_structured::Grammar;
use serde_json::{Value, json};

use super::answer::{Chunks, collect};
use super::state::{AppState, check_engine};
use crate::api::chat::ChatRequest;
use crate::api::completion::CompletionRequest;
use crate::api::error::ApiError;
use crate::api::valid::ValidRequest;
use crate::auth::Tenant;
use crate::engine::job::Job;
use crate::engine::prompt::{encode_prompt, min_prompt_tokens, prompt_segments};
use crate::engine::queue::SubmitError;

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

/// The prompt's tokens, on the blocking pool: first a bound from its byte length (so an
/// over-long prompt is refused without tokenizing it), then the tokens, then the exact check.
async fn tokenize(
    state: &AppState,
    request: ValidRequest,
) -> Result<(ValidRequest, Vec<u32>, usize, Option<Grammar>), ApiError> {
    let tokenizer = Arc::clone(&state.engine.tokenizer);
    let engine = state.engine.clone();
    let limits = Arc::clone(&state.limits);
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
        let (ids, system_tokens) = encode_prompt(&tokenizer, &request.prompt, &segments);
        if ids.is_empty() {
            return Err(ApiError::invalid(
                "prompt",
                "the prompt has no tokens, and the tokenizer has no [BOS] token to begin from",
            ));
        }
        if ids.len() + request.max_tokens > context {
            return Err(too_long(ids.len().to_string(), request.max_tokens));
        }
        // The output constraint compiles here too, off the engine's steps: a schema the
        // library refuses, or one past the compile-time limit, is this request's 400.
        let grammar = request
            .constraint
            .as_ref()
            .map(|constraint| engine.compile_constraint(constraint, &limits))
            .transpose()?;
        Ok((request, ids, system_tokens, grammar))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("tokenizing the prompt failed: {e}"),
        )
    })?
}

/// The codings `headers` list under `name`, but those that change nothing (`keep`).
fn codings<'h>(headers: &'h HeaderMap, name: HeaderName, keep: &str) -> Vec<&'h str> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(keep))
        .collect()
}

/// A body sent compressed (`Content-Encoding` other than `identity`) is refused with 415, as
/// RFC 9110 asks of a server that does not decode that coding: read as JSON it would be a
/// misleading "invalid JSON" (or, were it plain text labelled gzip, accepted by mistake). A
/// transfer coding other than `chunked` (which the HTTP layer decodes) is a 501, as RFC 9112
/// asks.
fn coding_refused(headers: &HeaderMap) -> Option<Response> {
    if let Some(coding) = codings(headers, TRANSFER_ENCODING, "chunked").first() {
        return Some(
            ApiError::new(
                StatusCode::NOT_IMPLEMENTED,
                format!("Transfer-Encoding {coding} is not supported: only chunked is"),
            )
            .into_response(),
        );
    }
    let content = codings(headers, CONTENT_ENCODING, "identity");
    let coding = content.first()?;
    let mut refusal = ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        format!("Content-Encoding {coding} is not supported: send the JSON body uncompressed"),
    )
    .into_response();
    refusal
        .headers_mut()
        .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    Some(refusal)
}

pub(super) async fn chat(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    headers: HeaderMap,
    parsed: Result<Json<Value>, JsonRejection>,
) -> Response {
    if let Some(refusal) = coding_refused(&headers) {
        return refusal;
    }
    let id = format!("chatcmpl-{:x}", unique());
    let (request, ignored) = read(parsed, ChatRequest::from_json, |r| {
        (r.ignored().to_vec(), r.validate(&state.limits))
    });
    answer(state, tenant, request, &ignored, id, true).await
}

pub(super) async fn completions(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    headers: HeaderMap,
    parsed: Result<Json<Value>, JsonRejection>,
) -> Response {
    if let Some(refusal) = coding_refused(&headers) {
        return refusal;
    }
    let id = format!("cmpl-{:x}", unique());
    let (request, ignored) = read(parsed, CompletionRequest::from_json, |r| {
        (r.ignored().to_vec(), r.validate(&state.limits))
    });
    answer(state, tenant, request, &ignored, id, false).await
}

/// A body read as an endpoint's request (`from_json`), then its ignored fields and its
/// validation (`check`); the ignored fields are empty when the body could not be read.
fn read<R>(
    parsed: Result<Json<Value>, JsonRejection>,
    from_json: impl FnOnce(&Value) -> Result<R, ApiError>,
    check: impl FnOnce(R) -> (Vec<String>, Result<ValidRequest, ApiError>),
) -> (Result<ValidRequest, ApiError>, Vec<String>) {
    match body(parsed).and_then(|b| from_json(&b)) {
        Ok(request) => {
            let (ignored, valid) = check(request);
            (valid, ignored)
        }
        Err(e) => (Err(e), Vec::new()),
    }
}

/// Runs a validated request (or answers its error), saying which fields it ignored: once in
/// a warning log line, and in the `X-Ignored-Fields` header of the answer.
async fn answer(
    state: AppState,
    tenant: Option<Extension<Tenant>>,
    request: Result<ValidRequest, ApiError>,
    ignored: &[String],
    id: String,
    chat: bool,
) -> Response {
    let listed = ignored_list(ignored);
    if let Some(listed) = &listed {
        log::warn!("{id}: ignored fields this server does not read: {listed}");
    }
    let tenant = tenant.map_or(Tenant::OPEN, |Extension(t)| t);
    let mut response = match request {
        Ok(request) => run(state, tenant, request, id, chat)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Err(e) => e.into_response(),
    };
    if let Some(value) = listed.and_then(|l| HeaderValue::from_str(&l).ok()) {
        response.headers_mut().insert("x-ignored-fields", value);
    }
    response
}

/// Names listed at most in the ignored-fields line and header (a body may hold thousands).
const MAX_IGNORED_LISTED: usize = 32;

/// `a, b, c` (each name escaped to printable ASCII, at most [`MAX_IGNORED_LISTED`] of them,
/// then how many more); `None` when nothing was ignored.
fn ignored_list(ignored: &[String]) -> Option<String> {
    if ignored.is_empty() {
        return None;
    }
    let mut names: Vec<String> = ignored
        .iter()
        .take(MAX_IGNORED_LISTED)
        .map(|name| {
            let name: String = name.chars().take(64).collect();
            name.escape_default().to_string().replace(',', "\\x2c")
        })
        .collect();
    if ignored.len() > MAX_IGNORED_LISTED {
        names.push(format!("and {} more", ignored.len() - MAX_IGNORED_LISTED));
    }
    Some(names.join(", "))
}

/// Tokenizes, checks the context, queues, and answers as a stream or one JSON body.
async fn run(
    state: AppState,
    tenant: Tenant,
    request: ValidRequest,
    id: String,
    chat: bool,
) -> Result<Response, ApiError> {
    check_engine(&state.engine)?;
    let (request, ids, system_tokens, grammar) = tokenize(&state, request).await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stream = request.stream;
    let include_usage = request.include_usage;
    let logprobs = request.logprobs;
    let cache_namespace = tenant.cache_namespace(request.cache_salt.as_deref());
    state
        .engine
        .submit(Job {
            request,
            prompt_ids: ids,
            system_tokens,
            cache_namespace,
            events: tx,
            log_id: Some(id.clone()),
            submitted: std::time::Instant::now(),
            state: Default::default(),
            grammar,
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

fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Every name the model is served as (the reported one first), each with when the server
/// started serving it.
pub(super) async fn models(State(state): State<AppState>) -> Json<Value> {
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

pub(super) async fn health(State(state): State<AppState>) -> Response {
    match check_engine(&state.engine) {
        Ok(()) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
    }
}
