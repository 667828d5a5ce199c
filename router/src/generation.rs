//! A running request: the merged output of its `n` engine sequences, turned into per-choice
//! text events (incremental detokenization and stop strings applied).
//!
//! Invariants:
//! - Every choice ends with exactly one [`ChoiceEvent::Finished`] or [`ChoiceEvent::Failed`],
//!   after which no more events carry its index.
//! - When a stop string matches, the choice's engine stream is dropped right away, which
//!   aborts that sequence in the engine (its KV blocks are freed) while the other choices go on.
//! - Dropping the [`Generation`] aborts every unfinished sequence.
//! - Each choice holds one sequence of the in-flight budget ([`crate::admission::Permit`])
//!   until it ends, however it ends.

use crate::admission::Permit;
use crate::error::FrontendError;
use crate::metrics::Metrics;
use crate::pipeline::PreparedRequest;
use crate::text::ChoiceText;
use baton_core::api::{EngineError, EngineOutput, FinishReason, OutputStream, RequestId, TokenLogprob};
use futures::stream::{self, BoxStream, StreamExt};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::StreamMap;

/// New output of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceDelta {
    /// Which of the `n` choices.
    pub index: usize,
    /// Text that became final since the last delta (may be empty while text is held back
    /// for an incomplete UTF-8 sequence or a partial stop-string match).
    pub text: String,
    /// Tokens generated since the last delta.
    pub token_ids: Vec<u32>,
    /// Parallel to `token_ids` when logprobs were requested.
    pub logprobs: Vec<TokenLogprob>,
}

/// What ended a choice beyond the bare reason (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCause {
    /// EOS, the length limit, or an abort.
    None,
    /// This stop string matched.
    String(String),
    /// This stop token id (from `stop_token_ids`) was generated.
    Token(u32),
}

/// The end of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceEnd {
    /// Which of the `n` choices.
    pub index: usize,
    /// Why it finished.
    pub reason: FinishReason,
    /// What exactly stopped it.
    pub cause: StopCause,
    /// Tokens generated for this choice.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// One event of a running generation.
#[derive(Debug, Clone, PartialEq)]
pub enum ChoiceEvent {
    /// New tokens (and maybe text) for a choice.
    Delta(ChoiceDelta),
    /// A choice finished normally.
    Finished(ChoiceEnd),
    /// A choice failed in the engine.
    Failed {
        /// Which of the `n` choices.
        index: usize,
        /// What went wrong.
        error: FrontendError,
    },
}

type ChildStream = BoxStream<'static, Option<Result<EngineOutput, EngineError>>>;

struct ChoiceState {
    text: ChoiceText,
    completion_tokens: usize,
    cached_tokens: usize,
    last_token_at: Option<Instant>,
    done: bool,
    /// Its sequence of the in-flight budget, given back when the choice ends.
    permit: Option<Permit>,
}

/// The merged, detokenized output of one request's choices.
pub struct Generation {
    request_ids: Vec<RequestId>,
    prompt_tokens: usize,
    streams: StreamMap<usize, ChildStream>,
    choices: Vec<ChoiceState>,
    pending: VecDeque<ChoiceEvent>,
    stop_token_ids: Vec<u32>,
    metrics: Arc<Metrics>,
    arrival: Instant,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation").field("request_ids", &self.request_ids).finish_non_exhaustive()
    }
}

/// Yields every engine output, then `None` once the engine side is closed, so that a stream
/// that ends without a final output is noticed instead of silently leaving the map.
fn child_stream(out: OutputStream) -> ChildStream {
    stream::unfold(out, |mut out| async move { out.next().await.map(|item| (item, out)) })
        .map(Some)
        .chain(stream::once(async { None }))
        .boxed()
}

impl Generation {
    /// Wraps the engine streams of a request's choices; `texts[i]` decodes choice `i` and
    /// `permits[i]` is its admission.
    pub(crate) fn new(
        outputs: Vec<OutputStream>,
        texts: Vec<ChoiceText>,
        permits: Vec<Permit>,
        prepared: &PreparedRequest,
        metrics: Arc<Metrics>,
    ) -> Self {
        let request_ids = outputs.iter().map(OutputStream::request_id).collect();
        let mut streams = StreamMap::with_capacity(outputs.len());
        let mut choices = Vec::with_capacity(outputs.len());
        let mut permits = permits.into_iter();
        for (index, (out, text)) in outputs.into_iter().zip(texts).enumerate() {
            streams.insert(index, child_stream(out));
            choices.push(ChoiceState {
                text,
                completion_tokens: 0,
                cached_tokens: 0,
                last_token_at: None,
                done: false,
                permit: permits.next(),
            });
        }
        Self {
            request_ids,
            prompt_tokens: prepared.prompt_token_ids.len(),
            streams,
            choices,
            pending: VecDeque::new(),
            stop_token_ids: prepared.params.stop_token_ids.clone(),
            metrics,
            arrival: prepared.arrival,
        }
    }

    /// Engine ids of the choices, in choice order.
    pub fn request_ids(&self) -> &[RequestId] {
        &self.request_ids
    }

