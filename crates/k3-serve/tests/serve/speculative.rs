//! Speculative decoding changes no output: the same request on an engine with `--spec ngram`
//! and on one without gives the same text, log-probabilities (with alternatives) and finish
//! reason, greedy and seeded at temperature 1 — alone, batched, resumed from the prompt cache,
//! with two (fake) NUMA domains and with the expert store reading every expert on use. The
//! answers are scripted to copy a stretch of their prompt and then leave it (the engine's test
//! hook forces them token by token, each with its log-probability under the logits), so drafts
//! are accepted and rejected in the same request; sampling takes over where the script ends.
//! A stop string and `max_tokens` land inside an accepted run.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use k3_model::experts::ExpertOptions;
use k3_serve::engine::{EngineConfig, SpecOptions, prompt_ids};
use k3_serve::server::AppState;
use serde_json::{Value, json};

use crate::router::{call, config, state_unready};

/// The prompt: a block of text written twice, so its second half is what an n-gram drafter
/// predicts from the first.
const BLOCK: &str = "fn area(w: u32, h: u32) -> u32 {\n    let a = w * h;\n    a\n}\n";

fn prompt() -> String {
    format!("Repeat this code, then rename w to width:\n{BLOCK}\nHere it is:\n")
}

/// An engine on the tiny checkpoint, speculating or not, whose answer to [`prompt`] is
/// scripted: the block's first 40 tokens copied (drafts from the prompt are accepted), then
/// 6 tokens of its own (they are rejected), then the block's tokens again; sampling resumes
/// after that.
fn engine(speculate: bool, setup: impl FnOnce(&mut EngineConfig)) -> AppState {
    engine_on(&crate::tiny(), speculate, setup)
}

/// [`engine`] on the checkpoint in `dir`.
fn engine_on(
    dir: &std::path::Path,
    speculate: bool,
    setup: impl FnOnce(&mut EngineConfig),
) -> AppState {
    let experts = ExpertOptions {
        usage_cache: false,
        ..ExpertOptions::default()
    };
    let mut engine = config(dir.to_path_buf(), experts, 64, 8, 2048);
    engine.step_tokens = 64;
    engine.options.pool.threads = Some(2);
    engine.spec = SpecOptions {
        ngram: speculate,
        ..SpecOptions::default()
    };
    setup(&mut engine);
    let tokenizer = k3_model::tokenizer::Tokenizer::from_dir(dir).unwrap();
    let ids = prompt_ids(&tokenizer, &k3_serve::api::Prompt::Text(prompt()));
    let block = tokenizer.encode(BLOCK, false);
    let mut script: Vec<u32> = block.iter().copied().take(40).collect();
    script.extend([7, 8, 9, 10, 11, 12]);
    script.extend(&block);
    engine.scripted_answers = vec![(ids, script)];
    let state = state_unready(engine, 2048);
    if let Err(e) = state.engine.wait_loaded(Some(Duration::from_secs(900))) {
        panic!("the engine did not load: {e}");
    }
    state
}

