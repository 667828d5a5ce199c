//! Server-sent events as OpenAI clients expect them: `data: <json>` events, error objects
//! inside the stream, and the final `data: [DONE]`; plus the id/created/model triple shared by
//! every object of one response.

use super::error::ApiError;
use crate::pipeline::Frontend;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

/// Fields every object of one response shares.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseMeta {
    /// `<prefix>-<uuid>`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl ResponseMeta {
    /// A fresh id with `prefix` (`chatcmpl`, `cmpl`) for the served model.
    pub fn new(prefix: &str, frontend: &Frontend) -> Self {
        Self {
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: frontend.model().name.clone(),
        }
    }
}

/// A `data: <json>` event.
pub fn json_event<T: Serialize>(value: &T) -> Event {
    match serde_json::to_string(value) {
        Ok(json) => Event::default().data(json),
        // Our response types always serialize; keep the stream well-formed regardless.
        Err(e) => error_event(&ApiError::from(crate::error::FrontendError::Internal(e.to_string()))),
    }
}

/// An `{"error": {...}}` event for a failure after streaming started.
pub fn error_event(error: &ApiError) -> Event {
    let json = serde_json::to_string(&error.body()).unwrap_or_else(|_| {
        r#"{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}"#.to_owned()
    });
    Event::default().data(json)
}

/// The terminating `data: [DONE]` event.
pub fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// An SSE response over `events`. Dropping the response body (client gone) drops the stream,
/// and with it the generation, which aborts the engine requests.
pub fn sse_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    Sse::new(events.map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default()).into_response()
}
