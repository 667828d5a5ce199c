//! A running request: the merged output of its `n` engine sequences, turned into per-choice
//! text events (incremental detokenization and stop strings applied).
//!
//! Invariants:
//! - Every choice ends with exactly one [`ChoiceEvent::Finished`] or [`ChoiceEvent::Failed`],
//!   after which no more events carry its index.
//! - When a stop string matches, the choice's engine stream is dropped right away, which
//!   aborts that sequence in the engine (its KV blocks are freed) while the other choices go on.
//! - Dropping the [`Generation`] aborts every unfinished sequence.
//! - One [`ChoiceEvent::Delta`] per engine step while the reader keeps up. When it falls
//!   behind (a slow client, a busy server), the outputs that queued up for a choice meanwhile
//!   are merged into one delta, so catching up costs one chunk per choice rather than one
//!   per step (the per-output metrics still see every step).
//! - Each choice holds one sequence of the in-flight budget ([`crate::admission::Permit`])
//!   until it ends, however it ends.

use crate::admission::Permit;
use crate::error::FrontendError;
use crate::pipeline::PreparedRequest;
use crate::text::ChoiceText;
use baton_core::api::{EngineError, EngineOutput, FinishReason, OutputStream, PromptLogprob, RequestId, TokenLogprob};
use baton_metrics::Metrics;
use futures::Stream;
use futures::stream::{self, BoxStream, StreamExt};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

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
    /// The prompt's logprobs (one per prompt token, the first `None`), on the choice's first
    /// delta when `prompt_logprobs` was requested; `None` on every other delta.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
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

struct ChoiceState {
    text: ChoiceText,
    completion_tokens: usize,
    cached_tokens: usize,
    last_token_at: Option<Instant>,
    done: bool,
    /// Its sequence of the in-flight budget, given back when the choice ends.
    permit: Option<Permit>,
}

/// The merged, detokenized output of one request's choices; a `Stream` of [`ChoiceEvent`]s.
pub struct Generation {
    request_ids: Vec<RequestId>,
    prompt_tokens: usize,
    /// The engine stream of each unfinished choice; `None` once it ended (dropping the stream
    /// aborts the sequence if the engine is still running it).
    streams: Vec<Option<OutputStream>>,
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

impl ChoiceEvent {
    /// The choice the event belongs to.
    pub fn index(&self) -> usize {
        match self {
            ChoiceEvent::Delta(d) => d.index,
            ChoiceEvent::Finished(e) => e.index,
            ChoiceEvent::Failed { index, .. } => *index,
        }
    }
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
        let mut permits = permits.into_iter();
        let choices = texts
            .into_iter()
            .map(|text| ChoiceState {
                text,
                completion_tokens: 0,
                cached_tokens: 0,
                last_token_at: None,
                done: false,
                permit: permits.next(),
            })
            .collect();
        Self {
            request_ids,
            prompt_tokens: prepared.prompt_token_ids.len(),
            streams: outputs.into_iter().map(Some).collect(),
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
        StreamExt::next(self).await
    }

