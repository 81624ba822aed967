//! A next turn resumes from the snapshot the engine keeps at the end of the previous answer
//! (the prompt and every output token but the last: what the session consumed).
//!
//! Whether a chat's next turn finds that snapshot depends on the client's re-rendered answer
//! being the generated tokens. It is for an answer written in the template's form (tested
//! here: the parser's reasoning and content, sent back, render to the same tokens). The
//! `tiny` model's answers are not in that form (cut by `max_tokens` inside `think`, and its
//! random tokens are not the tokenizer's own encoding of their text), so with it a chat's
//! turn two resumes from the end of turn one's prompt; the chat test computes which snapshot
//! applies from the tokens instead of assuming it. A client that sends back the generated
//! tokens themselves (a continuation) resumes from the end of the answer.

use std::path::Path;
use std::time::Instant;

use expert_store::Checkpoint;
use k3_model::chat::{Delta, OutputParser};
use k3_model::config::K3Config;
use k3_model::model::Model;
use k3_model::sampling::{Sampler, SamplingParams};
use k3_serve::engine::{Event, Job, TokenLogprob};
use k3_serve::server::AppState;
use mxfp4_kernels::Kernels;
use serde_json::{Value, json};

use super::{
    PLAIN, cached_tokens, chat, chat_ids, cold, metric, outcome, tiny, turn_one, turn_two, warm,
};

/// The tokens that end an answer besides `max_tokens` (the engine's own list).
fn ends(state: &AppState) -> Vec<u32> {
    ["<|end_of_msg|>", "[EOS]"]
        .iter()
        .filter_map(|s| state.engine.tokenizer.special(s))
        .collect()
}

/// The greedy answer to `prompt` computed by the model itself (no engine, no cache): at most
/// `max` tokens, ending at the first of `ends`.
fn greedy(dir: &Path, prompt: &[u32], max: usize, ends: &[u32]) -> Vec<u32> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = K3Config::from_json(&text).unwrap();
    let model = Model::new(&ckpt, &config, Kernels::detect()).unwrap();
    let mut session = model.session();
    let mut sampler = Sampler::new(
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        prompt,
    );
    let ids: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let mut logits = model.prefill(&mut session, &ids, 8).unwrap();
    let mut out = Vec::new();
    loop {
        let token = sampler.sample(&logits).token;
        out.push(token);
        if out.len() == max || ends.contains(&token) {
            return out;
        }
        logits = model.decode_step(&mut session, token as usize).unwrap();
    }
}

/// A plain-text job's answer, taken from the engine's events.
#[derive(Debug, PartialEq)]
struct Answer {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
}

impl Answer {
    /// What must be the same bits with and without the cache.
    fn outcome(&self) -> (&str, &[TokenLogprob], &str, usize, usize) {
        (
            &self.text,
            &self.logprobs,
            self.finish,
            self.prompt_tokens,
            self.completion_tokens,
        )
    }
}

/// Runs a greedy plain-text job over exactly `ids` (at most `max_tokens` out, the top-20
/// log-probabilities of each) on `state`'s engine.
async fn job(state: &AppState, ids: Vec<u32>, max_tokens: usize) -> Answer {
    let request: k3_serve::api::CompletionRequest = serde_json::from_value(json!({
        "model": "tiny", "prompt": "(the job's ids are given)", "max_tokens": max_tokens,
        "temperature": 0, "logprobs": 5}))
    .unwrap();
    let mut request = request.validate(&state.limits).unwrap();
    // The completions API caps alternatives at 5; the engine takes any count, and 20 of them
    // show more of the logits.
    request.sampling.top_logprobs = 20;
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
            submitted: Instant::now(),
            state: Default::default(),
            grammar: None,
        })
        .unwrap();
    let (mut text, mut logprobs) = (String::new(), Vec::new());
    loop {
        match received.recv().await.expect("the engine ends every job") {
            Event::Delta {
                content,
                logprobs: more,
                ..
            } => {
                text.push_str(&content);
                logprobs.extend(more);
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                return Answer {
                    text,
                    logprobs,
                    finish: finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                };
            }
            Event::Error(e) => panic!("the job failed: {e}"),
        }
    }
}

