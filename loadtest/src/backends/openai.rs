//! OpenAI-compatible `/v1/completions` and `/v1/chat/completions` over SSE.
//!
//! Requests ask for `stream_options.include_usage` so the output length comes
//! from the server's own count, and (unless disabled) `ignore_eos` and
//! `min_tokens` so it is the length asked for. A token chunk is one whose first
//! choice carries generated text: `text` (completions) or `delta.content` /
//! `delta.reasoning_content` (chat), **empty text included** (tokens whose text
//! is held back or decodes to nothing still arrive, and vLLM and Baton send them
//! as chunks), but not a chat role-only delta and not a chunk that only carries
//! the `finish_reason`. A stream must end with `data: [DONE]`; one that stops
//! earlier is a failed request. A completed stream whose tokens were all empty
//! text is a success with empty text, as in vLLM's benchmark (see
//! [`crate::record::Stopwatch::finish`]).

use futures::StreamExt;
use serde_json::{Value, json};

use super::RequestError;
use crate::config::{BackendKind, RunConfig};
use crate::dataset::RequestSpec;
use crate::error::LoadtestError;
use crate::record::{Stopwatch, Usage, truncate};
use crate::sse::SseDecoder;

/// Longest error body kept in a record.
const MAX_ERROR_BODY: usize = 300;

/// A client for one OpenAI-compatible endpoint and model.
#[derive(Clone)]
pub struct OpenAiBackend {
    client: reqwest::Client,
    url: String,
    model: String,
    chat: bool,
    ignore_eos: bool,
    temperature: f64,
    extra_body: serde_json::Map<String, Value>,
}

impl OpenAiBackend {
    /// Prepares requests for `config`; asks `/v1/models` for the model name
    /// when none is configured.
    pub async fn connect(config: &RunConfig, client: reqwest::Client) -> Result<Self, LoadtestError> {
        let base = config.base_url.trim_end_matches('/');
        let model = match &config.model {
            Some(m) => m.clone(),
            None => first_model(&client, base).await?,
        };
        let chat = config.backend == BackendKind::OpenaiChat;
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        Ok(Self {
            client,
            url: format!("{base}{path}"),
            model,
            chat,
            ignore_eos: config.ignore_eos,
            temperature: config.temperature,
            extra_body: config.extra_body.clone(),
        })
    }

    /// The model requests are sent for.
    pub fn model(&self) -> &str {
        &self.model
    }

    fn body(&self, spec: &RequestSpec) -> Value {
        let mut body = json!({
            "model": self.model,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": self.temperature,
        });
        if self.chat {
            body["messages"] = json!([{"role": "user", "content": spec.prompt}]);
            body["max_completion_tokens"] = json!(spec.output_tokens);
        } else {
            body["prompt"] = json!(spec.prompt);
            body["max_tokens"] = json!(spec.output_tokens);
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
            body["min_tokens"] = json!(spec.output_tokens);
        }
        for (key, value) in &self.extra_body {
            body[key.as_str()] = value.clone();
        }
        body
    }

    /// Sends one request and reports its stream to `watch`.
    pub async fn send(&self, spec: &RequestSpec, watch: &mut Stopwatch) -> Result<(), RequestError> {
        let resp = self
            .client
            .post(&self.url)
            .json(&self.body(spec))
            .send()
            .await
            .map_err(|e| RequestError::Transport(error_chain(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(RequestError::Http { status: status.as_u16(), body: error_message(&body) });
        }
        let mut decoder = SseDecoder::new();
        let mut bytes = resp.bytes_stream();
        while let Some(piece) = bytes.next().await {
            let piece = piece.map_err(|e| RequestError::Transport(error_chain(&e)))?;
            for data in decoder.push(&piece) {
                if data.trim() == "[DONE]" {
                    return Ok(());
                }
                self.handle_event(&data, watch)?;
            }
        }
        Err(RequestError::Stream(if decoder.has_partial_event() {
            "stream ended inside an event, before data: [DONE]".into()
        } else {
            "stream ended before data: [DONE]".into()
        }))
    }

    fn handle_event(&self, data: &str, watch: &mut Stopwatch) -> Result<(), RequestError> {
        let event: Value = serde_json::from_str(data)
            .map_err(|e| RequestError::Stream(format!("bad JSON in event ({e}): {}", truncate(data, 120))))?;
        if let Some(err) = event.get("error") {
            return Err(RequestError::Server(error_text(err)));
        }
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            let completion = usage.get("completion_tokens").and_then(Value::as_u64);
            if let Some(completion_tokens) = completion {
                watch.usage(Usage {
                    prompt_tokens: usage.get("prompt_tokens").and_then(Value::as_u64),
                    completion_tokens,
                });
            }
        }
        let Some(choice) = event.get("choices").and_then(|c| c.get(0)) else {
            return Ok(());
        };
        let finishes = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let text = if self.chat {
            let delta = choice.get("delta");
            let field = |name: &str| delta.and_then(|d| d.get(name)).and_then(Value::as_str);
            let text = field("content").filter(|s| !s.is_empty()).or_else(|| field("reasoning_content"));
            // The opening role-only delta (`content: ""`) is not a token.
            let role_only = delta.is_some_and(|d| d.get("role").is_some()) && text.is_none_or(str::is_empty);
            if role_only { None } else { text.or_else(|| field("content")) }
        } else {
            choice.get("text").and_then(Value::as_str)
        };
        match text {
            Some(text) if !text.is_empty() => watch.content(text, None),
            // A token step whose text is empty; an empty chunk that only ends the choice is not one.
            Some(_) if !finishes => watch.content("", None),
            _ if finishes => watch.finish_chunk(),
            _ => {}
        }
        Ok(())
    }
}

/// The first model id listed by `GET /v1/models`.
async fn first_model(client: &reqwest::Client, base: &str) -> Result<String, LoadtestError> {
    let url = format!("{base}/v1/models");
    let fail = |m: String| LoadtestError::Server(format!("GET {url}: {m} (or pass --model)"));
    let resp = client.get(&url).send().await.map_err(|e| fail(error_chain(&e)))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| fail(error_chain(&e)))?;
    if !status.is_success() {
        return Err(fail(format!("HTTP {status}: {}", error_message(&text))));
    }
    let list: Value = serde_json::from_str(&text).map_err(|e| fail(format!("bad JSON: {e}")))?;
    list.get("data")
        .and_then(|d| d.get(0))
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| fail("no model listed".into()))
}

/// The message of an OpenAI error body, or the body itself, shortened.
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").map(error_text))
        .unwrap_or_else(|| truncate(body, MAX_ERROR_BODY))
}

fn error_text(err: &Value) -> String {
    let text = err.get("message").and_then(Value::as_str).map(String::from).unwrap_or_else(|| err.to_string());
    truncate(&text, MAX_ERROR_BODY)
}

/// reqwest's top-level message hides the cause ("error sending request"), so
/// the whole source chain is kept.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
