//! The step scheduler (issue 32, acceptance 1): a request's tokens and log-probabilities are
//! the same bits whether it runs alone or shares its steps with decoding streams and other
//! prompts' chunks, with any `--step-tokens`; a prompt resumed from the prompt cache in a
//! mixed batch answers as a cold one alone; a prefill whose client goes away stops at the
//! next step boundary and frees its slot.
//!
//! "The same bits": the greedy text and, for every generated token, the top-5
//! log-probabilities as the completions API reports them (a logit bit that differs among the
//! top 5, or in the log-sum-exp, changes them).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use k3_model::experts::ExpertOptions;
use k3_serve::engine::{PromptCacheOptions, wait_ready};
use k3_serve::server::AppState;
use serde_json::{Value, json};

use crate::router::{call, config, state_unready};

const CONTEXT: usize = 1024;

/// An engine over `tiny` with `step_tokens` and room for 4 sequences.
fn engine(step_tokens: usize, cache: PromptCacheOptions) -> AppState {
    let experts = ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    };
    let mut c = config(crate::tiny(), experts, 16, 4, CONTEXT);
    c.step_tokens = step_tokens;
    c.prompt_cache = cache;
    let s = state_unready(c, CONTEXT);
    assert!(wait_ready(&s.engine, Duration::from_secs(60)));
    s
}

/// A prompt of `words` words (about 4 tokens each), different for each `seed`.
fn long_prompt(words: usize, seed: usize) -> String {
    (0..words)
        .map(|i| ["alpha", "beta", "gamma", "delta", "omega"][(i * 7 + seed) % 5])
        .collect::<Vec<_>>()
        .join(" ")
}

fn completion(prompt: &str, max_tokens: usize) -> String {
    json!({
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 5,
    })
    .to_string()
}

/// The text and the logprobs of a completion's answer (what must not change), and its usage.
async fn answer(s: &AppState, body: String) -> (Value, Value) {
    let (status, text) = call(s, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let choice = &v["choices"][0];
    assert!(
        choice["logprobs"]["token_logprobs"].as_array().is_some(),
        "{text}"
    );
    (
        json!({"text": choice["text"], "logprobs": choice["logprobs"]}),
        v["usage"].clone(),
    )
}

/// Waits until `check` holds (the engine thread runs on its own).
async fn until(what: &str, check: impl Fn() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < Duration::from_secs(60), "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_answers_the_same_alone_or_sharing_steps_with_any_step_budget() {
    // Two streams that decode throughout, and two prompts that arrive while they do.
    let streams = [completion("Once upon", 40), completion("The weather", 40)];
    let prompts = [
        completion(&long_prompt(75, 1), 8),
        completion(&long_prompt(42, 2), 8),
    ];
    // Each alone, on an idle engine, in steps as large as a kernel call takes.
    let idle = engine(64, PromptCacheOptions::default());
    let mut alone = Vec::new();
    for body in streams.iter().chain(&prompts) {
        alone.push(answer(&idle, body.clone()).await.0);
    }
    drop(idle);

    for step_tokens in [1, 3, 17, 64] {
        let s = engine(step_tokens, PromptCacheOptions::default());
        let metrics = &s.engine.metrics;
        let decoding: Vec<_> = streams
            .iter()
            .map(|body| {
                let (s, body) = (s.clone(), body.clone());
                tokio::spawn(async move { answer(&s, body).await })
            })
            .collect();
        // The prompts arrive once both streams have produced tokens.
        until("both streams decoding", || {
            metrics.generated_tokens.load(Ordering::Relaxed) >= 4
        })
        .await;
        let prefilling: Vec<_> = prompts
            .iter()
            .map(|body| {
                let (s, body) = (s.clone(), body.clone());
                tokio::spawn(async move { answer(&s, body).await })
            })
            .collect();
        let mut shared = Vec::new();
        for task in decoding.into_iter().chain(prefilling) {
            shared.push(task.await.unwrap().0);
        }
        for (i, (a, b)) in alone.iter().zip(&shared).enumerate() {
            assert_eq!(a, b, "request {i} with --step-tokens {step_tokens}");
        }
        // The prompts' chunks shared steps with the decodes: fewer steps than tokens fed.
        let steps = metrics.steps.load(Ordering::Relaxed);
        let fed = metrics.step_decode_tokens.load(Ordering::Relaxed)
            + metrics.step_prefill_tokens.load(Ordering::Relaxed);
        assert!(steps < fed, "{steps} steps fed {fed} tokens");
        if step_tokens > 2 {
            assert!(
                metrics.step_prefill_tokens.load(Ordering::Relaxed) >= 400,
                "the two prompts were prefilled by the steps"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prompt_resumed_from_the_cache_in_a_mixed_batch_answers_as_cold_alone() {
    let prompt = long_prompt(50, 3);
    let extended = format!("{prompt} and then some more words at the end");
    let cold = engine(64, PromptCacheOptions::default());
    let (cold_answer, _) = answer(&cold, completion(&extended, 8)).await;
    drop(cold);

    let cache = PromptCacheOptions {
        budget_bytes: 256 << 20,
        dir: None,
    };
    let s = engine(5, cache);
    // The first request leaves a snapshot at its prompt's end.
    answer(&s, completion(&prompt, 2)).await;
    let stream = {
        let s = s.clone();
        tokio::spawn(async move { answer(&s, completion("A stream", 30)).await })
    };
    until("the stream decoding", || {
        s.engine.metrics.generated_tokens.load(Ordering::Relaxed) >= 4
    })
    .await;
    let (resumed, usage) = answer(&s, completion(&extended, 8)).await;
    stream.await.unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 150,
        "resumed from the first prompt's snapshot: {usage}"
    );
    assert_eq!(resumed, cold_answer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_whose_client_goes_away_stops_at_the_next_step() {
    // One prompt token a step: a prompt of about 600 tokens takes as many steps to prefill.
    let s = engine(1, PromptCacheOptions::default());
    let metrics = &s.engine.metrics;
    let body = completion(&long_prompt(150, 4), 4);
    let gone = {
        let s = s.clone();
        tokio::spawn(async move { call(&s, "POST", "/v1/completions", Some(body)).await })
    };
    until("the prefill under way", || {
        metrics.step_prefill_tokens.load(Ordering::Relaxed) >= 20
    })
    .await;
    gone.abort();
    until("the sequence gone", || {
        metrics.active.load(Ordering::Relaxed) == 0
    })
    .await;
    let fed = metrics.step_prefill_tokens.load(Ordering::Relaxed);
    assert!(fed < 500, "the prefill ran on to {fed} tokens");
    // Nothing more is fed for it, and the engine serves the next request as if alone.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(metrics.step_prefill_tokens.load(Ordering::Relaxed), fed);
    let next = completion("After the cancel", 6);
    let (after, _) = answer(&s, next.clone()).await;
    let fresh = engine(64, PromptCacheOptions::default());
    assert_eq!(after, answer(&fresh, next).await.0);
}
