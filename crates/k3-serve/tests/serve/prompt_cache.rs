//! The prompt cache through the router: a chat's next turn and a conversation sharing only the
//! system prompt resume from cached state and answer exactly as a server without the cache
//! (threads 1 and 2, a fake 2-domain pool, prefill chunks 1/7/64, batched with other
//! requests), spilled snapshots survive a restart, a corrupt one is ignored, and a tiny budget
//! evicts.
//!
//! "Exactly": greedy outputs and, for every generated token, the top-5 log-probabilities as
//! the server reports them. A log-probability is the token's logit minus the log-sum-exp of
//! all logits, so any logit bit that differs shows up in them: they serve as the logits'
//! fingerprint here.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_model::builder::EngineOptions;
use k3_model::experts::ExpertOptions;
use k3_model::model::snapshot::state_bytes;
use k3_serve::api::Limits;
use k3_serve::engine::{EngineConfig, PromptCacheOptions, spawn, wait_ready};
use k3_serve::server::{AppState, app};
use serde_json::{Value, json};
use tower::ServiceExt;

/// How an engine runs: threads, fake NUMA domains, prefill chunk.
#[derive(Debug, Clone, Copy)]
struct Setup {
    threads: usize,
    fake_domains: Option<usize>,
    chunk: usize,
}

const PLAIN: Setup = Setup {
    threads: 1,
    fake_domains: None,
    chunk: 8,
};

const CONTEXT: usize = 1024;

fn server(setup: Setup, cache: PromptCacheOptions) -> AppState {
    let config = EngineConfig {
        model_dir: crate::tiny(),
        options: EngineOptions {
            pool: numa_sched::PoolOptions {
                threads: Some(setup.threads),
                fake_domains: setup.fake_domains,
                ..Default::default()
            },
            experts: ExpertOptions {
                usage_cache: false,
                ..ExpertOptions::default()
            },
            max_batch: 4,
            ctx: CONTEXT,
            ..EngineOptions::default()
        },
        queue: 16,
        prefill_chunk: setup.chunk,
        prompt_cache: cache,
        panic_on_prompt: None,
    };
    let (engine, _thread) = spawn(config).unwrap();
    assert!(wait_ready(&engine, Duration::from_secs(120)));
    AppState {
        engine,
        limits: Arc::new(Limits {
            model_names: vec!["tiny".into()],
            max_tokens_default: 16,
            context: CONTEXT,
            thinking_effort: k3_model::chat::ThinkingEffort::Max,
            thinking: true,
            vocab_size: 1024,
            created: 1_700_000_000,
        }),
    }
}

fn cold(setup: Setup) -> AppState {
    server(setup, PromptCacheOptions::default())
}

fn warm(setup: Setup) -> AppState {
    server(
        setup,
        PromptCacheOptions {
            budget_bytes: 1 << 30,
            dir: None,
        },
    )
}

async fn call(state: &AppState, uri: &str, body: Option<Value>) -> (StatusCode, String) {
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

/// A greedy chat answer with the top-5 log-probabilities of every token.
async fn chat(state: &AppState, messages: &Value) -> Value {
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 8,
        "temperature": 0, "logprobs": true, "top_logprobs": 5});
    let (status, text) = call(state, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {answer}"))
}

/// What must be the same bits with and without the cache: the choices (text, reasoning,
/// finish reason, log-probabilities) and the prompt's size.
fn outcome(answer: &Value) -> (Value, Value) {
    (
        answer["choices"].clone(),
        answer["usage"]["prompt_tokens"].clone(),
    )
}

fn system() -> Value {
    json!({"role": "system", "content": "You are a terse assistant for the k3 test suite. \
        Answer in one short sentence and never apologise."})
}

fn turn_one() -> Value {
    json!([system(), {"role": "user", "content": "What is a prompt cache?"}])
}

