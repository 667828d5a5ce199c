//! `POST /v1/chat/completions`: request mapping, the non-streaming response and the SSE
//! stream of `chat.completion.chunk` objects.
//!
//! Streaming order per response: one role chunk per choice (`delta: {role, content: ""}`),
//! content chunks as text becomes final, one chunk with `finish_reason` per choice, then, with
//! `stream_options.include_usage`, a chunk with empty `choices` and the usage, then
//! `data: [DONE]`. A failure after the stream started is sent as an `{"error": ...}` event
//! before `[DONE]`.
//!
//! With tools or a reasoning parser, each choice's text goes through its
//! [`OutputParser`] (non-streaming) or [`StreamingParser`] (streaming): reasoning becomes
//! `reasoning_content`, calls become `tool_calls` (streamed as OpenAI does: `id`, `type` and
//! the name on a call's first delta, then argument fragments), and a choice that made calls
//! and stopped normally finishes with `tool_calls`.

use super::error::ApiError;
use super::extract::JsonBody;
use super::fields::{Endpoint, check_fields};
use super::logprobs::{chat_logprobs, vllm_prompt_logprobs};
use super::params::{EndpointParams, sampling_params, top_logprobs};
use super::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatMessageIn, FunctionCallOut, FunctionDeltaOut, MessageContent, PromptLogprobs,
    SamplingFields, StructuredFields, ToolCallDeltaOut, ToolCallOut, Usage, UsageField,
};
use super::sse::{ChunkFrame, ResponseMeta, done_frame, error_frame, json_frame, sse_response};
use super::stop_reason;
use super::structured;
use super::tools::choice::{ToolConfig, resolve};
use super::tools::{OutputDelta, OutputParser, ParsedOutput, StreamingParser};
use crate::error::FrontendError;
use crate::generation::{ChoiceEnd, ChoiceEvent, Generation};
use crate::pipeline::{Frontend, GenerateRequest, PromptInput};
use crate::text::ChatTurn;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use baton_core::api::FinishReason;
use serde_json::Value;

