//! The cache's bytes and budget through the server: the snapshots a chat turn leaves (the
//! system block, the prompt, the answer) are the sizes the config gives, a tiny budget evicts
//! and stays within it (acceptance 3; the 200-conversation stream and the eviction order are
//! the cache's unit tests), and a streamed answer's usage chunk reports the cached tokens.

use k3_model::model::snapshot::state_bytes;
use k3_serve::engine::PromptCacheOptions;
use serde_json::json;

use super::{
    PLAIN, cached_tokens, call, chat, chat_ids, cold, metric, outcome, prompt_tokens, server,
    turn_one, turn_two, warm,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_budget_evicts_and_stays_within_it() {
    let probe = cold();
    let prompt = prompt_tokens(&chat(probe, &turn_one()).await) as usize;
    // Room for about two snapshots of a prompt this long.
    let budget = 2 * state_bytes(&probe.engine.config, prompt + 8);
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
        assert_eq!(outcome(&answer), outcome(&chat(probe, &messages).await));
        assert!(metric(&tight, "k3_prompt_cache_bytes").await as usize <= budget);
    }
    assert!(metric(&tight, "k3_prompt_cache_evictions_total").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_holds_the_system_block_prompt_and_answer_states() {
    let warm = warm(PLAIN);
    let answer = chat(&warm, &turn_one()).await;
    let prompt = prompt_tokens(&answer) as usize;
    let generated = answer["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(
        generated > 1,
        "the answer must have been fed to the session: {answer}"
    );
    let (_, system) = chat_ids(&warm, &turn_one());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streamed_usage_chunk_reports_cached_tokens() {
    let warm = warm(PLAIN);
    let first = chat(&warm, &turn_one()).await;
    let body = json!({"model": "tiny", "messages": turn_two(&first), "max_tokens": 4,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = call(&warm, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, axum::http::StatusCode::OK, "{text}");
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk in {text}"));
    assert!(cached_tokens(&usage) > 0, "{usage}");
}
