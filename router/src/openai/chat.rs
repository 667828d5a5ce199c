//! `POST /v1/chat/completions`: request mapping, the non-streaming response and the SSE
//! stream of `chat.completion.chunk` objects.
//!
//! Streaming order per response: one role chunk per choice (`delta: {role, content: ""}`),
//! content chunks as text becomes final, one chunk with `finish_reason` per choice, then, with
//! `stream_options.include_usage`, a chunk with empty `choices` and the usage, then
//! `data: [DONE]`. A failure after the stream started is sent as an `{"error": ...}` event
//! before `[DONE]`.

use super::error::ApiError;
use super::extract::JsonBody;
use super::fields::{Endpoint, check_fields};
use super::logprobs::{chat_logprobs, vllm_prompt_logprobs};
use super::params::{EndpointParams, sampling_params, top_logprobs};
use super::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatMessageIn, MessageContent, PromptLogprobs, SamplingFields, Usage, UsageField,
};
use super::sse::{ChunkFrame, ResponseMeta, done_frame, error_frame, json_frame, sse_response};
use super::stop_reason;
use crate::error::FrontendError;
use crate::generation::{ChoiceEnd, ChoiceEvent, Generation};
use crate::pipeline::{Frontend, GenerateRequest, PromptInput};
use crate::text::ChatTurn;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

/// Handler of `POST /v1/chat/completions`.
pub async fn chat_completions(State(frontend): State<Frontend>, body: JsonBody) -> Response {
    match handle(frontend, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

fn message_text(index: usize, message: ChatMessageIn) -> Result<ChatTurn, FrontendError> {
    let content = match message.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t,
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(t)) => text.push_str(&t),
                    (kind, _) => {
                        return Err(FrontendError::invalid(
                            format!("messages[{index}].content[{j}]"),
                            format!(
                                "content parts of type `{kind}` are not supported; only `text` parts with a `text` field are"
                            ),
                        ));
                    }
                }
            }
            text
        }
    };
    Ok(ChatTurn { role: message.role, content })
}

async fn handle(frontend: Frontend, body: JsonBody) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = body.parse()?;
    check_fields(&body.parse::<serde_json::Value>()?, Endpoint::Chat)?;
    let fields: SamplingFields = body.parse()?;
    frontend.check_model(fields.model.as_deref())?;
    if request.messages.is_empty() {
        return Err(FrontendError::invalid("messages", "messages must contain at least one message").into());
    }
    let turns =
        request.messages.into_iter().enumerate().map(|(i, m)| message_text(i, m)).collect::<Result<Vec<_>, _>>()?;
    let logprobs = match (request.logprobs, request.top_logprobs) {
        (Some(true), k) => Some(k.map(|k| top_logprobs("top_logprobs", k)).transpose()?.unwrap_or(0)),
        (_, Some(k)) if k != 0 => {
            return Err(FrontendError::invalid("top_logprobs", "top_logprobs requires `logprobs: true`").into());
        }
        _ => None,
    };
    let max_tokens = match (request.max_completion_tokens, fields.max_tokens) {
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        (None, None) => None,
    };
    let params = sampling_params(&fields, EndpointParams { max_tokens, default_max_tokens: None, logprobs })?;
    let stream_requested = fields.stream.unwrap_or(false);
    if stream_requested && params.prompt_logprobs.is_some() {
        // As vLLM: the prompt's logprobs are a field of the whole response, not of a chunk.
        return Err(
            FrontendError::invalid("prompt_logprobs", "prompt_logprobs are not available with stream: true").into()
        );
    }
    let prompt =
        PromptInput::Chat { messages: turns, add_generation_prompt: request.add_generation_prompt.unwrap_or(true) };
    let mut generation = frontend.generate(GenerateRequest::new(prompt, params)).await?;
    // A refusal (every worker full) is a 429/503, not a 200 stream ending in an error.
    generation.refused().await?;
    let meta = ResponseMeta::new("chatcmpl", &frontend);
    if stream_requested {
        let include_usage = fields.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        stream(frontend, generation, meta, include_usage, logprobs.is_some())
    } else {
        Ok(collect(frontend, generation, meta, logprobs.is_some()).await?.into_response())
    }
}

