//! The frontend pipeline shared by the HTTP and gRPC edges: admit → validate → template →
//! tokenize → check the context → fan out `n` → submit to the engine → a merged
//! [`Generation`] stream.
//!
//! Invariants:
//! - A request is admitted ([`crate::admission`]) before any work is done for it: its
//!   sequences count against the in-flight cap from tokenization until each choice ends.
//! - Templating and tokenizing run on the bounded blocking pool ([`crate::offload`]), never
//!   on the async runtime's threads.
//! - Nothing is submitted unless the whole request passed validation, so a bad request never
//!   leaves engine work behind.
//! - Every engine request this module submits is owned by exactly one [`Generation`]; dropping
//!   the generation (client gone, handler cancelled) drops its `OutputStream`s, which aborts
//!   the unfinished sequences and frees their KV blocks at once.
//! - Protocol shapes (JSON, protobuf) never reach this module; errors are [`FrontendError`].

use crate::admission::{Admission, AdmissionLimits, Permit};
use crate::error::FrontendError;
use crate::generation::Generation;
use crate::offload::Offload;
use crate::text::{ChatTurn, ChoiceText, TextCodec};
use baton_core::api::{EngineClient, EngineInfo, EngineRequest};
use baton_core::params::SamplingParams;
use baton_core::structured::GrammarSpec;
use baton_grammar::GrammarCompiler;
use baton_metrics::Metrics;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Raw text, tokenized as is.
    Text {
        /// The prompt.
        text: String,
        /// Add BOS and other special tokens the tokenizer's post-processor defines.
        add_special_tokens: bool,
    },
    /// Already tokenized.
    Tokens(Vec<u32>),
    /// A conversation rendered through the model's chat template.
    Chat {
        /// The messages, oldest first.
        messages: Vec<ChatTurn>,
        /// End with the assistant header so the model answers.
        add_generation_prompt: bool,
        /// Extra template variables (`tools`, `chat_template_kwargs` such as `enable_thinking`).
        template_vars: serde_json::Map<String, serde_json::Value>,
    },
}

/// A grammar to compile before a request is accepted, and the request field to blame if it
/// does not compile (`response_format`, `tools[1].function.parameters`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarCheck {
    /// The field the grammar came from, as the client spelled it.
    pub param: String,
    /// The grammar.
    pub spec: GrammarSpec,
}

/// A protocol-neutral generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Sampling parameters; `n` is fanned out here, `max_tokens: None` means "up to the context".
    pub params: SamplingParams,
    /// When the request arrived, for latency metrics.
    pub arrival: Instant,
    /// Grammars to compile before submitting (`params.structured` among them, when set), so
    /// a bad one is a 400 naming its field; empty for unconstrained requests.
    pub grammar_checks: Vec<GrammarCheck>,
}

impl GenerateRequest {
    /// A request arriving now.
    pub fn new(prompt: PromptInput, params: SamplingParams) -> Self {
        Self { prompt, params, arrival: Instant::now(), grammar_checks: Vec::new() }
    }

    /// The same request, compiling `checks` before it is accepted.
    pub fn with_grammar_checks(mut self, checks: Vec<GrammarCheck>) -> Self {
        self.grammar_checks = checks;
        self
    }
}

/// A request that passed validation and tokenization and fits the context; ready to submit.
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    /// The prompt's token ids (non-empty, all inside the vocabulary).
    pub prompt_token_ids: Vec<u32>,
    /// The prompt as text, when it was given as text or rendered from chat messages.
    pub prompt_text: Option<String>,
    /// Validated parameters with `max_tokens` resolved against the context.
    pub params: SamplingParams,
    /// When the request arrived.
    pub arrival: Instant,
}

/// Names under which the model is served.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedModel {
    /// The name clients put in `model` (`--served-model-name`, else the model path).
    pub name: String,
    /// Where the model was loaded from (reported as `root` by `/v1/models`).
    pub root: String,
}

/// The frontend of one served model: everything between a parsed request and engine streams.
#[derive(Clone)]
pub struct Frontend {
    engine: Arc<dyn EngineClient>,
    codec: Arc<TextCodec>,
    model: ServedModel,
    info: EngineInfo,
    metrics: Arc<Metrics>,
    admission: Arc<Admission>,
    offload: Offload,
    /// Built on first use (a trie over the vocabulary), on the text pool; the error when the
    /// tokenizer cannot back a grammar.
    grammar: Arc<OnceLock<Result<GrammarCompiler, String>>>,
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend").field("model", &self.model).field("info", &self.info).finish_non_exhaustive()
    }
}

