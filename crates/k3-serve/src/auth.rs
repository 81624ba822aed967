//! `--api-key` and tenants: an axum middleware that, when keys are configured, answers every
//! `/v1` route without `Authorization: Bearer <one of the keys>` with 401 and OpenAI's error
//! object, and marks every request it lets through with its [`Tenant`] (a request
//! extension). `/health`, `/metrics` and every other path stay open; with no key configured
//! everything is open and every request is [`Tenant::OPEN`].
//!
//! Each key is its own tenant: the prompt cache shares snapshots only between requests of one
//! tenant, further split by a request's `cache_salt` ([`Tenant::cache_namespace`]), so what
//! one client sent cannot change what another is told (`cached_tokens`, time to first token).
//!
//! ```
//! use k3_serve::auth::{ApiKeys, require_api_key};
//! // In the binary the router is `server::app(state)`; any axum router takes the layer.
//! let router: axum::Router = axum::Router::new()
//!     .route("/v1/models", axum::routing::get(|| async { "[]" }))
//!     .layer(axum::middleware::from_fn_with_state(
//!         ApiKeys::new(["sk-team-a", "sk-team-b"]),
//!         require_api_key,
//!     ));
//! # let _ = router;
//! ```

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::prompt_cache::Namespace;

/// Whose request this is: the API key it came with, as 16 bytes of its SHA-256 (the key itself
/// is kept only in [`ApiKeys`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tenant([u8; 16]);

impl std::fmt::Debug for Tenant {
    // A short, stable tag for logs; never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tenant({:02x}{:02x}{:02x}{:02x})",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

impl Tenant {
    /// Every request of a server without keys.
    pub const OPEN: Tenant = Tenant([0; 16]);

    /// The tenant of `key`.
    pub fn of_key(key: &[u8]) -> Self {
        let digest = Sha256::new()
            .chain_update(b"k3-serve tenant\0")
            .chain_update(key)
            .finalize();
        Self(digest[..16].try_into().expect("16 of 32 bytes"))
    }

    /// The prompt-cache namespace of this tenant's requests with `cache_salt` (none: the
    /// tenant's shared one). Different tenants, or different salts, never share one.
    pub fn cache_namespace(&self, cache_salt: Option<&str>) -> Namespace {
        let mut hash = Sha256::new()
            .chain_update(b"k3-serve cache namespace\0")
            .chain_update(self.0);
        match cache_salt {
            None => hash.update([0u8]),
            Some(salt) => {
                hash.update([1u8]);
                hash.update(salt.as_bytes());
            }
        }
        Namespace(hash.finalize()[..16].try_into().expect("16 of 32 bytes"))
    }
}

/// One configured key and its tenant.
struct Key {
    bytes: Box<[u8]>,
    tenant: Tenant,
}

/// The configured keys, or none (the API is open). Cheap to clone.
#[derive(Clone)]
pub struct ApiKeys(Arc<[Key]>);

impl std::fmt::Debug for ApiKeys {
    // Never prints a key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} set)", self.0.len())
    }
}

impl ApiKeys {
    /// The keys, each its own tenant; empty ones are skipped, and none at all leaves the API
    /// open.
    pub fn new<K: AsRef<str>>(keys: impl IntoIterator<Item = K>) -> Self {
        let mut list: Vec<Key> = Vec::new();
        for key in keys {
            let bytes = key.as_ref().as_bytes();
            if bytes.is_empty() || list.iter().any(|k| &*k.bytes == bytes) {
                continue;
            }
            list.push(Key {
                bytes: bytes.into(),
                tenant: Tenant::of_key(bytes),
            });
        }
        Self(list.into())
    }

    /// Whether any key is configured.
    pub fn is_set(&self) -> bool {
        !self.0.is_empty()
    }

