//! The frontend's typed error: everything that can go wrong between a client's request and
//! its last token, independent of the protocol.
//!
//! Each edge (HTTP in [`crate::openai::error`], gRPC in [`crate::grpc`]) maps a
//! [`FrontendError`] to its own status codes; nothing here knows about HTTP or gRPC. Every
//! variant caused by the client carries enough detail (offending parameter, lengths, names)
//! for the client to fix its request without reading server logs.

use baton_core::api::{EngineError, SubmitError};
use baton_core::params::ParamError;

/// The parameter a grammar that does not compile is blamed on (the engine knows the spec,
/// not which request field it came from: `response_format`, `guided_*` and
/// `structured_outputs` all become one).
pub const STRUCTURED_PARAM: &str = "structured_outputs";

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrontendError {
    /// The request is malformed or a field is out of range.
    #[error("{message}")]
    InvalidRequest {
        /// The offending field as the client spelled it, when one is to blame.
        param: Option<String>,
        /// What is wrong and what was received.
        message: String,
    },
    /// Prompt plus requested tokens exceed the model's context.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_tokens} in the messages/prompt, {max_tokens} in the completion). Please reduce the length of the messages/prompt or the completion.",
        prompt_tokens + max_tokens
    )]
    ContextTooLong {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens requested for the completion.
        max_tokens: usize,
        /// The model's context length.
        max_model_len: usize,
    },
    /// The request names a model this server does not serve.
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// The waiting queue is full; the client should retry later.
    #[error("The server is at capacity ({waiting} requests waiting); retry later.")]
    Overloaded {
        /// Requests waiting when this one was refused.
        waiting: usize,
    },
    /// The server has no room for the request right now (the router's in-flight cap, or
    /// every worker that could run it is at capacity); the client should retry later.
    #[error("The server is busy: {0}; retry later.")]
    Busy(String),
    /// The engine is not running.
    #[error("The engine is unavailable: {0}")]
    Unavailable(String),
    /// The engine failed while running an accepted request.
    #[error("The engine failed while generating: {0}")]
    Engine(EngineError),
    /// Tokenizer or template failure on server-side data (not the client's fault).
    #[error("Internal error: {0}")]
    Internal(String),
}

impl FrontendError {
    /// A bad-request error blaming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest { param: Some(param.into()), message: message.into() }
    }

    /// A bad-request error with no single offending field.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::InvalidRequest { param: None, message: message.into() }
    }

    /// The offending parameter, if one is to blame.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } => param.as_deref(),
            Self::ContextTooLong { .. } => Some("max_tokens"),
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// True when the client caused the failure (a 4xx in HTTP terms).
    pub fn is_client_error(&self) -> bool {
        matches!(self, Self::InvalidRequest { .. } | Self::ContextTooLong { .. } | Self::ModelNotFound(_))
    }

    /// True when the request was refused for lack of capacity or of engines and never
    /// started: nothing was generated, and the same request may succeed later.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Overloaded { .. } | Self::Busy(_) | Self::Unavailable(_))
    }
}

impl From<EngineError> for FrontendError {
    /// Refusals that reach the frontend on an engine stream (a remote engine said no before
    /// starting) keep their meaning, so the edges answer 429/503 and not 500.
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Overloaded(m) => Self::Busy(m),
            EngineError::Unavailable(m) => Self::Unavailable(m),
            e @ EngineError::InvalidGrammar { .. } => Self::invalid(STRUCTURED_PARAM, e.to_string()),
            other => Self::Engine(other),
        }
    }
}

impl From<ParamError> for FrontendError {
    fn from(e: ParamError) -> Self {
        Self::invalid(e.param, e.message)
    }
}

impl From<SubmitError> for FrontendError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::InvalidParams(p) => p.into(),
            SubmitError::InvalidPrompt(m) => Self::invalid("prompt", m),
            SubmitError::ContextTooLong { prompt_tokens, max_tokens, max_model_len } => {
                Self::ContextTooLong { prompt_tokens, max_tokens, max_model_len }
            }
            SubmitError::QueueFull { waiting } => Self::Overloaded { waiting },
            SubmitError::Unavailable(m) => Self::Unavailable(m),
            e @ SubmitError::InvalidGrammar { .. } => Self::invalid(STRUCTURED_PARAM, e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars_that_do_not_compile_are_bad_requests_naming_structured_outputs() {
        let engine: FrontendError =
            EngineError::InvalidGrammar { kind: "regex".into(), message: "unclosed group".into() }.into();
        let submit: FrontendError =
            SubmitError::InvalidGrammar { kind: "regex".into(), message: "unclosed group".into() }.into();
        for e in [engine, submit] {
            assert!(e.is_client_error() && !e.is_refusal(), "{e:?}");
            assert_eq!(e.param(), Some(STRUCTURED_PARAM));
            assert_eq!(e.to_string(), "invalid structured_outputs regex: unclosed group");
        }
    }

    #[test]
    fn submit_errors_keep_their_details() {
        let e: FrontendError =
            SubmitError::ContextTooLong { prompt_tokens: 30, max_tokens: 10, max_model_len: 32 }.into();
        let msg = e.to_string();
        assert!(msg.contains("32") && msg.contains("30") && msg.contains("10"), "{msg}");
        assert_eq!(e.param(), Some("max_tokens"));
        assert!(e.is_client_error());

        let e: FrontendError = SubmitError::InvalidParams(ParamError::new("top_p", "bad top_p")).into();
        assert_eq!(e.param(), Some("top_p"));
        assert_eq!(e.to_string(), "bad top_p");

        let e: FrontendError = SubmitError::QueueFull { waiting: 4 }.into();
        assert_eq!(e, FrontendError::Overloaded { waiting: 4 });
        assert!(!e.is_client_error() && e.is_refusal());
    }

    #[test]
    fn engine_refusals_stay_refusals() {
        let e: FrontendError = EngineError::Overloaded("every decode worker is full".into()).into();
        assert!(matches!(&e, FrontendError::Busy(m) if m.contains("decode worker")), "{e:?}");
        assert!(e.is_refusal() && !e.is_client_error());
        let e: FrontendError = EngineError::Unavailable("unreachable".into()).into();
        assert_eq!(e, FrontendError::Unavailable("unreachable".into()));
        let e: FrontendError = EngineError::Backend("boom".into()).into();
        assert!(matches!(e, FrontendError::Engine(_)) && !e.is_refusal());
    }
}
