//! Server-sent events as OpenAI clients expect them: `data: <json>` events, error objects
//! inside the stream, and the final `data: [DONE]`; plus the id/created/model triple shared by
//! every object of one response.
//!
//! This is the per-token hot path of a streaming response, so events are rendered straight
//! into the bytes of one SSE frame each: a [`ChunkFrame`] serializes the fields every chunk of
//! a response shares (id, object, created, model, usage placeholder) once, and each chunk
//! then only serializes its choice between them. The bytes are those serde gives for the
//! whole chunk object, by construction (same types, same serializer).
//!
//! Invariants: every frame is one `data:` line (compact JSON never contains a raw newline)
//! followed by a blank line; an idle stream sends a `:` comment at least every
//! [`KEEP_ALIVE`]·2 so that proxies keep it open.

use super::error::ApiError;
use crate::pipeline::Frontend;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use futures::stream::{BoxStream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A stream with nothing to send for this long sends a keep-alive comment (within twice it).
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

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

const DATA: &[u8] = b"data: ";
const END: &[u8] = b"\n\n";
/// Where a chunk's choices go in its serialized template (a key: JSON strings escape `"`).
const CHOICES: &[u8] = br#""choices":[]"#;

/// The frame of a `data: <json>` event.
pub fn json_frame<T: Serialize>(value: &T) -> Bytes {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(DATA);
    match serde_json::to_writer(&mut buf, value) {
        Ok(()) => {
            buf.extend_from_slice(END);
            Bytes::from(buf)
        }
        // Our response types always serialize; keep the stream well-formed regardless.
        Err(e) => error_frame(&ApiError::from(crate::error::FrontendError::Internal(e.to_string()))),
    }
}

/// An `{"error": {...}}` event for a failure after streaming started.
pub fn error_frame(error: &ApiError) -> Bytes {
    let json = serde_json::to_string(&error.body()).unwrap_or_else(|_| {
        r#"{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}"#.to_owned()
    });
    Bytes::from(format!("data: {json}\n\n"))
}

/// The terminating `data: [DONE]` event.
pub fn done_frame() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// The frames of one response's single-choice chunks: the chunk object serialized once with
/// empty `choices`, split around them.
#[derive(Debug, Clone)]
pub struct ChunkFrame {
    /// `data: {...,"choices":[`.
    head: Vec<u8>,
    /// `]...}\n\n`.
    tail: Vec<u8>,
}

impl ChunkFrame {
    /// Frames shaped like `template`, a chunk whose `choices` is an empty list.
    pub fn new<T: Serialize>(template: &T) -> Result<Self, serde_json::Error> {
        let json = serde_json::to_vec(template)?;
        let at = json
            .windows(CHOICES.len())
            .position(|w| w == CHOICES)
            .ok_or_else(|| serde::ser::Error::custom("the chunk template has no empty `choices` list"))?;
        let split = at + CHOICES.len() - 1;
        let mut head = Vec::with_capacity(DATA.len() + split);
        head.extend_from_slice(DATA);
        head.extend_from_slice(&json[..split]);
        let mut tail = json[split..].to_vec();
        tail.extend_from_slice(END);
        Ok(Self { head, tail })
    }

    /// The event of the template's chunk with `choices: [choice]`.
    pub fn frame<C: Serialize>(&self, choice: &C) -> Bytes {
        let mut buf = Vec::with_capacity(self.head.len() + self.tail.len() + 128);
        buf.extend_from_slice(&self.head);
        match serde_json::to_writer(&mut buf, choice) {
            Ok(()) => {
                buf.extend_from_slice(&self.tail);
                Bytes::from(buf)
            }
            Err(e) => error_frame(&ApiError::from(crate::error::FrontendError::Internal(e.to_string()))),
        }
    }
}

/// Adds keep-alive comments to an event stream: when a [`KEEP_ALIVE`] period passes with no
/// event, a `:` comment goes out. The timer is re-armed once per period, not per event.
struct KeepAlive {
    events: BoxStream<'static, Bytes>,
    period: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    sent: bool,
}

impl KeepAlive {
    fn new(events: BoxStream<'static, Bytes>, period: Duration) -> Self {
        Self { events, period, timer: Box::pin(tokio::time::sleep(period)), sent: false }
    }
}

impl Stream for KeepAlive {
    type Item = Bytes;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let this = self.get_mut();
        if let Poll::Ready(item) = this.events.poll_next_unpin(cx) {
            this.sent = true;
            return Poll::Ready(item);
        }
        while this.timer.as_mut().poll(cx).is_ready() {
            this.timer.as_mut().reset(tokio::time::Instant::now() + this.period);
            if !std::mem::replace(&mut this.sent, false) {
                return Poll::Ready(Some(Bytes::from_static(b":\n\n")));
            }
        }
        Poll::Pending
    }
}

