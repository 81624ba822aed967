//! `--api-key`: an axum middleware that, when a key is configured, answers every `/v1` route
//! without `Authorization: Bearer <key>` with 401 and OpenAI's error object. `/health`,
//! `/metrics` and every other path stay open; with no key configured everything is open.
//!
//! ```
//! use k3_serve::auth::{ApiKey, require_api_key};
//! // In the binary the router is `server::app(state)`; any axum router takes the layer.
//! let router: axum::Router = axum::Router::new()
//!     .route("/v1/models", axum::routing::get(|| async { "[]" }))
//!     .layer(axum::middleware::from_fn_with_state(
//!         ApiKey::new(Some("sk-local")),
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

/// The configured key, or none (the API is open). Cheap to clone.
#[derive(Clone)]
pub struct ApiKey(Option<Arc<[u8]>>);

impl std::fmt::Debug for ApiKey {
    // Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ApiKey(set)"
        } else {
            "ApiKey(none)"
        })
    }
}

impl ApiKey {
    /// `None` or an empty key: the API is open.
    pub fn new(key: Option<&str>) -> Self {
        Self(key.filter(|k| !k.is_empty()).map(|k| k.as_bytes().into()))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether an `Authorization` header value lets a request in.
    pub fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(key) = &self.0 else { return true };
        let Some(presented) = authorization.and_then(|v| bearer_token(v.as_bytes())) else {
            return false;
        };
        constant_time_eq(presented, key)
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

/// The middleware: 401 on a `/v1` path without the key, else the next service.
pub async fn require_api_key(State(key): State<ApiKey>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let guarded = path == "/v1" || path.starts_with("/v1/");
    if !guarded || key.admits(request.headers().get(header::AUTHORIZATION)) {
        return next.run(request).await;
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
                ApiKey::new(key),
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
        assert!(!ApiKey::new(Some("")).is_set());
        assert_eq!(format!("{:?}", ApiKey::new(Some("sk-x"))), "ApiKey(set)");
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