    /// Waits for the generation's first event and answers the refusal it carries, if it is
    /// one: a remote engine at capacity or unreachable before anything was generated, or a
    /// request the engine found invalid before starting it (a grammar that does not
    /// compile: a 400 / `INVALID_ARGUMENT`). The
    /// edges call this before committing to a response, so such a request gets a 429/503 (or
    /// `RESOURCE_EXHAUSTED`/`UNAVAILABLE`) instead of a 200 stream that ends in an error.
    /// Any other first event is kept (at the front of the queue, where later steps of its
    /// choice still merge into it) and comes out of the stream as usual.
    pub async fn refused(&mut self) -> Result<(), FrontendError> {
        match self.next().await {
            Some(ChoiceEvent::Failed { error, .. }) if error.is_refusal() || error.is_client_error() => Err(error),
            Some(event) => {
                self.pending.push_front(event);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Takes in every output already queued on the choices' engine streams (registering for
    /// a wake-up on each stream that has none).
    fn drain_ready(&mut self, cx: &mut Context<'_>) {
        for index in 0..self.streams.len() {
            while let Some(stream) = self.streams.get_mut(index).and_then(Option::as_mut) {
                match stream.poll_next(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Some(Ok(output))) => self.on_output(index, output),
                    Poll::Ready(Some(Err(e))) => self.fail(index, e.into()),
                    // The engine side closed without a final output.
                    Poll::Ready(None) => self.fail(index, EngineError::Shutdown.into()),
                }
            }
        }
    }

    /// Queues a delta, merged into the choice's delta still waiting to be read, if any.
    fn push_delta(&mut self, delta: ChoiceDelta) {
        if delta.token_ids.is_empty() && delta.text.is_empty() && delta.prompt_logprobs.is_none() {
            return;
        }
        match self.pending.iter_mut().rev().find(|e| e.index() == delta.index) {
            Some(ChoiceEvent::Delta(waiting)) => {
                waiting.text.push_str(&delta.text);
                waiting.token_ids.extend_from_slice(&delta.token_ids);
                waiting.logprobs.extend(delta.logprobs);
                if waiting.prompt_logprobs.is_none() {
                    waiting.prompt_logprobs = delta.prompt_logprobs;
                }
            }
            _ => self.pending.push_back(ChoiceEvent::Delta(delta)),
        }
    }

    fn fail(&mut self, index: usize, error: FrontendError) {
        let Some(choice) = self.choices.get_mut(index) else { return };
        if choice.done {
            return;
        }
        choice.done = true;
        choice.permit = None;
        if let Some(slot) = self.streams.get_mut(index) {
            *slot = None;
        }
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

        let prompt_logprobs = (!output.prompt_logprobs.is_empty()).then_some(output.prompt_logprobs);
        let mut delta =
            ChoiceDelta { index, text: String::new(), token_ids: Vec::new(), logprobs: Vec::new(), prompt_logprobs };
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
            self.push_delta(delta);
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
        if let Some(slot) = self.streams.get_mut(index) {
            *slot = None;
        }
        self.metrics.observe_finished(now.duration_since(self.arrival), reason);
        self.push_delta(delta);
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
        && (error.is_refusal() || error.is_client_error())
    {
        return Err(error.clone());
    }
    Ok(stream::once(async move { first }).chain(events).boxed())
}

impl Stream for Generation {
    type Item = ChoiceEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ChoiceEvent>> {
        let this = self.get_mut();
        // Everything already queued first, so that outputs that piled up while the reader
        // was behind merge into one delta per choice.
        this.drain_ready(cx);
        if let Some(event) = this.pending.pop_front() {
            return Poll::Ready(Some(event));
        }
        if this.choices.iter().all(|c| c.done) {
            return Poll::Ready(None);
        }
        // Every unfinished choice's stream returned `Pending` and will wake this task.
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Admission, AdmissionLimits};
    use crate::text::TextCodec;
    use baton_core::api::AbortSink;
    use baton_core::params::SamplingParams;
    use baton_formats::testing::{TinySpec, write_hf_folder};
    use tokio::sync::mpsc;

    struct NoAbort;

    impl AbortSink for NoAbort {
        fn abort(&self, _id: RequestId) {}
    }

    fn step(token: u32, finish: Option<FinishReason>) -> Result<EngineOutput, EngineError> {
        Ok(EngineOutput {
            new_token_ids: vec![token],
            logprobs: Vec::new(),
            finish_reason: finish,
            stop_token: None,
            num_prompt_tokens: 3,
            num_cached_tokens: 0,
            prompt_logprobs: Vec::new(),
        })
    }

    fn delta_tokens(event: Option<ChoiceEvent>) -> (Vec<u32>, String) {
        match event {
            Some(ChoiceEvent::Delta(d)) => (d.token_ids, d.text),
            other => panic!("expected a delta, got {other:?}"),
        }
    }

    /// Outputs that queued up while the reader was away make one delta (tokens and text in
    /// order, nothing lost); a reader that keeps up gets one delta per engine step.
    #[tokio::test]
    async fn queued_steps_merge_into_one_delta_and_a_prompt_reader_gets_one_per_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_hf_folder(&dir.path().join("tiny"), &TinySpec::llama()).expect("tiny model");
        let model = baton_formats::load_model(&path, baton_formats::LoadFormat::Auto).expect("loads");
        let tokenizer = model.tokenizer.expect("tokenizer");
        let tokens = tokenizer.encode("merged steps keep every token in order", false).expect("encode");
        assert!(tokens.len() >= 6, "{tokens:?}");
        let codec = TextCodec::new(tokenizer.clone(), model.chat_template);
        let prepared = PreparedRequest {
            prompt_token_ids: tokens[..3].to_vec(),
            prompt_text: None,
            params: SamplingParams { max_tokens: Some(6), ..SamplingParams::default() },
            arrival: Instant::now(),
        };
        let text = ChoiceText::new(&codec, &prepared.params, &prepared.prompt_token_ids).expect("choice text");
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = OutputStream::new(RequestId(1), rx, Arc::new(NoAbort));
        let metrics = Arc::new(Metrics::new("test").expect("metrics"));
        let mut g = Generation::new(vec![stream], vec![text], Vec::new(), &prepared, metrics);

        let out = &tokens[..6];
        for &t in &out[..3] {
            tx.send(step(t, None)).expect("send");
        }
        let mut texts = String::new();
        let (ids, text) = delta_tokens(g.next().await);
        assert_eq!(ids, out[..3], "three queued steps, one delta");
        texts.push_str(&text);
        for &t in &out[3..5] {
            tx.send(step(t, None)).expect("send");
            let (ids, text) = delta_tokens(g.next().await);
            assert_eq!(ids, [t], "read as it arrives: one delta per step");
            texts.push_str(&text);
        }
        tx.send(step(out[5], Some(FinishReason::Length))).expect("send");
        let (ids, text) = delta_tokens(g.next().await);
        assert_eq!(ids, [out[5]]);
        texts.push_str(&text);
        match g.next().await {
            Some(ChoiceEvent::Finished(end)) => {
                assert_eq!((end.index, end.reason, end.completion_tokens), (0, FinishReason::Length, 6));
            }
            other => panic!("expected the finish, got {other:?}"),
        }
        assert!(g.next().await.is_none());
        assert_eq!(texts, tokenizer.decode(out, true).expect("decode"));
    }

    type Sender = mpsc::UnboundedSender<Result<EngineOutput, EngineError>>;

    /// A generation of `n` choices over channels the test feeds, each choice holding one
    /// sequence of `gate`'s budget; also some token ids of the tiny model's vocabulary.
    fn choices_with_permits(n: usize, gate: &Arc<Admission>) -> (Generation, Vec<Sender>, Vec<u32>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_hf_folder(&dir.path().join("tiny"), &TinySpec::llama()).expect("tiny model");
        let model = baton_formats::load_model(&path, baton_formats::LoadFormat::Auto).expect("loads");
        let tokenizer = model.tokenizer.expect("tokenizer");
        let tokens = tokenizer.encode("permits come back however a choice ends", false).expect("encode");
        assert!(tokens.len() >= 6, "{tokens:?}");
        let codec = TextCodec::new(tokenizer, model.chat_template);
        let prepared = PreparedRequest {
            prompt_token_ids: tokens[..3].to_vec(),
            prompt_text: None,
            params: SamplingParams { max_tokens: Some(6), ..SamplingParams::default() },
            arrival: Instant::now(),
        };
        let mut permit = gate.try_acquire(n).expect("room in the gate");
        let (mut streams, mut texts, mut permits, mut senders) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            streams.push(OutputStream::new(RequestId(i as u64 + 1), rx, Arc::new(NoAbort)));
            texts.push(ChoiceText::new(&codec, &prepared.params, &prepared.prompt_token_ids).expect("choice text"));
            permits.push(permit.split(1));
            senders.push(tx);
        }
        assert_eq!(permit.count(), 0, "every sequence went to a choice");
        let metrics = Arc::new(Metrics::new("test").expect("metrics"));
        (Generation::new(streams, texts, permits, &prepared, metrics), senders, tokens[3..].to_vec())
    }

    fn gate() -> Arc<Admission> {
        Admission::new(AdmissionLimits { max_inflight: 8, max_sequences_per_request: 8 })
    }

    /// Each choice gives its sequence back as it ends, whether it finished or failed, and
    /// dropping the generation gives back those of the choices still running.
    #[tokio::test]
    async fn each_choice_gives_its_permit_back_when_it_finishes_fails_or_is_dropped() {
        let gate = gate();
        let (mut g, senders, tokens) = choices_with_permits(3, &gate);
        assert_eq!(gate.inflight(), 3);

        senders[0].send(step(tokens[0], None)).expect("send");
        assert_eq!(delta_tokens(g.next().await).0, [tokens[0]]);
        assert_eq!(gate.inflight(), 3, "a running choice keeps its permit");

        senders[0].send(step(tokens[1], Some(FinishReason::Length))).expect("send");
        assert_eq!(delta_tokens(g.next().await).0, [tokens[1]]);
        assert!(matches!(g.next().await, Some(ChoiceEvent::Finished(ChoiceEnd { index: 0, .. }))));
        assert_eq!(gate.inflight(), 2, "the finished choice gave its permit back");

        senders[1].send(Err(EngineError::Unschedulable("too long".into()))).expect("send");
        assert!(matches!(g.next().await, Some(ChoiceEvent::Failed { index: 1, .. })));
        assert_eq!(gate.inflight(), 1, "the failed choice gave its permit back");

        drop(g);
        assert_eq!(gate.inflight(), 0, "dropping the generation gave back the running choice's permit");
    }

    /// A refusal as the first event is answered by `refused` (and gives the permits back
    /// once the generation goes); any other first event stays queued, at the front, where the
    /// choice's next steps still merge into it.
    #[tokio::test]
    async fn refused_answers_a_first_event_refusal_and_keeps_any_other_first_event() {
        let gate = gate();
        let (mut g, senders, _) = choices_with_permits(2, &gate);
        senders[0].send(Err(EngineError::Overloaded("every worker is full".into()))).expect("send");
        let e = g.refused().await.expect_err("a refusal");
        assert!(e.is_refusal(), "{e:?}");
        assert_eq!(gate.inflight(), 1, "the refused choice gave its permit back");
        drop(g);
        assert_eq!(gate.inflight(), 0);

        let (mut g, senders, tokens) = choices_with_permits(1, &gate);
        senders[0].send(step(tokens[0], None)).expect("send");
        g.refused().await.expect("a delta is no refusal");
        senders[0].send(step(tokens[1], None)).expect("send");
        assert_eq!(delta_tokens(g.next().await).0, tokens[..2], "the kept delta and the next step, merged");
        senders[0].send(step(tokens[2], Some(FinishReason::Length))).expect("send");
        assert_eq!(delta_tokens(g.next().await).0, [tokens[2]]);
        assert!(matches!(g.next().await, Some(ChoiceEvent::Finished(ChoiceEnd { completion_tokens: 3, .. }))));
        assert!(g.next().await.is_none());
        assert_eq!(gate.inflight(), 0);

        // A failure that is not a refusal is the stream's to report, as its first event.
        let (mut g, senders, _) = choices_with_permits(1, &gate);
        senders[0].send(Err(EngineError::Unschedulable("too long".into()))).expect("send");
        g.refused().await.expect("not a refusal");
        match g.next().await {
            Some(ChoiceEvent::Failed { index: 0, error }) => assert!(!error.is_refusal(), "{error:?}"),
            other => panic!("expected the failure, got {other:?}"),
        }
        assert!(g.next().await.is_none());
        assert_eq!(gate.inflight(), 0);
    }
}
