//! Request body extraction with OpenAI-shaped errors.
//!
//! axum's own `Json` extractor answers bad bodies with plain text; clients of an OpenAI API
//! expect the JSON error object. [`JsonBody`] buffers the body (honouring the router's
//! `DefaultBodyLimit`, so oversized bodies get a 413) and [`JsonBody::parse`] tells malformed
//! JSON apart from well-formed JSON with wrong or missing fields, naming the field in `param`.
//! The Content-Type header is not required, so plain `curl -d` works.

use super::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

/// A buffered request body, parsed on demand (possibly into several views of the same JSON).
#[derive(Debug, Clone)]
pub struct JsonBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(JsonBody(bytes)),
            Err(rejection) if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::payload_too_large(format!("Request body too large: {}", rejection.body_text())))
            }
            Err(rejection) => Err(ApiError::bad_request(None, rejection.body_text())),
        }
    }
}

/// The field a serde "missing field `x`" message names.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

fn malformed(e: serde_json::Error) -> ApiError {
    ApiError::bad_request(None, format!("Malformed JSON in request body: {e}"))
}

impl JsonBody {
    /// Deserializes the body as `T`. Malformed JSON and type errors are 400s; type errors name
    /// the field's path (e.g. `messages[0].content`) in `param`.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        let mut de = serde_json::Deserializer::from_slice(&self.0);
        let value: T = match serde_path_to_error::deserialize(&mut de) {
            Ok(v) => v,
            Err(err) => {
                let path = err.path().to_string();
                let inner = err.into_inner();
                if inner.is_syntax() || inner.is_eof() {
                    return Err(malformed(inner));
                }
                let message = inner.to_string();
                return Err(match (missing_field(&message), path.as_str()) {
                    (Some(field), ".") => {
                        ApiError::bad_request(Some(field), format!("Invalid request body: {message}"))
                    }
                    (Some(field), _) => ApiError::bad_request(
                        Some(format!("{path}.{field}")),
                        format!("Invalid value for `{path}`: {message}"),
                    ),
                    (None, ".") => ApiError::bad_request(None, format!("Invalid request body: {message}")),
                    (None, _) => {
                        ApiError::bad_request(Some(path.clone()), format!("Invalid value for `{path}`: {message}"))
                    }
                });
            }
        };
        de.end().map_err(malformed)?;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Req {
        messages: Vec<Msg>,
        temperature: Option<f64>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        role: String,
    }

    fn parse(body: &str) -> Result<Req, ApiError> {
        JsonBody(Bytes::from(body.to_owned())).parse()
    }

    #[test]
    fn malformed_json_is_400_without_param() {
        let err = parse(r#"{"messages": ["#).expect_err("eof");
        assert_eq!(err.status, 400);
        assert!(err.message.starts_with("Malformed JSON"), "{}", err.message);
        assert_eq!(err.param, None);
        let err = parse(r#"{"messages": []} trailing"#).expect_err("trailing");
        assert!(err.message.starts_with("Malformed JSON"), "{}", err.message);
    }

    #[test]
    fn wrong_types_and_missing_fields_name_the_param() {
        let err = parse(r#"{"messages": [], "temperature": "hot"}"#).expect_err("type");
        assert_eq!(err.param.as_deref(), Some("temperature"), "{}", err.message);
        let err = parse(r#"{"messages": [{"role": 5}]}"#).expect_err("nested");
        assert_eq!(err.param.as_deref(), Some("messages[0].role"), "{}", err.message);
        let err = parse(r#"{"temperature": 1}"#).expect_err("missing");
        assert_eq!(err.param.as_deref(), Some("messages"), "{}", err.message);
        assert!(err.message.contains("missing field `messages`"), "{}", err.message);
        let err = parse(r#"[1, 2]"#).expect_err("not an object");
        assert_eq!(err.status, 400);
        assert!(parse(r#"{"messages": [{"role": "user", "extra": 1}], "unknown": true}"#).is_ok());
    }
}