    /// Number of choices.
    pub fn num_choices(&self) -> usize {
        self.choices.len()
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The next event; `None` once every choice has finished or failed.
    pub async fn next(&mut self) -> Option<ChoiceEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.choices.iter().all(|c| c.done) {
                return None;
            }
            match self.streams.next().await {
                Some((index, Some(Ok(output)))) => self.on_output(index, output),
                Some((index, Some(Err(e)))) => self.fail(index, e.into()),
                Some((index, None)) => self.fail(index, EngineError::Shutdown.into()),
                None => {
                    // Unreachable while a choice is unfinished (its stream is still in the
                    // map), but never hang if it happens.
                    for index in 0..self.choices.len() {
                        self.fail(index, EngineError::Shutdown.into());
                    }
                }
            }
        }
    }

    /// Waits for the generation's first event and answers the refusal it carries, if it is
    /// one: a remote engine at capacity or unreachable before anything was generated. The
    /// edges call this before committing to a response, so such a request gets a 429/503 (or
    /// `RESOURCE_EXHAUSTED`/`UNAVAILABLE`) instead of a 200 stream that ends in an error.
    /// Any other first event is kept and comes out of [`Generation::next`] as usual.
    pub async fn refused(&mut self) -> Result<(), FrontendError> {
        match self.next().await {
            Some(ChoiceEvent::Failed { error, .. }) if error.is_refusal() => Err(error),
            Some(event) => {
                self.pending.push_front(event);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Turns the generation into a `Stream` of events.
    pub fn into_stream(self) -> BoxStream<'static, ChoiceEvent> {
        stream::unfold(self, |mut g| async move { g.next().await.map(|e| (e, g)) }).boxed()
    }

    fn fail(&mut self, index: usize, error: FrontendError) {
        let Some(choice) = self.choices.get_mut(index) else { return };
        if choice.done {
            return;
        }
        choice.done = true;
        choice.permit = None;
        self.streams.remove(&index);
        self.pending.push_back(ChoiceEvent::Failed { index, error });
    }

    fn on_output(&mut self, index: usize, output: EngineOutput) {
        let now = Instant::now();
        let Some(choice) = self.choices.get_mut(index) else { return };
        if choice.done {
            return;
        }
        choice.cached_tokens = output.num_cached_tokens;
        if !output.new_token_ids.is_empty() {
            match choice.last_token_at {
                None => self.metrics.observe_ttft(now.duration_since(self.arrival)),
                Some(prev) => self.metrics.observe_itl(now.duration_since(prev)),
            }
            choice.last_token_at = Some(now);
            self.metrics.add_generation_tokens(output.new_token_ids.len());
        }

        let mut delta = ChoiceDelta { index, text: String::new(), token_ids: Vec::new(), logprobs: Vec::new() };
        let mut stopped_by: Option<String> = None;
        let last = output.new_token_ids.len().saturating_sub(1);
        for (i, &token) in output.new_token_ids.iter().enumerate() {
            choice.completion_tokens += 1;
            delta.token_ids.push(token);
            if let Some(lp) = output.logprobs.get(i) {
                delta.logprobs.push(lp.clone());
            }
            // The token that stopped the sequence (EOS or a stop id) is counted but not shown,
            // unless the client asked to keep stop strings.
            let is_stop_token = i == last && output.stop_token == Some(token);
            if is_stop_token && !choice.text.include_stop_str() {
                continue;
            }
            let pushed = match choice.text.push(token) {
                Ok(p) => p,
                Err(e) => return self.fail(index, e),
            };
            delta.text.push_str(&pushed.text);
            if let Some(stop) = pushed.stopped_by {
                stopped_by = Some(stop);
                break;
            }
        }

        let reason = if stopped_by.is_some() { Some(FinishReason::Stop) } else { output.finish_reason };
        let Some(reason) = reason else {
            if !delta.token_ids.is_empty() || !delta.text.is_empty() {
                self.pending.push_back(ChoiceEvent::Delta(delta));
            }
            return;
        };
        if stopped_by.is_none() {
            // Nothing can match any more: release text held back for a partial stop match.
            match choice.text.finish() {
                Ok(rest) => delta.text.push_str(&rest),
                Err(e) => return self.fail(index, e),
            }
        }
        let cause = match (stopped_by, output.stop_token) {
            (Some(s), _) => StopCause::String(s),
            (None, Some(t)) if self.stop_token_ids.contains(&t) => StopCause::Token(t),
            _ => StopCause::None,
        };
        choice.done = true;
        choice.permit = None;
        let end = ChoiceEnd {
            index,
            reason,
            cause,
            completion_tokens: choice.completion_tokens,
            cached_tokens: choice.cached_tokens,
        };
        // Dropping the engine stream aborts the sequence if the engine is still running it
        // (stop string); for a normal finish it is a no-op.
        self.streams.remove(&index);
        self.metrics.observe_finished(now.duration_since(self.arrival), reason);
        if !delta.token_ids.is_empty() || !delta.text.is_empty() {
            self.pending.push_back(ChoiceEvent::Delta(delta));
        }
        self.pending.push_back(ChoiceEvent::Finished(end));
    }
}

/// [`Generation::refused`] for a merged stream of several generations' events (a completions
/// request with several prompts): a refusal as the very first event fails the request;
/// otherwise the stream comes back whole.
pub async fn refused_first<T: Send + 'static>(
    mut events: BoxStream<'static, T>,
    event: impl Fn(&T) -> &ChoiceEvent,
) -> Result<BoxStream<'static, T>, FrontendError> {
    let Some(first) = events.next().await else { return Ok(events) };
    if let ChoiceEvent::Failed { error, .. } = event(&first)
        && error.is_refusal()
    {
        return Err(error.clone());
    }
    Ok(stream::once(async move { first }).chain(events).boxed())
}