    /// How many keys (tenants) are configured.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is configured (the API is open).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant an `Authorization` header value lets in: [`Tenant::OPEN`] when no key is
    /// configured, the matching key's tenant, or `None`. Every key is compared in full, so the
    /// time does not say which key (or how much of one) matched.
    pub fn tenant_of(&self, authorization: Option<&HeaderValue>) -> Option<Tenant> {
        if self.0.is_empty() {
            return Some(Tenant::OPEN);
        }
        let presented = authorization.and_then(|v| bearer_token(v.as_bytes()))?;
        let mut found = None;
        for key in self.0.iter() {
            if constant_time_eq(presented, &key.bytes) {
                found = Some(key.tenant);
            }
        }
        found
    }
}

/// The token of `Bearer <token>` (the scheme is case-insensitive, RFC 9110 11.1).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let scheme = b"bearer ";
    (value.len() > scheme.len() && value[..scheme.len()].eq_ignore_ascii_case(scheme))
        .then(|| value[scheme.len()..].trim_ascii())
}

/// Whether `presented == key`, in time that depends only on `presented.len()` (which the
/// caller already knows): every byte is compared, with no exit at the first difference, and
/// a length difference is folded into the same accumulator instead of returning early.
/// `key` must not be empty.
fn constant_time_eq(presented: &[u8], key: &[u8]) -> bool {
    debug_assert!(!key.is_empty());
    let mut difference = (presented.len() ^ key.len()) as u64;
    for (i, &byte) in presented.iter().enumerate() {
        // Wraps around the key so the work does not depend on the key's length.
        difference |= u64::from(byte ^ key[i % key.len()]);
    }
    // Keeps the compiler from turning the loop into an early-exit comparison.
    std::hint::black_box(difference) == 0
}

/// The middleware: 401 on a `/v1` path without a configured key, else the next service with
/// the request's [`Tenant`] in its extensions.
pub async fn require_api_key(
    State(keys): State<ApiKeys>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    let guarded = path == "/v1" || path.starts_with("/v1/");
    match keys.tenant_of(request.headers().get(header::AUTHORIZATION)) {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            return next.run(request).await;
        }
        None if !guarded => return next.run(request).await,
        None => {}
    }
    let message = if request.headers().contains_key(header::AUTHORIZATION) {
        "incorrect API key provided"
    } else {
        "no API key provided: send it in an Authorization header as `Bearer KEY`"
    };
    unauthorized(message)
}