async fn collect(
    frontend: Frontend,
    mut generation: Generation,
    meta: ResponseMeta,
    want_logprobs: bool,
) -> Result<axum::Json<ChatCompletionResponse>, ApiError> {
    let n = generation.num_choices();
    let mut texts = vec![String::new(); n];
    let mut logprobs: Vec<Option<ChatLogprobs>> = vec![want_logprobs.then(|| ChatLogprobs { content: Vec::new() }); n];
    let mut ends: Vec<Option<ChoiceEnd>> = vec![None; n];
    // Every choice scores the same prompt; the first one to arrive is the response's.
    let mut prompt_logprobs: Option<PromptLogprobs> = None;
    while let Some(event) = generation.next().await {
        match event {
            ChoiceEvent::Delta(d) => {
                if let (None, Some(entries)) = (&prompt_logprobs, &d.prompt_logprobs) {
                    prompt_logprobs = Some(vllm_prompt_logprobs(frontend.codec(), entries));
                }
                if let Some(text) = texts.get_mut(d.index) {
                    text.push_str(&d.text);
                }
                if let Some(Some(acc)) = logprobs.get_mut(d.index) {
                    acc.content.extend(chat_logprobs(frontend.codec(), &d.logprobs).content);
                }
            }
            ChoiceEvent::Finished(end) => {
                let index = end.index;
                if let Some(slot) = ends.get_mut(index) {
                    *slot = Some(end);
                }
            }
            ChoiceEvent::Failed { error, .. } => return Err(error.into()),
        }
    }
    let completion_tokens = ends.iter().flatten().map(|e| e.completion_tokens).sum();
    let choices = texts
        .into_iter()
        .zip(logprobs)
        .zip(ends)
        .enumerate()
        .map(|(index, ((content, logprobs), end))| ChatChoice {
            index,
            message: AssistantMessage { role: "assistant", content },
            logprobs,
            finish_reason: end.as_ref().map(|e| e.reason.as_openai_str()),
            stop_reason: end.as_ref().and_then(stop_reason),
        })
        .collect();
    Ok(axum::Json(ChatCompletionResponse {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices,
        usage: Usage::new(generation.prompt_tokens(), completion_tokens),
        prompt_logprobs,
    }))
}

fn stream(
    frontend: Frontend,
    mut generation: Generation,
    meta: ResponseMeta,
    include_usage: bool,
    want_logprobs: bool,
) -> Result<Response, ApiError> {
    let usage_field = if include_usage { UsageField::Null } else { UsageField::Absent };
    let chunk = move |choices: Vec<ChatChunkChoice>, usage: UsageField| ChatCompletionChunk {
        id: meta.id.clone(),
        object: "chat.completion.chunk",
        created: meta.created,
        model: meta.model.clone(),
        choices,
        usage,
    };
    // Every chunk but the usage one has one choice: render the rest once.
    let frame = ChunkFrame::new(&chunk(Vec::new(), usage_field)).map_err(|e| FrontendError::Internal(e.to_string()))?;
    let events = async_stream::stream! {
        for index in 0..generation.num_choices() {
            let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()) };
            let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None, stop_reason: None };
            yield frame.frame(&choice);
        }
        let mut completion_tokens = 0;
        while let Some(event) = generation.next().await {
            match event {
                ChoiceEvent::Delta(d) => {
                    let logprobs = (want_logprobs && !d.logprobs.is_empty())
                        .then(|| chat_logprobs(frontend.codec(), &d.logprobs));
                    // A step's tokens make a chunk even when their text is empty (see
                    // completions.rs): every token step reaches the client.
                    if d.token_ids.is_empty() && d.text.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    let delta = ChatDelta { role: None, content: Some(d.text) };
                    let choice = ChatChunkChoice { index: d.index, delta, logprobs, finish_reason: None, stop_reason: None };
                    yield frame.frame(&choice);
                }
                ChoiceEvent::Finished(end) => {
                    completion_tokens += end.completion_tokens;
                    let choice = ChatChunkChoice {
                        index: end.index,
                        delta: ChatDelta::default(),
                        logprobs: None,
                        finish_reason: Some(end.reason.as_openai_str()),
                        stop_reason: stop_reason(&end),
                    };
                    yield frame.frame(&choice);
                }
                ChoiceEvent::Failed { error, .. } => {
                    yield error_frame(&ApiError::from(error));
                    break;
                }
            }
        }
        if include_usage {
            let usage = Usage::new(generation.prompt_tokens(), completion_tokens);
            yield json_frame(&chunk(Vec::new(), UsageField::Counts(usage)));
        }
        yield done_frame();
    };
    Ok(sse_response(events))
}