/// A completion of [`prompt`] (or `text`) with the top-5 log-probabilities: its choice
/// (text, logprobs, finish reason).
async fn complete(state: &AppState, text: Option<&str>, extra: Value) -> Value {
    let mut body = json!({
        "prompt": text.map_or_else(prompt, str::to_owned),
        "max_tokens": 96, "logprobs": 5,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, out) = call(state, "POST", "/v1/completions", Some(body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["choices"][0].clone()
}

/// The requests compared: greedy and temperature 1 with seeds, a stop string inside the
/// copied block, `max_tokens` ending inside it, and one that turns speculation off.
fn requests() -> Vec<Value> {
    let mut r = vec![json!({"temperature": 0})];
    for seed in 0..3 {
        r.push(json!({"temperature": 1, "seed": seed}));
    }
    r.push(json!({"temperature": 0, "stop": ["* h"]}));
    r.push(json!({"temperature": 1, "seed": 5, "max_tokens": 23}));
    r.push(json!({"temperature": 1, "seed": 6, "speculative": false}));
    r
}

fn spec_counts(state: &AppState) -> (u64, u64, u64) {
    let m = &state.engine.metrics;
    (
        m.spec_drafted.load(Ordering::Relaxed),
        m.spec_accepted.load(Ordering::Relaxed),
        m.spec_passes.load(Ordering::Relaxed),
    )
}

/// Drafts were made, some accepted and some rejected.
fn assert_drafts_accepted_and_rejected(state: &AppState) {
    let (drafted, accepted, passes) = spec_counts(state);
    assert!(passes > 0, "no verify pass");
    assert!(accepted > 0, "no draft accepted ({drafted} drafted)");
    assert!(accepted < drafted, "no draft rejected ({drafted} drafted)");
}

async fn identity_with(setup: impl Fn(&mut EngineConfig)) {
    let off = engine(false, &setup);
    let on = engine(true, &setup);
    for extra in requests() {
        let want = complete(&off, None, extra.clone()).await;
        let got = complete(&on, None, extra.clone()).await;
        assert_eq!(got, want, "request {extra}");
        assert!(!want["logprobs"]["tokens"].as_array().unwrap().is_empty());
    }
    assert_drafts_accepted_and_rejected(&on);
    assert_eq!(spec_counts(&off), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_changes_no_token_logprob_or_finish() {
    identity_with(|_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_changes_nothing_with_two_domains() {
    identity_with(|engine| engine.options.pool.fake_domains = Some(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_changes_nothing_with_the_expert_store_reading_on_use() {
    identity_with(|engine| engine.options.experts.cache_experts = Some(0)).await;
}

/// Under a memory budget that holds about half the trunk, so the rest streams from disk each
/// step (the verify pass reads it once; a rollback reads no matrix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_changes_nothing_under_a_budget_that_streams_the_trunk() {
    let dir = crate::tiny();
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let model_config = k3_model::config::K3Config::from_json(&text).unwrap();
    let ckpt = expert_store::Checkpoint::open(&dir).unwrap();
    let sizes = k3_model::plan::WeightSizes::new(&ckpt, &model_config).unwrap();
    // The minimum the plan needs for 8 sequences of 2048 tokens (KV cache, KDA state,
    // buffers: 10.5 MB on tiny), and half the trunk.
    let budget = sizes.trunk_resident_bytes() / 2 + 12_000_000;
    identity_with(move |engine| engine.options.memory_bytes = Some(budget)).await;
}

/// Several requests in the same steps, each with its drafts: every answer is its answer alone
/// without speculation; the steps did batch them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_speculating_requests_get_their_answers_alone() {
    let off = engine(false, |_| {});
    let on = engine(true, |_| {});
    let cases = requests();
    let mut alone = Vec::new();
    for extra in &cases {
        alone.push(complete(&off, None, extra.clone()).await);
    }
    let mut tasks = Vec::new();
    for extra in cases.clone() {
        let on = on.clone();
        tasks.push(tokio::spawn(
            async move { complete(&on, None, extra).await },
        ));
    }
    for ((task, want), extra) in tasks.into_iter().zip(&alone).zip(&cases) {
        assert_eq!(&task.await.unwrap(), want, "request {extra}");
    }
    assert_drafts_accepted_and_rejected(&on);
    let m = &on.engine.metrics;
    let steps = m.steps.load(Ordering::Relaxed);
    let decoded = m.step_decode_tokens.load(Ordering::Relaxed);
    assert!(decoded > steps, "{decoded} decode tokens in {steps} steps");
}

/// A chat's second turn resumes from the prompt cache's snapshot of the first answer and
/// speculates from there: the same answers as an engine without speculation (and its cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_conversation_speculates_to_the_same_answers() {
    let with_cache = |engine: &mut EngineConfig| {
        engine.prompt_cache.budget_bytes = 64 << 20;
    };
    let off = engine(false, with_cache);
    let on = engine(true, with_cache);
    for temperature in [0, 1] {
        let first = json!({"temperature": temperature, "seed": 3, "max_tokens": 48});
        let a_off = complete(&off, None, first.clone()).await;
        let a_on = complete(&on, None, first.clone()).await;
        assert_eq!(a_on, a_off, "first turn, temperature {temperature}");
        let next = format!(
            "{}{}\nAgain:\n{BLOCK}",
            prompt(),
            a_off["text"].as_str().unwrap()
        );
        let b_off = complete(&off, Some(&next), first.clone()).await;
        let b_on = complete(&on, Some(&next), first).await;
        assert_eq!(b_on, b_off, "second turn, temperature {temperature}");
    }
    let cached = |state: &AppState| {
        state
            .engine
            .metrics
            .prompt_cache
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |s| s.hits)
    };
    assert!(cached(&on) > 0, "the second turns did not resume");
    let (drafted, _, _) = spec_counts(&on);
    assert!(drafted > 0);
}

/// The same on a real-width checkpoint (`K3_SPEC_MODEL`, e.g. a k3-wide slice), in release:
/// `K3_SPEC_MODEL=/path/k3-wide cargo test --release -p k3-serve --test serve
/// speculative::on_a_checkpoint -- --ignored --nocapture`. Alone (greedy, seeded temperature 1,
/// a stop string and `max_tokens` inside the copied block), batched, with two domains and with
/// the expert store reading every expert on use; fewer tokens than on tiny.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs K3_SPEC_MODEL; minutes in release"]
async fn on_a_checkpoint() {
    let dir = std::path::PathBuf::from(std::env::var("K3_SPEC_MODEL").expect("K3_SPEC_MODEL"));
    let short = |mut extra: Value| {
        if extra.get("max_tokens").is_none() {
            extra["max_tokens"] = json!(40);
        }
        extra
    };
    let cases: Vec<Value> = [
        json!({"temperature": 0}),
        json!({"temperature": 1, "seed": 1}),
        json!({"temperature": 0, "stop": ["* h"]}),
        json!({"temperature": 1, "seed": 5, "max_tokens": 23}),
    ]
    .into_iter()
    .map(short)
    .collect();
    type Setup = fn(&mut EngineConfig);
    let setups: [(&str, Setup); 3] = [
        ("one domain", |_| {}),
        ("two domains", |e| e.options.pool.fake_domains = Some(2)),
        ("expert store, cache 0", |e| {
            e.options.experts.cache_experts = Some(0)
        }),
    ];
    for (name, setup) in setups {
        let started = std::time::Instant::now();
        let off = engine_on(&dir, false, setup);
        let mut want = Vec::new();
        for extra in &cases {
            want.push(complete(&off, None, extra.clone()).await);
        }
        drop(off);
        let on = engine_on(&dir, true, setup);
        for (extra, want) in cases.iter().zip(&want) {
            assert_eq!(
                &complete(&on, None, extra.clone()).await,
                want,
                "{name}: {extra}"
            );
        }
        // Batched: all at once.
        let mut tasks = Vec::new();
        for extra in cases.clone() {
            let on = on.clone();
            tasks.push(tokio::spawn(
                async move { complete(&on, None, extra).await },
            ));
        }
        for ((task, want), extra) in tasks.into_iter().zip(&want).zip(&cases) {
            assert_eq!(&task.await.unwrap(), want, "{name}, batched: {extra}");
        }
        assert_drafts_accepted_and_rejected(&on);
        let (drafted, accepted, passes) = spec_counts(&on);
        println!(
            "{name}: identical; {accepted}/{drafted} drafts accepted in {passes} verify passes \
             ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
    }
}
