//! The engine's public seam: what a frontend (HTTP/gRPC router, tests, the
//! disaggregation orchestrator) submits and what comes back.
//!
//! Everything here is plain data except [`OutputStream`], a channel receiver
//! (unbounded on purpose, bounded in practice by `max_model_len`; see its doc) that
//! aborts its request when dropped. Engine requests are always a
//! single sequence; `n > 1` is a fan-out done by the frontend
//! ([`crate::params::SamplingParams::fan_out`]) with [`EngineRequest::share_prefix_with`]
//! pointing at the first child so the prompt's KV blocks are computed once.

use crate::params::{ParamError, SamplingParams};
use std::time::Instant;
use tokio::sync::mpsc;

/// Engine-assigned id of one sequence request. Unique per engine instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Prompt tokens (already templated and tokenized by the frontend). Non-empty.
    pub prompt_token_ids: Vec<u32>,
    /// Sampling parameters; `n` must be 1 here (the frontend fans out).
    pub params: SamplingParams,
    /// Lower value runs first when the scheduler uses priority order; FCFS among equals.
    pub priority: i32,
    /// When set, this request waits until the named request's prompt is computed, so that its
    /// prompt blocks are prefix-cache hits instead of being computed twice (`n > 1`).
    pub share_prefix_with: Option<RequestId>,
    /// When the frontend received the request (for queue-time metrics).
    pub arrival: Instant,
}

impl EngineRequest {
    /// A request with default priority arriving now.
    pub fn new(prompt_token_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self { prompt_token_ids, params, priority: 0, share_prefix_with: None, arrival: Instant::now() }
    }

    /// The checks any [`EngineClient`] makes before accepting a request, against the engine's
    /// facts: valid parameters, a non-empty prompt inside the vocabulary, and prompt plus
    /// requested tokens within the context.
    pub fn check(&self, info: &EngineInfo) -> Result<(), SubmitError> {
        self.params.validate(info.vocab_size)?;
        let prompt_len = self.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(SubmitError::InvalidPrompt("the prompt is empty".into()));
        }
        if let Some(bad) = self.prompt_token_ids.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(SubmitError::InvalidPrompt(format!(
                "token id {bad} is outside the vocabulary (size {})",
                info.vocab_size
            )));
        }
        let wanted = self.params.max_tokens.unwrap_or(1);
        if prompt_len + wanted > info.max_model_len {
            return Err(SubmitError::ContextTooLong {
                prompt_tokens: prompt_len,
                max_tokens: wanted,
                max_model_len: info.max_model_len,
            });
        }
        Ok(())
    }
}

/// A seed for a request that gave none: process-random, never repeated in practice. Drawn
/// once per request so every worker that samples for it (prefill, decode, a recompute)
/// draws the same tokens.
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// EOS or a stop token id (`stop_token` says which) or a stop string (frontend).
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// Aborted by the client, the frontend, or shutdown.
    Abort,
}

impl FinishReason {
    /// The OpenAI spelling (`stop`, `length`, `abort`).
    pub fn as_openai_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token_id: u32,
    /// Its log-probability under the raw model output (log-softmax of the logits before bias, penalties and temperature).
    pub logprob: f32,
    /// The top alternatives, most likely first (`SamplingParams::logprobs` of them).
    pub top: Vec<(u32, f32)>,
}

/// What a request produced since the previous output.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOutput {
    /// Tokens generated since the last output (usually one).
    pub new_token_ids: Vec<u32>,
    /// Parallel to `new_token_ids` when logprobs were requested, else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the last output of the request.
    pub finish_reason: Option<FinishReason>,
    /// The token id that stopped the sequence (EOS or one of `stop_token_ids`).
    pub stop_token: Option<u32>,
    /// Prompt length in tokens.
    pub num_prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (or received from another worker).
    pub num_cached_tokens: usize,
}

/// Why a request could not be accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// A sampling parameter is out of range.
    #[error(transparent)]
    InvalidParams(#[from] ParamError),
    /// The prompt is empty or contains ids outside the vocabulary.
    #[error("invalid prompt: {0}")]
    InvalidPrompt(String),
    /// Prompt plus requested tokens exceed the context.
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the request has {prompt_tokens} prompt tokens and asks for {max_tokens} more ({} in total)",
        prompt_tokens + max_tokens
    )]
    ContextTooLong {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens requested (max_tokens, or 1 when unset and the prompt alone is too long).
        max_tokens: usize,
        /// The engine's context length.
        max_model_len: usize,
    },
    /// The waiting queue is at capacity; retry later.
    #[error("the server is at capacity ({waiting} requests waiting); retry later")]
    QueueFull {
        /// Requests waiting when this one was refused.
        waiting: usize,
    },
    /// The engine has stopped (shutdown or a fatal backend error).
    #[error("the engine is not running: {0}")]
    Unavailable(String),
    /// The request's structured-output grammar (`params.structured`) cannot be compiled.
    #[error("invalid structured_outputs {kind}: {message}")]
    InvalidGrammar {
        /// The spec kind ([`crate::structured::GrammarSpec::kind`]).
        kind: String,
        /// Why, in the grammar compiler's words.
        message: String,
    },
}