impl Frontend {
    /// A frontend over `engine`, tokenizing with `codec` and recording into `metrics`, with the
    /// default [`AdmissionLimits`] and a text pool sized for this machine.
    pub fn new(
        engine: Arc<dyn EngineClient>,
        codec: Arc<TextCodec>,
        model: ServedModel,
        metrics: Arc<Metrics>,
    ) -> Self {
        let info = engine.info();
        let admission = Admission::new(AdmissionLimits::default());
        Self {
            engine,
            codec,
            model,
            info,
            metrics,
            admission,
            offload: Offload::for_this_machine(),
            grammar: Arc::new(OnceLock::new()),
        }
    }

    /// The same frontend with other admission limits (a fresh in-flight count).
    pub fn with_admission(mut self, limits: AdmissionLimits) -> Self {
        self.admission = Admission::new(limits);
        self
    }

    /// The same frontend running its text work on `offload`.
    pub fn with_offload(mut self, offload: Offload) -> Self {
        self.offload = offload;
        self
    }

    /// The in-flight gate.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// The pool CPU-heavy text work runs on.
    pub fn offload(&self) -> &Offload {
        &self.offload
    }

    /// Admits a request of `prompts` prompts × `n` choices (see [`Admission::admit`]).
    pub fn admit(&self, prompts: usize, n: usize) -> Result<Permit, FrontendError> {
        self.admission.admit(prompts, n)
    }