/// An SSE response over `events` (whole frames). Dropping the response body (client gone)
/// drops the stream, and with it the generation, which aborts the engine requests.
pub fn sse_response(events: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    let events = KeepAlive::new(events.boxed(), KEEP_ALIVE);
    (
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        Body::from_stream(events.map(Ok::<_, Infallible>)),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::protocol::{
        ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionResponse, StopReason, Usage,
        UsageField,
    };

    fn completion(choices: Vec<CompletionChoice>, usage: UsageField) -> CompletionResponse {
        CompletionResponse {
            id: "cmpl-\"choices\":[]".into(),
            object: "text_completion",
            created: 1_700_000_000,
            model: "m \"choices\":[] \u{1F600}".into(),
            choices,
            usage,
        }
    }

    fn whole(value: &impl Serialize) -> Bytes {
        Bytes::from(format!("data: {}\n\n", serde_json::to_string(value).expect("json")))
    }

    #[test]
    fn chunk_frames_are_the_serde_bytes_of_the_whole_chunk() {
        let texts = ["", "plain", "quote \" backslash \\ newline \n tab \t", "ctrl \u{1} é 你好 😀", "</script>"];
        for usage in [UsageField::Absent, UsageField::Null] {
            let frame = ChunkFrame::new(&completion(Vec::new(), usage)).expect("template");
            for (i, text) in texts.iter().enumerate() {
                let choice = CompletionChoice {
                    index: i * 7,
                    text: text.to_string(),
                    logprobs: None,
                    finish_reason: (i % 2 == 1).then_some("stop"),
                    stop_reason: (i == 3).then(|| StopReason::Text("x\"y".into())),
                    prompt_logprobs: None,
                };
                let expected = whole(&completion(vec![choice.clone()], usage));
                assert_eq!(frame.frame(&choice), expected);
            }
        }
        let chat = |choices: Vec<ChatChunkChoice>| ChatCompletionChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 5,
            model: "m".into(),
            choices,
            usage: UsageField::Null,
        };
        let frame = ChunkFrame::new(&chat(Vec::new())).expect("template");
        for delta in [
            ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() },
            ChatDelta { role: None, content: Some("hi \"there\"\n".into()), ..Default::default() },
            ChatDelta {
                reasoning_content: Some("hmm".into()),
                tool_calls: Some(vec![super::super::protocol::ToolCallDeltaOut {
                    index: 0,
                    id: Some("call_1".into()),
                    kind: Some("function"),
                    function: super::super::protocol::FunctionDeltaOut {
                        name: Some("f".into()),
                        arguments: "{".into(),
                    },
                }]),
                ..Default::default()
            },
            ChatDelta::default(),
        ] {
            let choice = ChatChunkChoice { index: 1, delta, logprobs: None, finish_reason: None, stop_reason: None };
            assert_eq!(frame.frame(&choice), whole(&chat(vec![choice.clone()])));
        }
        // The usage chunk (no choices) through the plain path.
        let usage = completion(Vec::new(), UsageField::Counts(Usage::new(3, 4)));
        assert_eq!(json_frame(&usage), whole(&usage));
    }

    #[test]
    fn a_template_without_choices_is_refused() {
        assert!(ChunkFrame::new(&serde_json::json!({"id": "x"})).is_err());
    }

    #[tokio::test]
    async fn idle_streams_get_keep_alive_comments_and_busy_ones_do_not() {
        let period = Duration::from_millis(300);
        // An event every 20 ms: never idle for a whole period, no comment.
        let busy = futures::stream::unfold(0, |i| async move {
            if i == 10 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            Some((Bytes::from_static(b"data: x\n\n"), i + 1))
        });
        let frames: Vec<Bytes> = KeepAlive::new(busy.boxed(), period).collect().await;
        assert_eq!(frames.len(), 10);
        assert!(frames.iter().all(|f| f.as_ref() == b"data: x\n\n"));
        // Silent for 2.5 periods, then one event: comments first (one per idle period).
        let idle = futures::stream::once(async move {
            tokio::time::sleep(period * 5 / 2).await;
            Bytes::from_static(b"data: y\n\n")
        });
        let frames: Vec<Bytes> = KeepAlive::new(idle.boxed(), period).collect().await;
        let (last, comments) = frames.split_last().expect("frames");
        assert_eq!(last.as_ref(), b"data: y\n\n");
        assert!((1..=2).contains(&comments.len()), "{frames:?}");
        assert!(comments.iter().all(|f| f.as_ref() == b":\n\n"));
    }
}