/// A failure of a request after it was accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The backend failed while running the request's step.
    #[error("backend error: {0}")]
    Backend(String),
    /// The engine stopped while the request was in flight.
    #[error("the engine stopped while the request was running")]
    Shutdown,
    /// The request can never be scheduled (e.g. needs more KV blocks than exist).
    #[error("request cannot be scheduled: {0}")]
    Unschedulable(String),
    /// A remote engine refused the request before it started because it is at capacity
    /// (the stream's first and only item): retry later. Only remote clients (the router's
    /// cluster client) produce it; an in-process engine refuses with [`SubmitError::QueueFull`].
    #[error("no capacity: {0}")]
    Overloaded(String),
    /// No remote engine could be reached to start the request (the stream's first and only
    /// item).
    #[error("no engine available: {0}")]
    Unavailable(String),
    /// The request's structured-output grammar cannot be compiled (the stream's first and
    /// only item): the request's fault, never started. Grammars compile off the engine
    /// thread after `submit` returned, so this comes on the stream rather than as
    /// [`SubmitError::InvalidGrammar`]; the edges answer it as a 400 all the same.
    #[error("invalid structured_outputs {kind}: {message}")]
    InvalidGrammar {
        /// The spec kind ([`crate::structured::GrammarSpec::kind`]).
        kind: String,
        /// Why, in the grammar compiler's words.
        message: String,
    },
}

impl EngineError {
    /// True when the request never started (the engine side holds nothing for it), so the
    /// client may retry it as is.
    pub fn is_refusal(&self) -> bool {
        matches!(self, EngineError::Overloaded(_) | EngineError::Unavailable(_))
    }

    /// True when the request itself is at fault (it never started; retrying it unchanged
    /// fails the same way).
    pub fn is_invalid_request(&self) -> bool {
        matches!(self, EngineError::InvalidGrammar { .. })
    }
}

/// Static facts about the served model and engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// Maximum tokens (prompt + output) per sequence.
    pub max_model_len: usize,
    /// Logit vector length.
    pub vocab_size: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// EOS token ids (from the generation config).
    pub eos_token_ids: Vec<u32>,
    /// "cpu" or "cuda:N".
    pub device: String,
}

/// A point-in-time load report.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    /// Requests in the running batch.
    pub num_running: usize,
    /// Requests waiting (new or preempted).
    pub num_waiting: usize,
    /// KV blocks referenced by some request.
    pub num_used_blocks: usize,
    /// KV blocks in the pool.
    pub num_total_blocks: usize,
    /// Prompt tokens looked up in the prefix cache (cumulative).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found there (cumulative).
    pub prefix_cache_hits: u64,
    /// Preemptions so far (cumulative).
    pub num_preemptions: u64,
}

/// Sends an abort for a request to the engine. Implemented by the engine handle.
pub trait AbortSink: Send + Sync + 'static {
    /// Ask the engine to stop `id` and free its blocks. Must not block.
    fn abort(&self, id: RequestId);
}

/// Receives a request's outputs; dropping it aborts the request (unless it already finished).
///
/// The channel is unbounded on purpose: a request produces at most `max_model_len`
/// outputs, and the engine thread must never block on a slow client.
pub struct OutputStream {
    id: RequestId,
    rx: mpsc::UnboundedReceiver<Result<EngineOutput, EngineError>>,
    abort: std::sync::Arc<dyn AbortSink>,
    finished: bool,
}

impl OutputStream {
    /// Wraps the receiving half of a request's output channel.
    pub fn new(
        id: RequestId,
        rx: mpsc::UnboundedReceiver<Result<EngineOutput, EngineError>>,
        abort: std::sync::Arc<dyn AbortSink>,
    ) -> Self {
        Self { id, rx, abort, finished: false }
    }

    /// The engine id of this request.
    pub fn request_id(&self) -> RequestId {
        self.id
    }

    /// The next output; `None` after the final one (or if the engine went away).
    pub async fn next(&mut self) -> Option<Result<EngineOutput, EngineError>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for the next output (see [`OutputStream::next`]), for callers that implement
    /// `Stream` themselves and drain every output already queued in one wake-up.
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<EngineOutput, EngineError>>> {
        if self.finished {
            return std::task::Poll::Ready(None);
        }
        let item = std::task::ready!(self.rx.poll_recv(cx));
        self.note(&item);
        std::task::Poll::Ready(item)
    }

    fn note(&mut self, item: &Option<Result<EngineOutput, EngineError>>) {
        match item {
            Some(Ok(out)) if out.finish_reason.is_some() => self.finished = true,
            Some(Err(_)) | None => self.finished = true,
            _ => {}
        }
    }

    /// Blocking variant of [`OutputStream::next`] for synchronous callers (tests, benches).
    pub fn blocking_next(&mut self) -> Option<Result<EngineOutput, EngineError>> {
        if self.finished {
            return None;
        }
        let item = self.rx.blocking_recv();
        self.note(&item);
        item
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        if !self.finished {
            self.abort.abort(self.id);
        }
    }
}

/// What the frontend needs from an engine, whether in-process or remote.
pub trait EngineClient: Send + Sync + 'static {
    /// Validates and enqueues a single-sequence request. Never blocks on the engine.
    fn submit(&self, request: EngineRequest) -> Result<OutputStream, SubmitError>;
    /// Aborts a request by id (no-op if unknown or finished).
    fn abort(&self, id: RequestId);
    /// Static facts about the engine.
    fn info(&self) -> EngineInfo;
    /// Current load.
    fn stats(&self) -> EngineStats;
    /// False once the engine hit a fatal error or stopped.
    fn is_healthy(&self) -> bool;
}