/// Handler of `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(frontend): State<Frontend>,
    State(tools): State<ToolConfig>,
    body: JsonBody,
) -> Response {
    match handle(frontend, tools, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

fn message_text(index: usize, content: Option<MessageContent>) -> Result<String, FrontendError> {
    Ok(match content {
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
    })
}

/// One message as the template sees it: an assistant's calls in HF's shape (arguments as a
/// JSON object, as vLLM passes them), a tool message's `tool_call_id`.
fn message_turn(index: usize, message: ChatMessageIn) -> Result<ChatTurn, FrontendError> {
    let mut turn = ChatTurn::text(message.role, message_text(index, message.content)?);
    turn.tool_call_id = message.tool_call_id;
    if let Some(calls) = message.tool_calls {
        let mut hf = Vec::with_capacity(calls.len());
        for (j, call) in calls.into_iter().enumerate() {
            let arguments = match call.function.arguments {
                Value::String(text) => serde_json::from_str::<Value>(&text).map_err(|e| {
                    let param = format!("messages[{index}].tool_calls[{j}].function.arguments");
                    FrontendError::invalid(param.clone(), format!("{param} must be JSON text: {e}"))
                })?,
                other => other,
            };
            hf.push(serde_json::json!({
                "id": call.id,
                "type": call.kind.unwrap_or_else(|| "function".to_owned()),
                "function": {"name": call.function.name, "arguments": arguments},
            }));
        }
        turn.tool_calls = Some(Value::Array(hf));
    }
    Ok(turn)
}

/// The messages of a request as template turns.
pub fn chat_turns(messages: Vec<ChatMessageIn>) -> Result<Vec<ChatTurn>, FrontendError> {
    messages.into_iter().enumerate().map(|(i, m)| message_turn(i, m)).collect()
}

async fn handle(frontend: Frontend, tool_config: ToolConfig, body: JsonBody) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = body.parse()?;
    check_fields(&body.parse::<serde_json::Value>()?, Endpoint::Chat)?;
    let fields: SamplingFields = body.parse()?;
    let constraint_fields: StructuredFields = body.parse()?;
    frontend.check_model(fields.model.as_deref())?;
    if request.messages.is_empty() {
        return Err(FrontendError::invalid("messages", "messages must contain at least one message").into());
    }
    let turns = chat_turns(request.messages)?;
    let tools = resolve(request.tools, request.tool_choice, request.parallel_tool_calls, &tool_config)?;
    let constraint = structured::grammar(&constraint_fields)?;
    if let (Some(c), Some(_)) = (&constraint, &tools.grammar) {
        return Err(FrontendError::invalid(
            c.param.clone(),
            format!("`{}` cannot be combined with a tool_choice that forces a call", c.param),
        )
        .into());
    }
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
    let mut params = sampling_params(&fields, EndpointParams { max_tokens, default_max_tokens: None, logprobs })?;
    let stream_requested = fields.stream.unwrap_or(false);
    if stream_requested && params.prompt_logprobs.is_some() {
        // As vLLM: the prompt's logprobs are a field of the whole response, not of a chunk.
        return Err(
            FrontendError::invalid("prompt_logprobs", "prompt_logprobs are not available with stream: true").into()
        );
    }
    let mut checks = tools.checks.clone();
    params.structured = tools.grammar.clone().or_else(|| constraint.as_ref().map(|c| c.spec.clone()));
    checks.extend(constraint);
    // Tool-call markers are special tokens in most families (as vLLM, unless the client says).
    if tools.format.is_some() && fields.skip_special_tokens.is_none() {
        params.skip_special_tokens = false;
    }
    let mut template_vars = request.chat_template_kwargs.unwrap_or_default();
    let thinking = ["enable_thinking", "thinking"].iter().all(|k| template_vars.get(*k) != Some(&Value::Bool(false)));
    let parser = tools.output_parser(&tool_config, params.structured.is_some(), thinking);
    if let Some(t) = tools.template_tools {
        template_vars.insert("tools".to_owned(), t);
    }
    let prompt = PromptInput::Chat {
        messages: turns,
        add_generation_prompt: request.add_generation_prompt.unwrap_or(true),
        template_vars,
    };
    let request = GenerateRequest::new(prompt, params).with_grammar_checks(checks);
    let mut generation = frontend.generate(request).await?;
    // A refusal (every worker full) is a 429/503, not a 200 stream ending in an error.
    generation.refused().await?;
    let meta = ResponseMeta::new("chatcmpl", &frontend);
    if stream_requested {
        let include_usage = fields.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        stream(frontend, generation, meta, include_usage, logprobs.is_some(), parser)
    } else {
        Ok(collect(frontend, generation, meta, logprobs.is_some(), parser).await?.into_response())
    }
}

/// A fresh tool-call id, `call_` and 24 hex digits.
fn call_id() -> String {
    let mut id = uuid::Uuid::new_v4().simple().to_string();
    id.truncate(24);
    format!("call_{id}")
}

/// `tool_calls` when the choice made calls and stopped normally.
fn finish_reason(end: &ChoiceEnd, made_calls: bool) -> &'static str {
    match end.reason {
        FinishReason::Stop if made_calls => "tool_calls",
        _ => end.reason.as_openai_str(),
    }
}

fn message(parsed: ParsedOutput, parser: &OutputParser) -> AssistantMessage {
    let tool_calls: Vec<ToolCallOut> = parsed
        .calls
        .into_iter()
        .map(|c| ToolCallOut {
            id: call_id(),
            kind: "function",
            function: FunctionCallOut { name: c.name, arguments: c.arguments },
        })
        .collect();
    let content = (tool_calls.is_empty() || !parsed.content.is_empty()).then_some(parsed.content);
    let reasoning_content = (parser.reasoning.is_some() && !parsed.reasoning.is_empty()).then_some(parsed.reasoning);
    AssistantMessage { role: "assistant", content, reasoning_content, tool_calls }
}