/// 401 with OpenAI's error body and a `WWW-Authenticate: Bearer` challenge.
fn unauthorized(message: &str) -> Response {
    let body = json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": null,
        "code": "invalid_api_key",
    }});
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::body::Body;
    use axum::routing::{get, post};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn router(key: Option<&str>) -> Router {
        Router::new()
            .route("/v1/models", get(|| async { "models" }))
            .route("/v1/chat/completions", post(|| async { "chat" }))
            .route("/health", get(|| async { "ok" }))
            .route("/metrics", get(|| async { "metrics" }))
            .layer(axum::middleware::from_fn_with_state(
                ApiKeys::new(key),
                require_api_key,
            ))
    }

    async fn call(
        key: Option<&str>,
        method: &str,
        path: &str,
        authorization: Option<&str>,
    ) -> (StatusCode, String) {
        let mut request = axum::http::Request::builder().method(method).uri(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        let response = router(key)
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn assert_openai_401(status: StatusCode, body: &str) {
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        let error = &body["error"];
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["param"], serde_json::Value::Null);
        assert_eq!(error["code"], "invalid_api_key");
    }

    #[tokio::test]
    async fn a_missing_key_is_401_in_openai_shape() {
        let (status, body) = call(Some("sk-right"), "GET", "/v1/models", None).await;
        assert_openai_401(status, &body);
        assert!(body.contains("no API key provided"));
        let (status, body) = call(Some("sk-right"), "POST", "/v1/chat/completions", None).await;
        assert_openai_401(status, &body);
    }

    #[tokio::test]
    async fn a_wrong_key_is_401() {
        for wrong in [
            "Bearer sk-wrong",
            "Bearer sk-righ",
            "Bearer sk-right2",
            "Bearer ",
            "Basic sk-right",
            "sk-right",
        ] {
            let (status, body) = call(Some("sk-right"), "GET", "/v1/models", Some(wrong)).await;
            assert_openai_401(status, &body);
            assert!(!body.contains("sk-right"), "the key is not echoed: {body}");
        }
    }

    #[tokio::test]
    async fn the_right_key_passes() {
        for right in ["Bearer sk-right", "bearer sk-right", "Bearer  sk-right "] {
            let (status, body) = call(Some("sk-right"), "GET", "/v1/models", Some(right)).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "models"));
        }
        let (status, _) = call(
            Some("sk-right"),
            "POST",
            "/v1/chat/completions",
            Some("Bearer sk-right"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn health_and_metrics_stay_open() {
        for path in ["/health", "/metrics"] {
            let (status, _) = call(Some("sk-right"), "GET", path, None).await;
            assert_eq!(status, StatusCode::OK, "{path}");
        }
        // A path outside /v1 is not guarded even if it begins like it.
        let (status, _) = call(Some("sk-right"), "GET", "/v1x", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn no_key_configured_is_open() {
        for key in [None, Some("")] {
            let (status, body) = call(key, "GET", "/v1/models", None).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "models"));
        }
        assert!(!ApiKeys::new(Some("")).is_set());
        assert_eq!(
            format!("{:?}", ApiKeys::new(Some("sk-x"))),
            "ApiKeys(1 set)"
        );
    }

    /// Each key lets its own requests in as its own tenant; a request's tenant reaches the
    /// handler; namespaces differ between tenants and between salts, and are stable.
    #[tokio::test]
    async fn each_key_is_its_own_tenant() {
        let keys = ApiKeys::new(["sk-a", "sk-b", "", "sk-a"]);
        assert_eq!(keys.len(), 2);
        let header = |k: &str| HeaderValue::from_str(&format!("Bearer {k}")).unwrap();
        let a = keys.tenant_of(Some(&header("sk-a"))).unwrap();
        let b = keys.tenant_of(Some(&header("sk-b"))).unwrap();
        assert_ne!(a, b);
        assert_eq!(a, Tenant::of_key(b"sk-a"));
        assert_eq!(keys.tenant_of(Some(&header("sk-c"))), None);
        assert_eq!(keys.tenant_of(None), None);
        assert_eq!(
            ApiKeys::new(None::<&str>).tenant_of(None),
            Some(Tenant::OPEN)
        );

        assert_ne!(a.cache_namespace(None), b.cache_namespace(None));
        assert_ne!(a.cache_namespace(None), a.cache_namespace(Some("s")));
        assert_ne!(a.cache_namespace(Some("s")), a.cache_namespace(Some("t")));
        assert_ne!(a.cache_namespace(Some("s")), b.cache_namespace(Some("s")));
        assert_eq!(a.cache_namespace(Some("s")), a.cache_namespace(Some("s")));
        assert!(!format!("{a:?}").contains("sk-a"));

        let router = Router::new()
            .route(
                "/v1/models",
                get(|tenant: Option<axum::Extension<Tenant>>| async move {
                    format!("{:?}", tenant.map(|t| t.0))
                }),
            )
            .layer(axum::middleware::from_fn_with_state(keys, require_api_key));
        for (key, tenant) in [("sk-a", a), ("sk-b", b)] {
            let request = axum::http::Request::builder()
                .uri("/v1/models")
                .header(header::AUTHORIZATION, format!("Bearer {key}"))
                .body(Body::empty())
                .unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(bytes, format!("{:?}", Some(tenant)).as_bytes());
        }
    }

    #[test]
    fn comparison_is_exact_whatever_the_lengths() {
        let key = b"abc";
        assert!(constant_time_eq(b"abc", key));
        for presented in [&b"abd"[..], b"ab", b"abca", b"", b"abcabc", b"xbc"] {
            assert!(!constant_time_eq(presented, key), "{presented:?}");
        }
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b"Token abc"), None);
    }
}