/// Turn one, its answer, and a new user message.
fn turn_two(first: &Value) -> Value {
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

/// Tokens of the system block of `messages` as the server renders them.
fn system_tokens(state: &AppState, messages: &Value) -> usize {
    let request: k3_serve::api::ChatRequest =
        serde_json::from_value(json!({"model": "tiny", "messages": messages})).unwrap();
    let valid = request.validate(&state.limits).unwrap();
    let segments = k3_serve::engine::prompt_segments(&valid.prompt);
    let split = k3_serve::engine::system_segments(&valid.prompt);
    k3_serve::engine::encode_split(&state.engine.tokenizer, &segments, split).1
}

async fn metric(state: &AppState, name: &str) -> u64 {
    let (_, text) = call(state, "/metrics", None).await;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_turn_resumes_and_answers_as_a_cold_server() {
    let setups = [
        (1, None, 1),
        (1, None, 7),
        (1, None, 64),
        (2, None, 7),
        (2, Some(2), 7),
    ];
    for (threads, fake_domains, chunk) in setups {
        let setup = Setup {
            threads,
            fake_domains,
            chunk,
        };
        let (cold, warm) = (cold(setup), warm(setup));
        let first_cold = chat(&cold, &turn_one()).await;
        let first_warm = chat(&warm, &turn_one()).await;
        assert_eq!(outcome(&first_cold), outcome(&first_warm), "{setup:?}");
        assert_eq!(cached_tokens(&first_warm), 0, "nothing cached yet");

        let second = turn_two(&first_warm);
        let second_cold = chat(&cold, &second).await;
        let second_warm = chat(&warm, &second).await;
        assert_eq!(outcome(&second_cold), outcome(&second_warm), "{setup:?}");
        assert_eq!(
            cached_tokens(&second_cold),
            0,
            "the cold server caches nothing"
        );
        let first_prompt = first_warm["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached_tokens(&second_warm) >= first_prompt,
            "{setup:?}: turn two should resume at least from turn one's prompt ({first_prompt} tokens): {second_warm}"
        );
        assert_eq!(metric(&warm, "k3_prompt_cache_hits_total").await, 1);
        assert_eq!(metric(&warm, "k3_prompt_cache_misses_total").await, 1);
        assert_eq!(
            metric(&warm, "k3_prompt_cache_cached_tokens_total").await,
            cached_tokens(&second_warm)
        );
        assert!(metric(&warm, "k3_prompt_cache_bytes").await > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_system_prompt_resumes_other_conversations() {
    for setup in [
        PLAIN,
        Setup {
            threads: 2,
            fake_domains: Some(2),
            chunk: 1,
        },
    ] {
        let (cold, warm) = (cold(setup), warm(setup));
        chat(&warm, &turn_one()).await;
        let other = json!([system(), {"role": "user", "content": "Name a prime number."}]);
        let answer_warm = chat(&warm, &other).await;
        let answer_cold = chat(&cold, &other).await;
        assert_eq!(outcome(&answer_cold), outcome(&answer_warm), "{setup:?}");
        let block = system_tokens(&warm, &other);
        assert!(block > 0);
        assert_eq!(
            cached_tokens(&answer_warm),
            block as u64,
            "{setup:?}: the other conversation resumes at the end of the system block"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_request_in_a_batch_answers_as_a_cold_one() {
    let (cold, warm) = (cold(PLAIN), warm(PLAIN));
    let first = chat(&warm, &turn_one()).await;
    let second = turn_two(&first);
    let others = [
        json!([{"role": "user", "content": "Count to three."}]),
        json!([{"role": "user", "content": "Spell k3 backwards, slowly."}]),
    ];
    // The resumed request shares its decode steps with two cold ones.
    let (resumed, a, b) = tokio::join!(
        chat(&warm, &second),
        chat(&warm, &others[0]),
        chat(&warm, &others[1])
    );
    assert!(cached_tokens(&resumed) > 0);
    assert_eq!(outcome(&resumed), outcome(&chat(&cold, &second).await));
    assert_eq!(outcome(&a), outcome(&chat(&cold, &others[0]).await));
    assert_eq!(outcome(&b), outcome(&chat(&cold, &others[1]).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streamed_usage_chunk_reports_cached_tokens() {
    let warm = warm(PLAIN);
    let first = chat(&warm, &turn_one()).await;
    let body = json!({"model": "tiny", "messages": turn_two(&first), "max_tokens": 4,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = call(&warm, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk in {text}"));
    assert!(cached_tokens(&usage) > 0, "{usage}");
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("k3-serve-cache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_snapshots_survive_a_restart_and_a_corrupt_one_is_ignored() {
    let dir = TempDir::new("spill");
    let spilling = || {
        server(
            PLAIN,
            PromptCacheOptions {
                budget_bytes: 1 << 30,
                dir: Some(dir.0.clone()),
            },
        )
    };
    let cold = cold(PLAIN);
    let first = chat(&cold, &turn_one()).await;
    let second = turn_two(&first);
    let expected = outcome(&chat(&cold, &second).await);
    {
        let before = spilling();
        assert_eq!(outcome(&chat(&before, &turn_one()).await), outcome(&first));
    }
    let files = || -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        files
    };
    assert!(!files().is_empty(), "turn one's snapshots were spilled");

    // A restart over the same directory: turn two resumes from the files.
    let after = spilling();
    let replayed = chat(&after, &second).await;
    assert!(cached_tokens(&replayed) > 0, "{replayed}");
    assert_eq!(outcome(&replayed), expected);
    drop(after);

    // A flipped byte in the payload of every file: each is ignored (warned about), and the
    // turn is prefilled cold with the same answer.
    for path in files() {
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
    }
    let corrupt = spilling();
    let replayed = chat(&corrupt, &second).await;
    assert_eq!(cached_tokens(&replayed), 0, "no corrupt file is trusted");
    assert_eq!(outcome(&replayed), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_budget_evicts_and_stays_within_it() {
    let probe = cold(PLAIN);
    let prompt_tokens = chat(&probe, &turn_one()).await["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap() as usize;
    // Room for about two snapshots of a prompt this long.
    let budget = 2 * state_bytes(&probe.engine.config, prompt_tokens + 8);
    let tight = server(
        PLAIN,
        PromptCacheOptions {
            budget_bytes: budget,
            dir: None,
        },
    );
    for i in 0..6 {
        let messages =
            json!([{"role": "user", "content": format!("Conversation {i}: what is {i} squared?")}]);
        let answer = chat(&tight, &messages).await;
        assert_eq!(outcome(&answer), outcome(&chat(&probe, &messages).await));
        assert!(metric(&tight, "k3_prompt_cache_bytes").await as usize <= budget);
    }
    assert!(metric(&tight, "k3_prompt_cache_evictions_total").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_holds_the_system_block_prompt_and_answer_states() {
    let warm = warm(PLAIN);
    let answer = chat(&warm, &turn_one()).await;
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let generated = answer["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(
        generated > 1,
        "the answer must have been fed to the session: {answer}"
    );
    let system = system_tokens(&warm, &turn_one());
    let config = &warm.engine.config;
    // Snapshots at the end of the system block, of the prompt, and of the answer (every
    // token but the last sampled one was fed), each of the size the config gives.
    let expected = state_bytes(config, system)
        + state_bytes(config, prompt)
        + state_bytes(config, prompt + generated - 1);
    assert_eq!(
        metric(&warm, "k3_prompt_cache_bytes").await as usize,
        expected
    );
}