async fn collect(
    frontend: Frontend,
    mut generation: Generation,
    meta: ResponseMeta,
    want_logprobs: bool,
    parser: OutputParser,
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
        .map(|(index, ((text, logprobs), end))| {
            let message = if parser.is_plain() {
                AssistantMessage {
                    role: "assistant",
                    content: Some(text),
                    reasoning_content: None,
                    tool_calls: Vec::new(),
                }
            } else {
                message(parser.parse(&text, true), &parser)
            };
            let made_calls = !message.tool_calls.is_empty();
            ChatChoice {
                index,
                message,
                logprobs,
                finish_reason: end.as_ref().map(|e| finish_reason(e, made_calls)),
                stop_reason: end.as_ref().and_then(stop_reason),
            }
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

/// One choice's parser state while streaming, with the ids of the calls it sent.
struct ChoiceStream {
    parser: StreamingParser,
    ids: Vec<String>,
}

impl ChoiceStream {
    /// The delta of a parser step (empty when there is nothing new).
    fn delta(&mut self, out: OutputDelta) -> ChatDelta {
        let calls: Vec<ToolCallDeltaOut> = out
            .calls
            .into_iter()
            .map(|c| {
                let first = c.name.is_some();
                if first {
                    self.ids.push(call_id());
                }
                ToolCallDeltaOut {
                    index: c.index,
                    id: first.then(|| self.ids.get(c.index).cloned().unwrap_or_default()),
                    kind: first.then_some("function"),
                    function: FunctionDeltaOut { name: c.name, arguments: c.arguments },
                }
            })
            .collect();
        ChatDelta {
            role: None,
            content: (!out.content.is_empty()).then_some(out.content),
            reasoning_content: (!out.reasoning.is_empty()).then_some(out.reasoning),
            tool_calls: (!calls.is_empty()).then_some(calls),
        }
    }
}

fn stream(
    frontend: Frontend,
    mut generation: Generation,
    meta: ResponseMeta,
    include_usage: bool,
    want_logprobs: bool,
    parser: OutputParser,
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
    let mut parsers: Vec<Option<ChoiceStream>> = (0..generation.num_choices())
        .map(|_| {
            (!parser.is_plain()).then(|| ChoiceStream { parser: StreamingParser::new(parser.clone()), ids: Vec::new() })
        })
        .collect();
    let events = async_stream::stream! {
        for index in 0..generation.num_choices() {
            let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
            let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None, stop_reason: None };
            yield frame.frame(&choice);
        }
        let mut completion_tokens = 0;
        while let Some(event) = generation.next().await {
            match event {
                ChoiceEvent::Delta(d) => {
                    let logprobs = (want_logprobs && !d.logprobs.is_empty())
                        .then(|| chat_logprobs(frontend.codec(), &d.logprobs));
                    let delta = match parsers.get_mut(d.index).and_then(Option::as_mut) {
                        Some(state) => {
                            let out = state.parser.push(&d.text);
                            let delta = state.delta(out);
                            // Text held back by the parser makes no chunk of its own.
                            if delta == ChatDelta::default() && logprobs.is_none() {
                                continue;
                            }
                            delta
                        }
                        None => {
                            // A step's tokens make a chunk even when their text is empty (see
                            // completions.rs): every token step reaches the client.
                            if d.token_ids.is_empty() && d.text.is_empty() && logprobs.is_none() {
                                continue;
                            }
                            ChatDelta { content: Some(d.text), ..Default::default() }
                        }
                    };
                    let choice = ChatChunkChoice { index: d.index, delta, logprobs, finish_reason: None, stop_reason: None };
                    yield frame.frame(&choice);
                }
                ChoiceEvent::Finished(end) => {
                    completion_tokens += end.completion_tokens;
                    let mut made_calls = false;
                    if let Some(state) = parsers.get_mut(end.index).and_then(Option::as_mut) {
                        let out = state.parser.finish();
                        let delta = state.delta(out);
                        made_calls = state.parser.made_calls();
                        if delta != ChatDelta::default() {
                            let choice = ChatChunkChoice { index: end.index, delta, logprobs: None, finish_reason: None, stop_reason: None };
                            yield frame.frame(&choice);
                        }
                    }
                    let choice = ChatChunkChoice {
                        index: end.index,
                        delta: ChatDelta::default(),
                        logprobs: None,
                        finish_reason: Some(finish_reason(&end, made_calls)),
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
