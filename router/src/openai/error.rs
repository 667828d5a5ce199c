//! The OpenAI error shape `{"error": {"message", "type", "param", "code"}}` and the mapping
//! from [`FrontendError`] to HTTP status codes. This is the only place where frontend errors
//! become HTTP statuses.

use crate::error::FrontendError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Seconds a client should wait before retrying when the queue is full.
pub const RETRY_AFTER_SECS: u64 = 1;

/// An error response of the OpenAI-compatible API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type` (e.g. `invalid_request_error`).
    pub kind: &'static str,
    /// Human-readable explanation.
    pub message: String,
    /// The offending request field, if any.
    pub param: Option<String>,
    /// A machine-readable code (e.g. `model_not_found`), if any.
    pub code: Option<&'static str>,
    /// Value of the `Retry-After` header, if any.
    pub retry_after: Option<u64>,
}

/// The JSON body of an error response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The `error` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI's error type.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The offending field or `null`.
    pub param: Option<String>,
    /// A machine-readable code or `null`.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// 400 for a request the client must fix.
    pub fn bad_request(param: Option<String>, message: impl Into<String>) -> Self {
        Self { param, ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "Missing or invalid API key: send the header `Authorization: Bearer <key>`.",
            )
        }
    }

    /// 413 for a body over the size limit.
    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
        }
    }

    /// 404 for an unknown path.
    pub fn route_not_found(path: &str) -> Self {
        Self {
            code: Some("not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Unknown endpoint `{path}`."))
        }
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "Method not allowed for this endpoint.")
    }

    /// The JSON body (also used for error events inside SSE streams).
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind,
                param: self.param.clone(),
                code: self.code,
            },
        }
    }
}

impl From<FrontendError> for ApiError {
    fn from(e: FrontendError) -> Self {
        let message = e.to_string();
        let param = e.param().map(str::to_owned);
        match e {
            FrontendError::InvalidRequest { .. } => Self::bad_request(param, message),
            FrontendError::ContextTooLong { .. } => {
                Self { code: Some("context_length_exceeded"), ..Self::bad_request(param, message) }
            }
            FrontendError::ModelNotFound(_) => Self {
                param,
                code: Some("model_not_found"),
                ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
            },
            FrontendError::Overloaded { .. } => Self {
                code: Some("queue_full"),
                retry_after: Some(RETRY_AFTER_SECS),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            FrontendError::Busy(_) => Self {
                code: Some("server_busy"),
                retry_after: Some(RETRY_AFTER_SECS),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            // No engine to run it now; one may come back (a worker re-registering).
            FrontendError::Unavailable(_) => Self {
                retry_after: Some(RETRY_AFTER_SECS),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            },
            FrontendError::Engine(_) | FrontendError::Internal(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = self.retry_after;
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_errors_map_to_openai_statuses() {
        let cases = [
            (FrontendError::invalid("n", "bad n"), StatusCode::BAD_REQUEST, Some("n"), None),
            (
                FrontendError::ContextTooLong { prompt_tokens: 5, max_tokens: 9, max_model_len: 8 },
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
                Some("context_length_exceeded"),
            ),
            (FrontendError::ModelNotFound("x".into()), StatusCode::NOT_FOUND, Some("model"), Some("model_not_found")),
            (FrontendError::Overloaded { waiting: 3 }, StatusCode::TOO_MANY_REQUESTS, None, Some("queue_full")),
            (FrontendError::Busy("full".into()), StatusCode::TOO_MANY_REQUESTS, None, Some("server_busy")),
            (FrontendError::Unavailable("down".into()), StatusCode::SERVICE_UNAVAILABLE, None, None),
            (FrontendError::Internal("boom".into()), StatusCode::INTERNAL_SERVER_ERROR, None, None),
        ];
        for (err, status, param, code) in cases {
            let api = ApiError::from(err.clone());
            assert_eq!(api.status, status, "{err}");
            assert_eq!(api.param.as_deref(), param, "{err}");
            assert_eq!(api.code, code, "{err}");
            assert_eq!(api.message, err.to_string());
        }
    }

    #[test]
    fn queue_full_sets_retry_after_and_body_has_all_four_fields() {
        for (e, status) in [
            (FrontendError::Overloaded { waiting: 1 }, StatusCode::TOO_MANY_REQUESTS),
            (FrontendError::Busy("every worker is full".into()), StatusCode::TOO_MANY_REQUESTS),
            (FrontendError::Unavailable("no worker".into()), StatusCode::SERVICE_UNAVAILABLE),
        ] {
            let response = ApiError::from(e).into_response();
            assert_eq!(response.status(), status);
            assert_eq!(response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("1"));
        }
        let body = serde_json::to_value(ApiError::bad_request(None, "m").body()).expect("json");
        let obj = body["error"].as_object().expect("error object");
        for key in ["message", "type", "param", "code"] {
            assert!(obj.contains_key(key), "{key} missing in {body}");
        }
    }
}
