//! A job's events as OpenAI's answer: gathered into one JSON body ([`collect`], [`Collected`])
//! or streamed as SSE chunks ([`Chunks`]) ending in `[DONE]`; an engine that drops the job
//! unfinished is an error either way.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::error::ApiError;
use crate::engine::job::{Event, TokenLogprob};

/// All of a job's events. An error event is a 500, and so is the channel closing before the
/// finish (the engine dropped the job): never a normal finish.
pub(super) async fn collect(mut events: UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
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

/// The `finish_reason` of an answer that ended for `reason` (the engine's `stop` or `length`):
/// `tool_calls` where it ended on its own (`stop`) with tool calls made (`called`), streamed
/// or not alike.
fn with_calls(reason: &'static str, called: bool) -> &'static str {
    if called && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// Why a request ended without its finish.
const ENGINE_GONE: &str = "the engine stopped before finishing this request";

/// A job's SSE chunks: one per event, a usage chunk when asked, an error chunk if the engine
/// drops the job unfinished, and `[DONE]` last.
pub(super) struct Chunks {
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    id: String,
    model: String,
    created: u64,
    chat: bool,
    logprobs: bool,
    include_usage: bool,
    first: bool,
    /// Where the next token's text begins (completions' `text_offset`).
    text_offset: TextOffset,
    /// A finish or an error was sent.
    ended: bool,
    /// `[DONE]` was queued.
    done: bool,
    /// A tool call was sent: the finish then says `tool_calls`, as the whole answer's does.
    called: bool,
}

impl Chunks {
    pub(super) fn new(
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
            text_offset: TextOffset::default(),
            ended: false,
            done: false,
            called: false,
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
        let mut event = event;
        match &mut event {
            Event::Delta { tool_calls, .. } => self.called |= !tool_calls.is_empty(),
            Event::Done { finish_reason, .. } => {
                *finish_reason = with_calls(finish_reason, self.called);
            }
            Event::Error(_) => {}
        }
        let logprobs = match &event {
            Event::Delta { logprobs, .. } if self.logprobs => {
                Some(logprobs_json(logprobs, self.chat, &mut self.text_offset))
            }
            _ => None,
        };
        let mut chunk = stream_chunk(
            &self.id,
            &self.model,
            self.created,
            self.chat,
            &event,
            self.first,
            logprobs,
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
                cached_tokens,
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
                        "usage": usage_json(prompt_tokens, completion_tokens, cached_tokens)}),
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

/// OpenAI's `usage`, with `prompt_tokens_details.cached_tokens`: prompt tokens restored from
/// the prompt cache.
fn usage_json(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

fn error_chunk(message: &str) -> Value {
    json!({"error": {"message": message, "type": "server_error", "param": null, "code": "500"}})
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

/// The characters of a completion's text before its next token, from the tokens' bytes as
/// the text is made of them (`take_text`): a character split over several tokens is counted
/// once, where it ends, so each of its tokens begins at the character before it; an invalid
/// byte is one U+FFFD.
#[derive(Debug, Default)]
pub(super) struct TextOffset {
    chars: usize,
    /// Bytes of a character not yet complete.
    tail: Vec<u8>,
}

impl TextOffset {
    fn advance(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
        self.chars += k3_model::chat::take_text(&mut self.tail, false)
            .chars()
            .count();
    }
}

/// Log-probabilities in the endpoint's shape: chat's `{"content": [{token, logprob, bytes,
/// top_logprobs: [...]}]}`, or the completions API's `{tokens, token_logprobs, top_logprobs,
/// text_offset}`, whose `top_logprobs` are maps from token text to log-probability (the
/// alternatives, highest first, and the chosen token, so up to N + 1 entries) and whose
/// `text_offset`s count characters from the completion's start (`offset`: where these tokens
/// begin; advanced past them).
fn logprobs_json(entries: &[TokenLogprob], chat: bool, offset: &mut TextOffset) -> Value {
    if chat {
        return json!({"content": entries.iter().map(|e| json!({
            "token": e.token, "logprob": e.logprob, "bytes": e.bytes,
            "top_logprobs": e.top.iter().map(|t| json!({"token": t.token, "logprob": t.logprob, "bytes": t.bytes})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()});
    }
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        tokens.push(json!(e.token));
        token_logprobs.push(json!(e.logprob));
        // Two ids may decode to the same text: the most likely keeps the key, except that
        // the chosen token's text always maps to its own log-probability.
        let mut top = serde_json::Map::new();
        for t in &e.top {
            top.entry(t.token.clone())
                .or_insert_with(|| json!(t.logprob));
        }
        top.insert(e.token.clone(), json!(e.logprob));
        top_logprobs.push(Value::Object(top));
        text_offset.push(json!(offset.chars));
        offset.advance(&e.bytes);
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
           "text_offset": text_offset})
}

/// One SSE chunk for `event`, with its log-probabilities when asked (`logprobs`).
fn stream_chunk(
    id: &str,
    model: &str,
    created: u64,
    chat: bool,
    event: &Event,
    first: bool,
    logprobs: Option<Value>,
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
            ..
        } => {
            let lp = logprobs.unwrap_or(Value::Null);
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
pub(super) struct Collected {
    reasoning: String,
    content: String,
    tool_calls: Vec<k3_model::chat::ToolCall>,
    logprobs: Vec<TokenLogprob>,
    /// How it ended, prompt, completion and cached tokens.
    finish: Option<(&'static str, usize, usize, usize)>,
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
                cached_tokens,
                ..
            } => {
                self.finish = Some((
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                ));
                None
            }
            Event::Error(message) => Some(message),
        }
    }

    pub(super) fn body(
        &self,
        id: &str,
        model: &str,
        created: u64,
        chat: bool,
        logprobs: bool,
    ) -> Value {
        let (finish, prompt, completion, cached) = self.finish.unwrap_or(("stop", 0, 0, 0));
        let finish = with_calls(finish, !self.tool_calls.is_empty());
        let lp = if logprobs {
            logprobs_json(&self.logprobs, chat, &mut TextOffset::default())
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
               "usage": usage_json(prompt, completion, cached)})
    }
}

#[cfg(test)]
mod tests;
