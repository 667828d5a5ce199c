//! `POST /v1/completions`: prompts as a string, a list of strings, token ids or a list of
//! token-id lists; `echo`; legacy-format logprobs; streaming `text_completion` chunks.
//!
//! `echo` with `logprobs` lists the prompt's tokens first in the legacy `logprobs` (the first
//! with `null` logprob and alternatives), then the generated ones, with text offsets running
//! over the prompt's tokens; vLLM's `prompt_logprobs` adds the per-choice map list. Both come
//! from the engine's prompt logprobs, with the choice's first output; when streaming, such an
//! echo goes out with that first delta rather than in a chunk of its own.
//!
//! Every prompt is validated and tokenized before any is submitted, so one bad prompt in a
//! batch fails the whole request without starting work. Choice `index` is
//! `prompt_index * n + sample_index`, as OpenAI numbers them.

use super::error::ApiError;
use super::extract::JsonBody;
use super::fields::{Endpoint, check_fields};
use super::logprobs::{CompletionLogprobsBuilder, extend_completion_logprobs, vllm_prompt_logprobs};
use super::params::{EndpointParams, count, sampling_params, top_logprobs};
use super::protocol::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptField, PromptLogprobs,
    SamplingFields, StructuredFields, Usage, UsageField,
};
use super::sse::{ChunkFrame, ResponseMeta, done_frame, error_frame, json_frame, sse_response};
use super::stop_reason;
use super::structured;
use crate::error::FrontendError;
use crate::generation::{ChoiceEnd, ChoiceEvent, Generation, refused_first};
use crate::pipeline::{Frontend, GenerateRequest, PromptInput};
use crate::text::TextCodec;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use baton_core::api::PromptLogprob;
use futures::stream::{BoxStream, StreamExt, select_all};
use std::sync::Arc;

/// vLLM's and OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Most prompts in one completions request. Neither OpenAI nor vLLM documents a cap, but
/// every prompt is tokenized on the request path and becomes `n` engine requests, so a body of
/// thousands of tiny prompts costs far more than its size suggests; 1024 is ample for batch
/// clients (the router's own `prompts × n` cap bounds the fan-out as a whole).
pub const MAX_PROMPTS: usize = 1024;

