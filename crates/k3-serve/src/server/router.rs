//! The router ([`app`]): every endpoint, OpenAI's error object for an unknown route (404) or
//! method (405), the body limit, and every answer counted by status for `/metrics`.

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{Method, StatusCode, Uri};
use axum::routing::{get, post};

use super::handlers::{chat, completions, health, models};
use super::metrics::metrics;
use super::state::AppState;
use crate::api::error::ApiError;

/// Largest request body accepted (413 above).
pub const MAX_BODY: usize = 4 << 20;

/// The router over `state`.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no such route: {}", uri.path()),
            )
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on {}", uri.path()),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}
