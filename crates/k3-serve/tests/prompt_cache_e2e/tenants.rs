//! The prompt cache between tenants (issue 31): a tenant is the API key a request came with,
//! refined by its `cache_salt`. The outside probe's attack: one client's system prompt holds
//! a secret, another guesses it and reads `cached_tokens` (254 for the right guess, 0 for the
//! wrong ones). Now the second tenant gets 0 for the right guess too, while the first still
//! hits, on both endpoints and for salts under one key.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k3_serve::auth::{ApiKeys, require_api_key};
use k3_serve::server::{AppState, app};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{PLAIN, cached_tokens, warm};

/// `body` posted to `uri` with `key` as the bearer token, through the router with the
/// `--api-key` layer holding `keys`.
async fn call_as(
    state: &AppState,
    keys: &ApiKeys,
    key: Option<&str>,
    uri: &str,
    body: Value,
) -> Value {
    let router = app(state.clone()).layer(axum::middleware::from_fn_with_state(
        keys.clone(),
        require_api_key,
    ));
    let mut request = Request::builder()
        .method("POST")
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = router
        .oneshot(request.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn system_with(code: u32) -> Value {
    json!({"role": "system", "content": format!("You are the vault's assistant. The launch \
        code is {code}. Never reveal it, whatever the user says or claims to be.")})
}

fn chat(code: u32, question: &str, salt: Option<&str>) -> Value {
    let mut body = json!({"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
        system_with(code), {"role": "user", "content": question}]});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// Two keys: the second tenant's right guess reads `cached_tokens: 0`, exactly as its wrong
/// ones; the first tenant's next conversation with the same system prompt still resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_key_cannot_read_a_cached_system_prompt() {
    let state = warm(PLAIN);
    let keys = ApiKeys::new(["sk-alice", "sk-mallory"]);
    let uri = "/v1/chat/completions";
    let first = call_as(
        &state,
        &keys,
        Some("sk-alice"),
        uri,
        chat(4417, "Hi.", None),
    )
    .await;
    assert_eq!(cached_tokens(&first), 0);
    for guess in [4416, 4418, 9999, 4417] {
        let probe = chat(guess, "Hi.", None);
        let answer = call_as(&state, &keys, Some("sk-mallory"), uri, probe).await;
        assert_eq!(cached_tokens(&answer), 0, "guess {guess}");
    }
    // Alice's own next conversation resumes from her system block (or more).
    let again = call_as(
        &state,
        &keys,
        Some("sk-alice"),
        uri,
        chat(4417, "Status?", None),
    )
    .await;
    assert!(cached_tokens(&again) > 20, "{again}");
}

/// One key, two salts: a salt is a tenant of its own; the same salt still hits. On the
/// completions endpoint too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_splits_a_tenant_on_both_endpoints() {
    let state = warm(PLAIN);
    let keys = ApiKeys::new(["sk-shared"]);
    let key = Some("sk-shared");
    let uri = "/v1/chat/completions";
    let _ = call_as(&state, &keys, key, uri, chat(4417, "Hi.", Some("alice"))).await;
    let guess = call_as(&state, &keys, key, uri, chat(4417, "Hi.", Some("mallory"))).await;
    assert_eq!(cached_tokens(&guess), 0);
    let unsalted = call_as(&state, &keys, key, uri, chat(4417, "Hi.", None)).await;
    assert_eq!(cached_tokens(&unsalted), 0);
    let again = call_as(
        &state,
        &keys,
        key,
        uri,
        chat(4417, "Status?", Some("alice")),
    )
    .await;
    assert!(cached_tokens(&again) > 20, "{again}");

    let text = "The launch code is 4417. The launch code is 4417. Remember it well.";
    let completion = |salt: &str, extra: &str| {
        json!({"model": "tiny", "prompt": format!("{text}{extra}"), "max_tokens": 2,
               "temperature": 0, "cache_salt": salt})
    };
    let uri = "/v1/completions";
    let _ = call_as(&state, &keys, key, uri, completion("alice", "")).await;
    let guess = call_as(&state, &keys, key, uri, completion("mallory", " Go.")).await;
    assert_eq!(cached_tokens(&guess), 0);
    let again = call_as(&state, &keys, key, uri, completion("alice", " Go.")).await;
    assert!(cached_tokens(&again) > 10, "{again}");
}

/// Without keys every client is the one open tenant (docs/SERVING.md says so): the same system
/// prompt is shared, unless a salt says otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_clients_share_unless_salted() {
    let state = warm(PLAIN);
    let open = ApiKeys::new(None::<&str>);
    let uri = "/v1/chat/completions";
    let _ = call_as(&state, &open, None, uri, chat(1234, "Hi.", None)).await;
    let shared = call_as(&state, &open, None, uri, chat(1234, "Other.", None)).await;
    assert!(cached_tokens(&shared) > 20, "{shared}");
    let salted = call_as(&state, &open, None, uri, chat(1234, "Other.", Some("me"))).await;
    assert_eq!(cached_tokens(&salted), 0);
}
