//! The error every handler returns: OpenAI's error object (`{"error": {"message", "type",
//! "param", "code"}}`) with its HTTP status, one `type` per class of status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The HTTP status; it picks the error object's `type` and is its `code`.
    pub status: StatusCode,
    /// What was wrong, for a person to read.
    pub message: String,
    /// The request field at fault (`temperature`, `messages[2].content`), if one is.
    pub param: Option<String>,
}

impl ApiError {
    /// An error with `status` about the request as a whole.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// A 400 about one field (`""`: the body as a whole).
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: (!param.is_empty()).then(|| param.into()),
        }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 405 | 408 | 413 | 414 | 415 | 422 | 431 | 505 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16().to_string(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