/// Handler of `POST /v1/completions`.
pub async fn completions(State(frontend): State<Frontend>, body: JsonBody) -> Response {
    match handle(frontend, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

fn token_ids(param: &str, ids: Vec<i64>) -> Result<Vec<u32>, FrontendError> {
    ids.into_iter()
        .map(|t| u32::try_from(t).map_err(|_| FrontendError::invalid(param, format!("{t} is not a valid token id"))))
        .collect()
}

/// How many prompts `field` holds.
fn prompt_count(field: &PromptField) -> usize {
    match field {
        PromptField::Texts(v) => v.len(),
        PromptField::TokenLists(v) => v.len(),
        PromptField::Text(_) | PromptField::Tokens(_) => 1,
    }
}

fn prompts(field: PromptField, add_special_tokens: bool) -> Result<Vec<PromptInput>, FrontendError> {
    let count = prompt_count(&field);
    if count > MAX_PROMPTS {
        return Err(FrontendError::invalid(
            "prompt",
            format!("at most {MAX_PROMPTS} prompts per request, got {count}"),
        ));
    }
    let text = |text: String| PromptInput::Text { text, add_special_tokens };
    let prompts = match field {
        PromptField::Text(t) => vec![text(t)],
        PromptField::Texts(v) => v.into_iter().map(text).collect(),
        PromptField::Tokens(ids) => vec![PromptInput::Tokens(token_ids("prompt", ids)?)],
        PromptField::TokenLists(lists) => lists
            .into_iter()
            .enumerate()
            .map(|(i, ids)| Ok(PromptInput::Tokens(token_ids(&format!("prompt[{i}]"), ids)?)))
            .collect::<Result<_, FrontendError>>()?,
    };
    if prompts.is_empty() {
        return Err(FrontendError::invalid("prompt", "prompt must not be an empty list"));
    }
    Ok(prompts)
}

/// Per-choice output state shared by the streaming and collecting paths.
struct ChoiceOut {
    logprobs: Option<CompletionLogprobsBuilder>,
    /// With `echo` and `logprobs`: the prompt's token ids, whose logprobs lead the choice's.
    echo_prompt: Option<Arc<[u32]>>,
    /// The `logprobs` count (alternatives per token in the legacy view).
    echo_k: usize,
    /// vLLM's `prompt_logprobs` count, when asked for.
    vllm_k: Option<usize>,
}

impl ChoiceOut {
    /// The views of a choice's prompt logprobs (sent once, with its first delta): the legacy
    /// logprobs of the echoed prompt, and vLLM's `prompt_logprobs`, each with its own count.
    fn prompt_views(
        &mut self,
        codec: &TextCodec,
        entries: &[Option<PromptLogprob>],
    ) -> (Option<CompletionLogprobs>, Option<PromptLogprobs>) {
        let legacy = match (&self.echo_prompt, self.logprobs.as_mut()) {
            (Some(ids), Some(builder)) => Some(builder.push_prompt(codec, ids, &truncated(entries, self.echo_k))),
            _ => None,
        };
        let vllm = self.vllm_k.map(|k| vllm_prompt_logprobs(codec, &truncated(entries, k)));
        (legacy, vllm)
    }
}

/// `entries` with at most `k` alternatives each (the engine computed the larger count of the
/// two views).
fn truncated(entries: &[Option<PromptLogprob>], k: usize) -> Vec<Option<PromptLogprob>> {
    entries
        .iter()
        .map(|e| e.as_ref().map(|lp| PromptLogprob { top: lp.top.iter().take(k).copied().collect(), ..lp.clone() }))
        .collect()
}

async fn handle(frontend: Frontend, body: JsonBody) -> Result<Response, ApiError> {
    let request: CompletionRequest = body.parse()?;
    check_fields(&body.parse::<serde_json::Value>()?, Endpoint::Completions)?;
    let fields: SamplingFields = body.parse()?;
    frontend.check_model(fields.model.as_deref())?;
    let logprobs = request.logprobs.map(|k| top_logprobs("logprobs", k)).transpose()?;
    let echo = request.echo.unwrap_or(false);
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(FrontendError::invalid("suffix", "suffix is not supported").into());
    }
    let max_tokens = fields.max_tokens.map(|v| ("max_tokens", v));
    let mut params = sampling_params(
        &fields,
        EndpointParams { max_tokens, default_max_tokens: Some(DEFAULT_MAX_TOKENS), logprobs },
    )?;
    // `echo` with `logprobs` scores the prompt too (the legacy view); vLLM's `prompt_logprobs`
    // is the other view. The engine computes the larger count once, each view keeps its own.
    let vllm_k = params.prompt_logprobs;
    let echo_k = logprobs.filter(|_| echo);
    params.prompt_logprobs = vllm_k.max(echo_k);
    let constraint = structured::grammar(&body.parse::<StructuredFields>()?)?;
    params.structured = constraint.as_ref().map(|c| c.spec.clone());
    if let Some(best_of) = request.best_of
        && count("best_of", best_of)? != params.n
    {
        return Err(FrontendError::invalid("best_of", "best_of other than n is not supported").into());
    }
    let n = params.n;
    // The request's size before anything else about its prompts: prompts × n within the
    // per-request cap (the 400 names both numbers), then the prompt count on its own.
    frontend.admission().check_size(prompt_count(&request.prompt), n)?;
    let inputs = prompts(request.prompt, request.add_special_tokens.unwrap_or(true))?;
    // Admitted as a whole before any prompt is tokenized: prompts × n within the per-request
    // cap, and room for all of them in flight.
    let mut permit = frontend.admit(inputs.len(), n)?;
    // One compile check for all prompts (they share the grammar).
    frontend.check_grammars(constraint.into_iter().collect()).await?;
    let mut prepared = Vec::with_capacity(inputs.len());
    for prompt in inputs {
        prepared.push(frontend.prepare(GenerateRequest::new(prompt, params.clone())).await?);
    }
    let mut echoes = Vec::with_capacity(prepared.len());
    let mut prompt_ids: Vec<Arc<[u32]>> = Vec::with_capacity(prepared.len());
    let mut prompt_tokens = 0;
    let mut generations = Vec::with_capacity(prepared.len());
    for p in prepared {
        prompt_ids.push(p.prompt_token_ids.as_slice().into());
        let echo_text = match (echo, &p.prompt_text) {
            (false, _) => String::new(),
            (true, Some(text)) => text.clone(),
            (true, None) => decode_prompt(&frontend, p.prompt_token_ids.clone(), params.skip_special_tokens).await?,
        };
        echoes.push(echo_text);
        prompt_tokens += p.prompt_token_ids.len();
        generations.push(frontend.start(p, &mut permit)?);
    }
    // One merged stream of (global choice index, event).
    // A refusal (every worker full) is a 429/503, not a 200 stream ending in an error.
    let merged: BoxStream<'static, (usize, ChoiceEvent)> = match <[Generation; 1]>::try_from(generations) {
        Ok([mut one]) => {
            one.refused().await?;
            one.map(|e| (e.index(), e)).boxed()
        }
        Err(generations) => {
            let merged = select_all(
                generations.into_iter().enumerate().map(|(p, g)| g.map(move |e| (p * n + e.index(), e)).boxed()),
            )
            .boxed();
            refused_first(merged, |(_, e)| e).await?
        }
    };
    let outs: Vec<ChoiceOut> = (0..echoes.len() * n)
        .map(|i| {
            let echo_prompt = echo_k.map(|_| prompt_ids[i / n].clone());
            // Offsets run over the prompt's tokens first when they are listed, else over the
            // echoed text.
            let start = if echo_prompt.is_some() { 0 } else { echoes[i / n].chars().count() };
            ChoiceOut {
                logprobs: logprobs.map(|_| CompletionLogprobsBuilder::starting_at(start)),
                echo_prompt,
                echo_k: logprobs.unwrap_or(0),
                vllm_k,
            }
        })
        .collect();
    let meta = ResponseMeta::new("cmpl", &frontend);
    let echoes: Vec<String> = (0..echoes.len() * n).map(|i| echoes[i / n].clone()).collect();
    if fields.stream.unwrap_or(false) {
        let include_usage = fields.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        stream(frontend, merged, outs, echoes, meta, include_usage, prompt_tokens)
    } else {
        collect(frontend, merged, outs, echoes, meta, prompt_tokens).await
    }
}

