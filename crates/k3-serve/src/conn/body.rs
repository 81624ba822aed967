//! The request body read whole before the handler sees it, within its deadline (408) and the
//! size limit (413).

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use crate::api::error::ApiError;
use crate::server::router::MAX_BODY;

/// Reads the whole request body within `deadline` (408 otherwise) and at most [`MAX_BODY`]
/// bytes (413), before the handler sees it.
pub(super) async fn read_body_within(deadline: Duration, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        deadline,
        http_body_util::Limited::new(body, MAX_BODY).collect(),
    );
    let bytes = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body exceeds the limit of {MAX_BODY} bytes"),
            )
            .into_response();
        }
        Ok(Err(e)) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("could not read the request body: {e}"),
            )
            .into_response();
        }
        Err(_) => {
            let mut response = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    deadline.as_secs_f64()
                ),
            )
            .into_response();
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            return response;
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
