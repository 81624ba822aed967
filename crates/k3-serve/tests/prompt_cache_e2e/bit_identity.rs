//! Issue 18, acceptance 1, one test per case: a request that extends a cached prefix (the
//! same chat plus a new user turn; another conversation with the same system prompt) answers
//! exactly as the cold server, with 1 or 2 threads, a fake 2-domain pool, prefill chunks of
//! 1, 7 and 64 tokens, routed experts from the expert store, all of these at once, and while
//! sharing its decode steps with other requests.

use serde_json::{Value, json};
use tokio::sync::OnceCell;

use super::{
    PLAIN, Setup, cached_tokens, chat, chat_ids, chat_n, cold, metric, other_conversation, outcome,
    prompt_tokens, turn_one, turn_two, warm,
};

/// The cold server's answers every case is compared with.
struct Reference {
    first: Value,
    /// Turn two, built from the cold turn one (every warm turn one must equal it).
    second_messages: Value,
    second: Value,
    other: Value,
}

async fn reference() -> &'static Reference {
    static REFERENCE: OnceCell<Reference> = OnceCell::const_new();
    REFERENCE
        .get_or_init(|| async {
            let cold = cold();
            let first = chat(cold, &turn_one()).await;
            let second_messages = turn_two(&first);
            let second = chat(cold, &second_messages).await;
            let other = chat(cold, &other_conversation()).await;
            for answer in [&first, &second, &other] {
                assert_eq!(cached_tokens(answer), 0, "the cold server caches nothing");
            }
            Reference {
                first,
                second_messages,
                second,
                other,
            }
        })
        .await
}

/// Turn one, then turn two on a server with the cache: turn two resumes (at least from turn
/// one's prompt) and both answer as the cold server.
async fn next_turn(setup: Setup) {
    let reference = reference().await;
    let warm = warm(setup);
    let first = chat(&warm, &turn_one()).await;
    assert_eq!(
        outcome(&first),
        outcome(&reference.first),
        "{setup:?}: turn one"
    );
    assert_eq!(cached_tokens(&first), 0, "nothing cached yet");
    let second = chat(&warm, &reference.second_messages).await;
    assert_eq!(
        outcome(&second),
        outcome(&reference.second),
        "{setup:?}: turn two"
    );
    assert!(
        cached_tokens(&second) >= prompt_tokens(&first),
        "{setup:?}: turn two should resume at least from turn one's prompt ({} tokens): {second}",
        prompt_tokens(&first)
    );
    assert_eq!(metric(&warm, "k3_prompt_cache_hits_total").await, 1);
    assert_eq!(metric(&warm, "k3_prompt_cache_misses_total").await, 1);
    assert_eq!(
        metric(&warm, "k3_prompt_cache_cached_tokens_total").await,
        cached_tokens(&second)
    );
    if setup.expert_cache.is_some() {
        assert!(
            metric(&warm, "k3_expert_cache_misses_total").await > 0,
            "{setup:?}: the experts did not come from the store"
        );
    }
}

/// Turn one of a chat, then another conversation with the same system prompt: it resumes
/// from the end of the system block and answers as the cold server.
async fn shared_system(setup: Setup) {
    let reference = reference().await;
    let warm = warm(setup);
    chat(&warm, &turn_one()).await;
    let answer = chat(&warm, &other_conversation()).await;
    assert_eq!(outcome(&answer), outcome(&reference.other), "{setup:?}");
    let (_, block) = chat_ids(&warm, &other_conversation());
    assert!(block > 0);
    assert_eq!(
        cached_tokens(&answer),
        block as u64,
        "{setup:?}: the other conversation resumes at the end of the system block"
    );
}

macro_rules! cases {
    ($($name:ident = $setup:expr;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_next_turn_answers_as_a_cold_server() {
                next_turn($setup).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_conversation_with_the_same_system_prompt_answers_as_a_cold_server() {
                shared_system($setup).await;
            }
        }
    )*};
}

cases! {
    threads_1 = PLAIN;
    threads_2 = Setup { threads: 2, ..PLAIN };
    numa_fake_2 = Setup { threads: 2, fake_domains: Some(2), ..PLAIN };
    chunk_1 = Setup { chunk: 1, ..PLAIN };
    chunk_7 = Setup { chunk: 7, ..PLAIN };
    chunk_64 = Setup { chunk: 64, ..PLAIN };
    // Two experts resident per layer: most are read from the files as they are routed to.
    expert_store = Setup { expert_cache: Some(2), ..PLAIN };
    all_at_once = Setup { threads: 2, fake_domains: Some(2), chunk: 7, expert_cache: Some(2) };
}

/// Long answers (to be running when the resumed request arrives) of two unrelated chats.
const OTHERS_TOKENS: usize = 200;

fn others() -> [Value; 2] {
    [
        json!([{"role": "user", "content": "Count to three."}]),
        json!([{"role": "user", "content": "Spell k3 backwards, slowly."}]),
    ]
}

/// `resumed` (which extends a prefix `prime` caches) joins a batch of two long unrelated
/// answers already decoding on a server with the cache; all three answer as cold.
async fn batched(prime: Value, resumed: Value, expected: &Value, what: &str) {
    let warm = warm(PLAIN);
    chat(&warm, &prime).await;
    let [a, b] = others();
    let running = [a.clone(), b.clone()].map(|messages| {
        let warm = warm.clone();
        tokio::spawn(async move { chat_n(&warm, &messages, OTHERS_TOKENS).await })
    });
    let started = std::time::Instant::now();
    while metric(&warm, "k3_active_sequences").await < 2 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the two long answers did not start"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let answer = chat(&warm, &resumed).await;
    assert!(
        running.iter().all(|r| !r.is_finished()),
        "{what}: the long answers ended before the resumed request did, so it was not batched"
    );
    assert!(cached_tokens(&answer) > 0, "{what}: {answer}");
    assert_eq!(outcome(&answer), outcome(expected), "{what}");
    let cold = cold();
    for (handle, messages) in running.into_iter().zip([a, b]) {
        let got = handle.await.unwrap();
        assert_eq!(
            outcome(&got),
            outcome(&chat_n(cold, &messages, OTHERS_TOKENS).await),
            "{what}: an unrelated request batched with it"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_a_next_turn_answers_as_a_cold_server() {
    let reference = reference().await;
    batched(
        turn_one(),
        reference.second_messages.clone(),
        &reference.second,
        "next turn",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_a_conversation_with_the_same_system_prompt_answers_as_a_cold_server() {
    let reference = reference().await;
    batched(
        turn_one(),
        other_conversation(),
        &reference.other,
        "same system prompt",
    )
    .await;
}
