//! The public API key (`--api-key`): one check shared by the HTTP API (an axum middleware)
//! and the public gRPC API (a tonic interceptor).
//!
//! Clients send `Authorization: Bearer KEY` (HTTP header or gRPC metadata). The scheme is
//! matched case-insensitively (`bearer`, `BEARER`), as RFC 9110 says; the key is compared
//! through its SHA-256 digest in constant time ([`ApiKeyDigest`]), so neither its content
//! nor its length leaks through timing. Failures are HTTP 401 in the OpenAI error shape, or
//! gRPC `UNAUTHENTICATED`; neither says how close a guess was.
//!
//! Invariant: with no key configured every request passes; with one, a request passes only
//! if it presents exactly that key.

use crate::openai::error::ApiError;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use baton_core::cluster_auth::ApiKeyDigest;
use std::sync::Arc;

/// A configured API key (kept only as its digest).
#[derive(Debug, Clone)]
pub struct ApiKey(Arc<ApiKeyDigest>);

impl ApiKey {
    /// The key clients must present.
    pub fn new(key: &str) -> Self {
        Self(Arc::new(ApiKeyDigest::new(key)))
    }

    /// `Some` for a non-empty key.
    pub fn from_config(key: Option<&str>) -> Option<Self> {
        key.filter(|k| !k.is_empty()).map(Self::new)
    }

    /// Whether an `Authorization` value carries this key.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        authorization.and_then(bearer_token).is_some_and(|token| self.0.matches(token))
    }
}

/// The token of an `Authorization: Bearer TOKEN` value (scheme in any case).
pub fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim();
    let (scheme, token) = value.split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// Axum middleware: 401 unless the request carries the key (state: the key, if any).
pub async fn require_api_key(State(key): State<Option<ApiKey>>, request: Request, next: Next) -> Response {
    let Some(key) = &key else {
        return next.run(request).await;
    };
    let presented = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if key.accepts(presented) { next.run(request).await } else { ApiError::unauthorized().into_response() }
}

/// Puts every route of `routes` behind the key (no-op without one).
pub fn protect<S: Clone + Send + Sync + 'static>(routes: axum::Router<S>, key: Option<ApiKey>) -> axum::Router<S> {
    routes.route_layer(axum::middleware::from_fn_with_state(key, require_api_key))
}

/// Tonic interceptor: `UNAUTHENTICATED` unless the call's `authorization` metadata carries
/// the key (passes everything without one).
#[derive(Debug, Clone, Default)]
pub struct ApiKeyInterceptor(Option<ApiKey>);

impl ApiKeyInterceptor {
    /// Checks calls against `key`.
    pub fn new(key: Option<ApiKey>) -> Self {
        Self(key)
    }
}

impl tonic::service::Interceptor for ApiKeyInterceptor {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(key) = &self.0 else { return Ok(request) };
        let presented = request.metadata().get("authorization").and_then(|v| v.to_str().ok());
        if key.accepts(presented) {
            Ok(request)
        } else {
            Err(tonic::Status::unauthenticated("a valid API key is required: send `authorization: Bearer KEY`"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_exact() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearerabc"), None);
        let k = ApiKey::new("sekret");
        assert!(k.accepts(Some("bearer sekret")));
        assert!(!k.accepts(Some("Bearer sekret2")) && !k.accepts(Some("Bearer sekre")) && !k.accepts(None));
        assert!(ApiKey::from_config(Some("")).is_none());
    }

    #[test]
    fn the_interceptor_refuses_missing_and_wrong_keys() {
        let mut i = ApiKeyInterceptor::new(Some(ApiKey::new("k1")));
        let with = |v: Option<&str>| {
            let mut r = tonic::Request::new(());
            if let Some(v) = v {
                r.metadata_mut().insert("authorization", v.parse().expect("ascii"));
            }
            r
        };
        assert_eq!(i.call(with(None)).expect_err("none").code(), tonic::Code::Unauthenticated);
        assert_eq!(i.call(with(Some("Bearer k2"))).expect_err("wrong").code(), tonic::Code::Unauthenticated);
        assert!(i.call(with(Some("bearer k1"))).is_ok());
        assert!(ApiKeyInterceptor::new(None).call(with(None)).is_ok(), "no key configured: open");
    }
}
