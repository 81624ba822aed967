//! What the handlers share ([`AppState`]) and the check every endpoint that needs the model
//! makes first ([`check_engine`]: 503 while the model loads or after the engine stopped).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::http::StatusCode;

use super::status::StatusCounts;
use crate::api::error::ApiError;
use crate::api::limits::Limits;
use crate::engine::handle::EngineHandle;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The engine the requests go to.
    pub engine: EngineHandle,
    /// What requests are checked against, and the server's defaults.
    pub limits: Arc<Limits>,
    /// Every answer by status code, counted by the connection layer
    /// ([`crate::conn::serve`]) and shown by `/metrics`.
    pub responses: Arc<StatusCounts>,
}

/// 503 unless the engine serves.
pub(crate) fn check_engine(engine: &EngineHandle) -> Result<(), ApiError> {
    if !engine.alive.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine has stopped (see the server's log)",
        ));
    }
    if !engine.ready.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        ));
    }
    Ok(())
}
