//! The prompt cache end to end, through the router and the engine thread on the `tiny`
//! preset: resumed requests answer exactly as a cold server (one test per case of issue 18's
//! acceptance 1), a turn resumes from the end of the previous answer, spilled snapshots
//! survive a restart while corrupt or foreign files are ignored with a warning, and a tiny
//! budget evicts.
//!
//! "Exactly": greedy outputs and, for every generated token, the top-20 log-probabilities as
//! the server reports them. A log-probability is the token's logit minus the log-sum-exp of
//! all logits, so a logit bit that differs among the top 20 (or moves the sum) shows up in
//! them: they are the logits' fingerprint the HTTP API can give. The full-logits fingerprints
//! of a resumed session are compared at the model level (`k3-model/tests/snapshot.rs`).

mod bit_identity;
mod budget;
mod spill;
mod tenants;
mod tools;
mod turns;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_model::builder::EngineOptions;
use k3_model::experts::ExpertOptions;
use k3_serve::api::Limits;
use k3_serve::engine::{EngineConfig, PromptCacheOptions, spawn, wait_ready};
use k3_serve::server::{AppState, app};
use serde_json::{Value, json};
use tower::ServiceExt;

/// The `tiny` synthetic checkpoint (seed 0), generated once per test binary.
pub(crate) fn tiny() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| synthetic("tiny", 0)).clone()
}

/// A `tiny` checkpoint generated with `seed` into a directory named by `tag`.
pub(crate) fn synthetic(tag: &str, seed: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("k3-cache-e2e-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
    options.seed = seed;
    k3_model::synth::generate(&dir, &options).unwrap();
    dir
}

/// How an engine runs: threads, fake NUMA domains, prefill chunk, routed experts from the
/// expert store with this many resident per layer (`None`: from the mapping).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Setup {
    pub(crate) threads: usize,
    pub(crate) fake_domains: Option<usize>,
    pub(crate) chunk: usize,
    pub(crate) expert_cache: Option<usize>,
}

pub(crate) const PLAIN: Setup = Setup {
    threads: 1,
    fake_domains: None,
    chunk: 8,
    expert_cache: None,
};

const CONTEXT: usize = 1024;

/// A server over the checkpoint in `model_dir`.
pub(crate) fn server_on(model_dir: PathBuf, setup: Setup, cache: PromptCacheOptions) -> AppState {
    server_with(model_dir, setup, cache, Vec::new())
}

/// [`server_on`], with answers scripted for some prompts
/// (`EngineConfig::scripted_answers`).
pub(crate) fn server_with(
    model_dir: PathBuf,
    setup: Setup,
    cache: PromptCacheOptions,
    scripted_answers: Vec<(Vec<u32>, Vec<u32>)>,
) -> AppState {
    capture_logs();
    let config = EngineConfig {
        model_dir,
        options: EngineOptions {
            pool: numa_sched::PoolOptions {
                threads: Some(setup.threads),
                fake_domains: setup.fake_domains,
                ..Default::default()
            },
            experts: ExpertOptions {
                cache_experts: setup.expert_cache,
                usage_cache: false,
                ..ExpertOptions::default()
            },
            max_batch: 4,
            ctx: CONTEXT,
            ..EngineOptions::default()
        },
        queue: 16,
        step_tokens: setup.chunk,
        prompt_cache: cache,
        panic_on_prompt: None,
        scripted_answers,
        hold_load: false,
        max_mask: Duration::from_millis(200),
        spec: Default::default(),
    };
    let (engine, _thread) = spawn(config).unwrap();
    assert!(wait_ready(&engine, Duration::from_secs(120)));
    AppState {
        engine,
        limits: Arc::new(limits()),
        responses: Default::default(),
    }
}

/// What every test server checks requests against.
pub(crate) fn limits() -> Limits {
    Limits {
        model_names: vec!["tiny".into()],
        max_tokens_default: 16,
        context: CONTEXT,
        thinking_effort: k3_model::chat::ThinkingEffort::Max,
        thinking: true,
        vocab_size: 1024,
        max_compile: std::time::Duration::from_secs(2),
        max_mask: std::time::Duration::from_millis(200),
        created: 1_700_000_000,
    }
}

pub(crate) fn server(setup: Setup, cache: PromptCacheOptions) -> AppState {
    server_on(tiny(), setup, cache)
}

/// A server with the cache on (1 GiB, no spill directory).
pub(crate) fn warm(setup: Setup) -> AppState {
    server(setup, warm_options())
}