/// The text of a token prompt, for `echo`, decoded on the text pool.
async fn decode_prompt(frontend: &Frontend, ids: Vec<u32>, skip_special_tokens: bool) -> Result<String, ApiError> {
    let codec = frontend.codec_handle();
    Ok(frontend.offload().run(move || codec.decode(&ids, skip_special_tokens)).await??)
}

async fn collect(
    frontend: Frontend,
    mut merged: BoxStream<'static, (usize, ChoiceEvent)>,
    mut outs: Vec<ChoiceOut>,
    mut texts: Vec<String>,
    meta: ResponseMeta,
    prompt_tokens: usize,
) -> Result<Response, ApiError> {
    let mut logprobs: Vec<Option<CompletionLogprobs>> =
        outs.iter().map(|o| o.logprobs.as_ref().map(|_| CompletionLogprobs::default())).collect();
    let mut ends: Vec<Option<ChoiceEnd>> = vec![None; texts.len()];
    let mut prompt_logprobs: Vec<Option<PromptLogprobs>> = vec![None; texts.len()];
    while let Some((index, event)) = merged.next().await {
        match event {
            ChoiceEvent::Delta(d) => {
                if let Some(text) = texts.get_mut(index) {
                    text.push_str(&d.text);
                }
                if let (Some(entries), Some(out)) = (&d.prompt_logprobs, outs.get_mut(index)) {
                    let (legacy, vllm) = out.prompt_views(frontend.codec(), entries);
                    if let (Some(legacy), Some(Some(acc))) = (legacy, logprobs.get_mut(index)) {
                        extend_completion_logprobs(acc, legacy);
                    }
                    if let Some(slot) = prompt_logprobs.get_mut(index) {
                        *slot = vllm;
                    }
                }
                if let (Some(Some(builder)), Some(Some(acc))) =
                    (outs.get_mut(index).map(|o| o.logprobs.as_mut()), logprobs.get_mut(index))
                {
                    extend_completion_logprobs(acc, builder.push(frontend.codec(), &d.logprobs));
                }
            }
            ChoiceEvent::Finished(end) => {
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
        .zip(prompt_logprobs)
        .enumerate()
        .map(|(index, (((text, logprobs), end), prompt_logprobs))| CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: end.as_ref().map(|e| e.reason.as_openai_str()),
            stop_reason: end.as_ref().and_then(stop_reason),
            prompt_logprobs,
        })
        .collect();
    let response = CompletionResponse {
        id: meta.id,
        object: "text_completion",
        created: meta.created,
        model: meta.model,
        choices,
        usage: UsageField::Counts(Usage::new(prompt_tokens, completion_tokens)),
    };
    Ok(axum::Json(response).into_response())
}

fn stream(
    frontend: Frontend,
    mut merged: BoxStream<'static, (usize, ChoiceEvent)>,
    mut outs: Vec<ChoiceOut>,
    echoes: Vec<String>,
    meta: ResponseMeta,
    include_usage: bool,
    prompt_tokens: usize,
) -> Result<Response, ApiError> {
    let usage_field = if include_usage { UsageField::Null } else { UsageField::Absent };
    let chunk = move |choices: Vec<CompletionChoice>, usage: UsageField| CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion",
        created: meta.created,
        model: meta.model.clone(),
        choices,
        usage,
    };
    // Every chunk but the usage one has one choice: render the rest once.
    let frame = ChunkFrame::new(&chunk(Vec::new(), usage_field)).map_err(|e| FrontendError::Internal(e.to_string()))?;
    // An echo whose prompt logprobs are listed waits for them: it goes out with the choice's
    // first delta. Any other echo goes out at once, in a chunk of its own.
    let mut held_echoes: Vec<String> = Vec::with_capacity(echoes.len());
    let mut early_echoes = Vec::new();
    for (index, echo) in echoes.into_iter().enumerate() {
        if outs.get(index).is_some_and(|o| o.echo_prompt.is_some()) {
            held_echoes.push(echo);
        } else {
            held_echoes.push(String::new());
            if !echo.is_empty() {
                early_echoes.push((index, echo));
            }
        }
    }
    let events = async_stream::stream! {
        for (index, echo) in early_echoes {
            let choice = CompletionChoice {
                index,
                text: echo,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
                prompt_logprobs: None,
            };
            yield frame.frame(&choice);
        }
        let mut completion_tokens = 0;
        while let Some((index, event)) = merged.next().await {
            match event {
                ChoiceEvent::Delta(mut d) => {
                    let (mut logprobs, mut prompt_logprobs) = (None, None);
                    if let (Some(entries), Some(out)) = (&d.prompt_logprobs, outs.get_mut(index)) {
                        (logprobs, prompt_logprobs) = out.prompt_views(frontend.codec(), entries);
                    }
                    // The choice's first delta carries its held echo.
                    if let Some(echo) = held_echoes.get_mut(index).filter(|e| !e.is_empty()) {
                        d.text.insert_str(0, &std::mem::take(echo));
                    }
                    let generated = outs
                        .get_mut(index)
                        .and_then(|o| o.logprobs.as_mut())
                        .map(|b| b.push(frontend.codec(), &d.logprobs));
                    let logprobs = match (logprobs, generated) {
                        (Some(mut prompt), Some(generated)) => {
                            extend_completion_logprobs(&mut prompt, generated);
                            Some(prompt)
                        }
                        (prompt, generated) => prompt.or(generated),
                    };
                    // A step's tokens make a chunk even when their text is empty (held back
                    // by a possible stop string, or special tokens skipped), as vLLM sends
                    // them: clients then see every token step arrive (TTFT, ITL).
                    if d.token_ids.is_empty() && d.text.is_empty() && logprobs.as_ref().is_none_or(|l| l.tokens.is_empty()) {
                        continue;
                    }
                    let choice = CompletionChoice {
                        index,
                        text: d.text,
                        logprobs,
                        finish_reason: None,
                        stop_reason: None,
                        prompt_logprobs,
                    };
                    yield frame.frame(&choice);
                }
                ChoiceEvent::Finished(end) => {
                    completion_tokens += end.completion_tokens;
                    let choice = CompletionChoice {
                        index,
                        text: String::new(),
                        logprobs: None,
                        finish_reason: Some(end.reason.as_openai_str()),
                        stop_reason: stop_reason(&end),
                        prompt_logprobs: None,
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
            let usage = Usage::new(prompt_tokens, completion_tokens);
            yield json_frame(&chunk(Vec::new(), UsageField::Counts(usage)));
        }
        yield done_frame();
    };
    Ok(sse_response(events))
}
