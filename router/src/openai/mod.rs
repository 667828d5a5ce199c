//! The OpenAI-compatible HTTP API: JSON shapes, request mapping, handlers for the two
//! generation endpoints, and the OpenAI error format. Everything JSON lives under this module.

pub mod chat;
pub mod completions;
pub mod error;
pub mod extract;
pub mod fields;
pub mod logprobs;
pub mod params;
pub mod protocol;
pub mod sse;
pub mod structured;
pub mod tools;

use crate::generation::{ChoiceEnd, StopCause};
use protocol::StopReason;

/// vLLM's `stop_reason` of a finished choice.
pub(crate) fn stop_reason(end: &ChoiceEnd) -> Option<StopReason> {
    match &end.cause {
        StopCause::None => None,
        StopCause::String(s) => Some(StopReason::Text(s.clone())),
        StopCause::Token(t) => Some(StopReason::Token(*t)),
    }
}