/// The cache of [`warm`] servers.
pub(crate) fn warm_options() -> PromptCacheOptions {
    PromptCacheOptions {
        budget_bytes: 1 << 30,
        dir: None,
    }
}

/// One server without the cache, shared by every test: the cold runs answers are compared
/// with (a cold answer does not depend on threads, domains or chunking: contract 1, tested
/// in k3-model; comparing every case with one cold setup is the stricter check).
pub(crate) fn cold() -> &'static AppState {
    static COLD: OnceLock<AppState> = OnceLock::new();
    COLD.get_or_init(|| server(PLAIN, PromptCacheOptions::default()))
}

pub(crate) async fn call(state: &AppState, uri: &str, body: Option<Value>) -> (StatusCode, String) {
    let request = Request::builder()
        .method(if body.is_some() { "POST" } else { "GET" })
        .uri(uri)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A greedy chat answer of at most 8 tokens with the top-20 log-probabilities of each.
pub(crate) async fn chat(state: &AppState, messages: &Value) -> Value {
    chat_n(state, messages, 8).await
}

/// [`chat`] with at most `max_tokens` tokens.
pub(crate) async fn chat_n(state: &AppState, messages: &Value, max_tokens: usize) -> Value {
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "logprobs": true, "top_logprobs": 20});
    let (status, text) = call(state, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

pub(crate) fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {answer}"))
}

pub(crate) fn prompt_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens"].as_u64().unwrap()
}

/// What must be the same bits with and without the cache: the choices (text, reasoning,
/// finish reason, log-probabilities) and the prompt's size.
pub(crate) fn outcome(answer: &Value) -> (Value, Value) {
    (
        answer["choices"].clone(),
        answer["usage"]["prompt_tokens"].clone(),
    )
}

pub(crate) fn system() -> Value {
    json!({"role": "system", "content": "You are a terse assistant for the k3 test suite. \
        Answer in one short sentence and never apologise."})
}

pub(crate) fn turn_one() -> Value {
    json!([system(), {"role": "user", "content": "What is a prompt cache?"}])
}

/// Turn one, its answer as a client sends it back, and a new user message.
pub(crate) fn turn_two(first: &Value) -> Value {
    let message = &first["choices"][0]["message"];
    let mut assistant = json!({"role": "assistant", "content": message["content"]});
    if let Some(reasoning) = message.get("reasoning_content") {
        assistant["reasoning_content"] = reasoning.clone();
    }
    let mut messages = turn_one();
    let list = messages.as_array_mut().unwrap();
    list.push(assistant);
    list.push(json!({"role": "user", "content": "And why is it exact?"}));
    messages
}

/// Another conversation with turn one's system prompt.
pub(crate) fn other_conversation() -> Value {
    json!([system(), {"role": "user", "content": "Name a prime number."}])
}

/// The tokens of `messages` as the server renders them, and how many are the system block.
pub(crate) fn chat_ids(state: &AppState, messages: &Value) -> (Vec<u32>, usize) {
    let request: k3_serve::api::ChatRequest =
        serde_json::from_value(json!({"model": "tiny", "messages": messages})).unwrap();
    let valid = request.validate(&state.limits).unwrap();
    let segments = k3_serve::engine::prompt_segments(&valid.prompt);
    k3_serve::engine::encode_prompt(&state.engine.tokenizer, &valid.prompt, &segments)
}

pub(crate) async fn metric(state: &AppState, name: &str) -> u64 {
    let (_, text) = call(state, "/metrics", None).await;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
        .parse()
        .unwrap()
}

/// Every log record of level warn or above the engines of this binary emitted, as
/// `LEVEL message` lines (tests run in parallel: each looks for lines naming its own files).
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let line = format!("{} {}", record.level(), record.args());
            LOGGED.lock().unwrap_or_else(|p| p.into_inner()).push(line);
        }
    }

    fn flush(&self) {}
}

/// Routes the `log` records of this process into [`LOGGED`] (once).
fn capture_logs() {
    static CAPTURE: Capture = Capture;
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        log::set_logger(&CAPTURE).expect("no other logger in this test binary");
        log::set_max_level(log::LevelFilter::Warn);
    });
}

/// The captured warning and error lines that contain `needle`.
pub(crate) fn logged(needle: &str) -> Vec<String> {
    LOGGED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|l| l.contains(needle))
        .cloned()
        .collect()
}