    /// The Prometheus text of `/metrics`: the engine's load plus the frontend's own gauges.
    pub fn render_metrics(&self) -> String {
        let tasks = tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_alive_tasks());
        self.metrics.set_process_load(self.admission.inflight(), tasks);
        self.metrics.render(&self.engine.stats())
    }

    /// The served model's names.
    pub fn model(&self) -> &ServedModel {
        &self.model
    }

    /// Static engine facts (context length, vocabulary, KV capacity).
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The engine, for stats, health and aborts.
    pub fn engine(&self) -> &Arc<dyn EngineClient> {
        &self.engine
    }

    /// The tokenizer and chat template.
    pub fn codec(&self) -> &TextCodec {
        &self.codec
    }

    /// The tokenizer and chat template, shared (to move into a job on the text pool).
    pub fn codec_handle(&self) -> Arc<TextCodec> {
        self.codec.clone()
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Accepts a request that names no model or the served one; anything else is
    /// [`FrontendError::ModelNotFound`].
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), FrontendError> {
        match requested {
            None => Ok(()),
            Some(m) if m == self.model.name || m == self.model.root => Ok(()),
            Some(m) => Err(FrontendError::ModelNotFound(m.to_owned())),
        }
    }

    /// Turns a prompt input into token ids (and text, when there is one), templating and
    /// tokenizing on the text pool.
    pub async fn tokenize(&self, prompt: PromptInput) -> Result<(Vec<u32>, Option<String>), FrontendError> {
        match prompt {
            // Nothing to compute: no need for a trip to the pool.
            PromptInput::Tokens(ids) => Ok((ids, None)),
            prompt => {
                let codec = self.codec.clone();
                self.offload.run(move || tokenize_now(&codec, prompt)).await?
            }
        }
    }

    /// Compiles each grammar of `checks` on the text pool (cached by the compiler), failing
    /// with a 400 that names the field of the first one that does not compile.
    pub async fn check_grammars(&self, checks: Vec<GrammarCheck>) -> Result<(), FrontendError> {
        if checks.is_empty() {
            return Ok(());
        }
        let codec = self.codec.clone();
        let cell = self.grammar.clone();
        let (eos, vocab) = (self.info.eos_token_ids.clone(), self.info.vocab_size);
        self.offload
            .run(move || {
                let compiler = cell.get_or_init(|| codec.grammar_compiler(&eos, vocab).map_err(|e| e.to_string()));
                let compiler = match compiler {
                    Ok(c) => c,
                    Err(e) => {
                        let param = checks.first().map(|c| c.param.clone()).unwrap_or_default();
                        return Err(FrontendError::invalid(
                            param,
                            format!("structured outputs are not available for this model: {e}"),
                        ));
                    }
                };
                for check in checks {
                    if let Err(e) = compiler.compile(&check.spec) {
                        let param = check.param;
                        return Err(FrontendError::invalid(param.clone(), format!("{param}: {e}")));
                    }
                }
                Ok(())
            })
            .await?
    }

    /// Validates, tokenizes and fits a request to the context without submitting it.
    pub async fn prepare(&self, request: GenerateRequest) -> Result<PreparedRequest, FrontendError> {
        let vocab = self.info.vocab_size;
        request.params.validate(vocab)?;
        self.check_grammars(request.grammar_checks).await?;
        let (prompt_token_ids, prompt_text) = self.tokenize(request.prompt).await?;
        if prompt_token_ids.is_empty() {
            return Err(FrontendError::invalid("prompt", "the prompt is empty (0 tokens)"));
        }
        if let Some(bad) = prompt_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(FrontendError::invalid(
                "prompt",
                format!("prompt token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let max_model_len = self.info.max_model_len;
        let prompt_tokens = prompt_token_ids.len();
        let max_tokens = match request.params.max_tokens {
            Some(m) => m,
            None if prompt_tokens < max_model_len => max_model_len - prompt_tokens,
            None => 1,
        };
        if prompt_tokens + max_tokens > max_model_len {
            return Err(FrontendError::ContextTooLong { prompt_tokens, max_tokens, max_model_len });
        }
        let params = SamplingParams { max_tokens: Some(max_tokens), ..request.params };
        Ok(PreparedRequest { prompt_token_ids, prompt_text, params, arrival: request.arrival })
    }

    /// Submits a prepared request: one engine request per choice, the 2nd..nth sharing the
    /// first one's prompt blocks. `permit` (from [`Frontend::admit`]) must hold a sequence per
    /// choice; each choice gives its sequence back when it ends. If a later child is refused,
    /// the earlier ones are aborted (by dropping their streams) and the error is returned.
    pub fn start(&self, prepared: PreparedRequest, permit: &mut Permit) -> Result<Generation, FrontendError> {
        let n = prepared.params.n;
        if permit.count() < n {
            return Err(FrontendError::Internal(format!(
                "the request was admitted for {} sequences but has {n} choices",
                permit.count()
            )));
        }
        let permits: Vec<Permit> = (0..n).map(|_| permit.split(1)).collect();
        let texts = (0..n)
            .map(|_| ChoiceText::new(&self.codec, &prepared.params, &prepared.prompt_token_ids))
            .collect::<Result<Vec<_>, _>>()?;
        let mut streams = Vec::with_capacity(prepared.params.n);
        let mut first = None;
        for child in prepared.params.fan_out() {
            let request = EngineRequest {
                prompt_token_ids: prepared.prompt_token_ids.clone(),
                params: child,
                priority: 0,
                share_prefix_with: first,
                arrival: prepared.arrival,
            };
            let stream = self.engine.submit(request)?;
            first.get_or_insert(stream.request_id());
            streams.push(stream);
        }
        self.metrics.add_prompt_tokens(prepared.prompt_token_ids.len());
        Ok(Generation::new(streams, texts, permits, &prepared, self.metrics.clone()))
    }

    /// [`Frontend::admit`], [`Frontend::prepare`], then [`Frontend::start`].
    pub async fn generate(&self, request: GenerateRequest) -> Result<Generation, FrontendError> {
        let mut permit = self.admit(1, request.params.n)?;
        let prepared = self.prepare(request).await?;
        self.start(prepared, &mut permit)
    }
}

/// Templates and tokenizes on the calling thread (the text pool's).
fn tokenize_now(codec: &TextCodec, prompt: PromptInput) -> Result<(Vec<u32>, Option<String>), FrontendError> {
    match prompt {
        PromptInput::Text { text, add_special_tokens } => {
            let ids = codec.encode(&text, add_special_tokens)?;
            Ok((ids, Some(text)))
        }
        PromptInput::Tokens(ids) => Ok((ids, None)),
        PromptInput::Chat { messages, add_generation_prompt, template_vars } => {
            if messages.is_empty() {
                return Err(FrontendError::invalid("messages", "messages must contain at least one message"));
            }
            let text = codec.render_chat(&messages, add_generation_prompt, &template_vars)?;
            // The template already wrote BOS and the other special tokens it wants.
            Ok((codec.encode(&text, false)?, Some(text)))
        }
    }
}