/// The engine's answer is the model's greedy one, token for token (by each token's text).
fn assert_tokens(state: &AppState, logprobs: &[String], expected: &[u32]) {
    let texts: Vec<String> = expected
        .iter()
        .map(|&t| state.engine.tokenizer.decode(&[t]))
        .collect();
    assert_eq!(
        logprobs, texts,
        "the engine's answer is not the model's greedy one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_resumes_from_the_end_of_the_answer() {
    let warm = warm(PLAIN);
    let tokenizer = &warm.engine.tokenizer;
    let prompt = tokenizer.encode("Once upon a time, in a village by the sea,", false);
    let first = job(&warm, prompt.clone(), 6).await;
    let answer = greedy(&tiny(), &prompt, 6, &ends(&warm));
    let chosen: Vec<String> = first.logprobs.iter().map(|l| l.token.clone()).collect();
    assert_tokens(&warm, &chosen, &answer);
    assert!(
        answer.len() >= 2,
        "an answer of one token is not fed to the session: {answer:?}"
    );
    // The client sends back the prompt, the answer's tokens and more.
    let mut next = prompt.clone();
    next.extend(&answer);
    next.extend(tokenizer.encode(" The end came quickly.", false));
    let resumed = job(&warm, next.clone(), 6).await;
    assert_eq!(
        resumed.cached_tokens,
        prompt.len() + answer.len() - 1,
        "the next request resumes where the answer's session stopped (its last token unfed)"
    );
    let cold_answer = job(cold(), next, 6).await;
    assert_eq!(cold_answer.cached_tokens, 0);
    assert_eq!(resumed.outcome(), cold_answer.outcome());
    assert_eq!(metric(&warm, "k3_prompt_cache_hits_total").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_turn_resumes_from_the_longest_snapshot_its_rendering_extends() {
    let warm = warm(PLAIN);
    let first = chat(&warm, &turn_one()).await;
    let (prompt, system) = chat_ids(&warm, &turn_one());
    let answer = greedy(&tiny(), &prompt, 8, &ends(&warm));
    let chosen: Vec<String> = first["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["token"].as_str().unwrap().to_owned())
        .collect();
    assert_tokens(&warm, &chosen, &answer);
    // The snapshots the engine kept: the system block, the prompt, the answer (all but its
    // last token).
    let mut fed = prompt.clone();
    fed.extend(&answer[..answer.len() - 1]);
    let kept = [&prompt[..system], &prompt[..], &fed[..]];
    let second = turn_two(&first);
    let (next, _) = chat_ids(&warm, &second);
    // The longest kept prefix of all of turn two's tokens but its last.
    let expected = kept
        .iter()
        .filter(|k| k.len() < next.len() && next.starts_with(k))
        .map(|k| k.len())
        .max()
        .unwrap();
    let answer_rerendered = next.starts_with(&fed);
    eprintln!(
        "turn two ({} tokens) extends turn one's answer as generated: {answer_rerendered}; \
         it resumes from {expected} tokens (prompt {}, answer's end {})",
        next.len(),
        prompt.len(),
        fed.len()
    );
    let resumed = chat(&warm, &second).await;
    assert_eq!(cached_tokens(&resumed), expected as u64);
    assert_eq!(outcome(&resumed), outcome(&chat(cold(), &second).await));
}

/// An answer in the template's form (what a trained model writes after the generation
/// prompt: reasoning, the think closer, the response, the message closer, `<|end_of_msg|>`),
/// parsed into reasoning and content as the engine streams them and sent back by the client,
/// renders to exactly the generated tokens: so the next turn extends the snapshot kept at the
/// end of the answer.
#[test]
fn an_answer_in_the_templates_form_renders_back_to_its_tokens() {
    let state = cold();
    let tokenizer = &state.engine.tokenizer;
    let (prompt, _) = chat_ids(state, &turn_one());
    let assistant = |reasoning: &str, content: &str| -> Value {
        json!({"role": "assistant", "reasoning_content": reasoning, "content": content})
    };
    let with_answer = |message: Value| -> Vec<u32> {
        let mut messages = turn_one();
        let list = messages.as_array_mut().unwrap();
        list.push(message);
        list.push(json!({"role": "user", "content": "And why is it exact?"}));
        chat_ids(state, &messages).0
    };
    let end = tokenizer.special("<|end_of_msg|>").unwrap();
    for (reasoning, content) in [
        (
            "The user asks what a prompt cache is.",
            "It reuses saved state, exactly.",
        ),
        (
            "Short.\nTwo lines; é and 漢字 too.",
            "A cache of model state keyed by tokens.",
        ),
    ] {
        let rendered = with_answer(assistant(reasoning, content));
        assert!(rendered.starts_with(&prompt));
        // What the model generates: turn one's rendering after its prompt, up to and with
        // `<|end_of_msg|>`.
        let generated = &rendered[prompt.len()..];
        let stop = generated.iter().position(|&t| t == end).unwrap();
        let generated = &generated[..=stop];
        // The engine's parser, fed as the engine feeds it (the end token is not pushed).
        let mut parser = OutputParser::new(tokenizer, true).unwrap();
        let (mut got_reasoning, mut got_content) = (String::new(), String::new());
        for &token in &generated[..stop] {
            for delta in parser.push(token, &tokenizer.decode_bytes(&[token])) {
                match delta {
                    Delta::Reasoning(t) => got_reasoning.push_str(&t),
                    Delta::Content(t) => got_content.push_str(&t),
                    Delta::ToolCall(c) => panic!("no call was written: {c:?}"),
                }
            }
        }
        assert_eq!(
            (got_reasoning.as_str(), got_content.as_str()),
            (reasoning, content)
        );
        let again = with_answer(assistant(&got_reasoning, &got_content));
        let mut fed = prompt.clone();
        fed.extend(&generated[..generated.len() - 1]);
        assert!(
            again.starts_with(&fed) && again.len() > fed.len(),
            "the re-rendered answer is not the generated tokens"
        );
    }
}
