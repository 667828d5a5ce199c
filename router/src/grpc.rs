//! The public gRPC API (`baton.v1.Baton`) over the same [`Frontend`] pipeline as HTTP.
//!
//! Invariants:
//! - With an API key configured, every call is checked first ([`crate::auth`]).
//! - Validation failures are returned as a gRPC status before any message is streamed;
//!   failures after the stream started are sent as one `Error` message that ends the stream.
//! - A stream ends after one `Complete` per sequence (`index`), or an `Error`.
//! - Cancelling the call drops the stream and the generation with it, which aborts every
//!   unfinished sequence. `Abort` aborts by the request id of an active `Generate` call;
//!   the call then completes with `finish_reason: "abort"`.
//! - Request ids are scoped per caller: `Abort` only reaches the caller's own requests (any
//!   other id, running or not, is `NOT_FOUND`, which does not reveal whether another caller
//!   uses it), and two callers may use the same id. The caller is the client's connection
//!   (remote address and port), not the API key: one key is shared by every client of a
//!   deployment, so it cannot tell them apart, while a connection is one client's. A client
//!   aborts over the channel it generates on (tonic multiplexes both calls on it).
//! - A request refused before it started (every worker at capacity, or none reachable) is a
//!   `RESOURCE_EXHAUSTED` / `UNAVAILABLE` status, not a stream ending in an error.

use crate::auth::{ApiKey, ApiKeyInterceptor};
use crate::error::FrontendError;
use crate::generation::ChoiceEvent;
use crate::pipeline::{Frontend, GenerateRequest as FrontendRequest, PromptInput};
use crate::text::ChatTurn;
use baton_core::api::{RequestId, TokenLogprob as EngineLogprob};
use baton_core::params::SamplingParams as EngineParams;
use baton_core::structured::GrammarSpec;
use baton_proto::v1 as pb;
use baton_proto::v1::baton_server::{Baton, BatonServer};
use futures::Stream;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

/// Active `Generate` calls by (caller, request id).
type Active = Arc<Mutex<HashMap<(String, String), Vec<RequestId>>>>;

/// The caller a request id belongs to: the client's connection (see the module docs).
fn caller_of<T>(request: &Request<T>) -> String {
    request.remote_addr().map_or_else(|| "unknown peer".to_owned(), |a| a.to_string())
}

/// The `baton.v1.Baton` service.
#[derive(Debug, Clone)]
pub struct GrpcService {
    frontend: Frontend,
    active: Active,
}

impl GrpcService {
    /// A service over `frontend`.
    pub fn new(frontend: Frontend) -> Self {
        Self { frontend, active: Arc::default() }
    }

    /// The tonic server wrapper, ready for `tonic::transport::Server::add_service`; with
    /// `api_key`, every call must carry `authorization: Bearer KEY` (else `UNAUTHENTICATED`).
    pub fn into_server(self, api_key: Option<ApiKey>) -> InterceptedService<BatonServer<Self>, ApiKeyInterceptor> {
        BatonServer::with_interceptor(self, ApiKeyInterceptor::new(api_key))
    }
}

/// The gRPC status of a frontend error (the only place this mapping lives).
pub fn status_of(error: &FrontendError) -> Status {
    let message = error.to_string();
    match error {
        FrontendError::InvalidRequest { .. } | FrontendError::ContextTooLong { .. } => {
            Status::invalid_argument(message)
        }
        FrontendError::ModelNotFound(_) => Status::not_found(message),
        FrontendError::Overloaded { .. } | FrontendError::Busy(_) => Status::resource_exhausted(message),
        FrontendError::Unavailable(_) => Status::unavailable(message),
        FrontendError::Engine(_) | FrontendError::Internal(_) => Status::internal(message),
    }
}

fn code_name(error: &FrontendError) -> &'static str {
    match status_of(error).code() {
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::Unavailable => "UNAVAILABLE",
        _ => "INTERNAL",
    }
}

fn to_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// The `structured_outputs` oneof → the engine's grammar spec; `json_object: false` is
/// refused (it would silently mean "unconstrained").
fn structured_from_proto(
    s: Option<pb::sampling_params::StructuredOutputs>,
) -> Result<Option<GrammarSpec>, FrontendError> {
    use pb::sampling_params::StructuredOutputs as S;
    Ok(match s {
        None => None,
        Some(S::JsonObject(true)) => Some(GrammarSpec::JsonObject),
        Some(S::JsonObject(false)) => {
            return Err(FrontendError::invalid("json_object", "json_object must be true when set"));
        }
        Some(S::JsonSchema(s)) => Some(GrammarSpec::JsonSchema(s)),
        Some(S::Regex(s)) => Some(GrammarSpec::Regex(s)),
        Some(S::Choice(c)) => Some(GrammarSpec::Choice(c.choices)),
        Some(S::Grammar(s)) => Some(GrammarSpec::Lark(s)),
    })
}

/// Engine parameters from the protobuf message (unset fields take the engine defaults;
/// no `max_tokens` means up to the context length). A malformed `structured_outputs` is
/// a bad request.
pub fn sampling_from_proto(p: Option<pb::SamplingParams>) -> Result<EngineParams, FrontendError> {
    let p = p.unwrap_or_default();
    let structured = structured_from_proto(p.structured_outputs)?;
    let d = EngineParams::default();
    Ok(EngineParams {
        n: p.n.map_or(d.n, |n| n as usize),
        temperature: p.temperature.unwrap_or(d.temperature),
        top_p: p.top_p.unwrap_or(d.top_p),
        top_k: p.top_k.map_or(d.top_k, |k| k as usize),
        min_p: p.min_p.unwrap_or(d.min_p),
        repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed: p.seed,
        stop: p.stop,
        stop_token_ids: p.stop_token_ids,
        include_stop_str_in_output: p.include_stop_str_in_output,
        max_tokens: p.max_tokens.map(|m| m as usize),
        min_tokens: p.min_tokens.map_or(0, |m| m as usize),
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|k| k as usize),
        prompt_logprobs: p.prompt_logprobs.map(|k| k as usize),
        // Sorted so that the engine sees the same order for the same request.
        logit_bias: {
            let mut bias: Vec<(u32, f32)> = p.logit_bias.into_iter().collect();
            bias.sort_by_key(|&(id, _)| id);
            bias
        },
        skip_special_tokens: p.skip_special_tokens.unwrap_or(d.skip_special_tokens),
        structured,
    })
}

fn prompt_from_proto(request: &mut pb::GenerateRequest) -> Result<PromptInput, FrontendError> {
    match request.input.take() {
        Some(pb::generate_request::Input::Text(text)) => {
            Ok(PromptInput::Text { text, add_special_tokens: request.add_special_tokens.unwrap_or(true) })
        }
        Some(pb::generate_request::Input::Chat(chat)) => Ok(PromptInput::Chat {
            messages: chat.messages.into_iter().map(|m| ChatTurn::text(m.role, m.content)).collect(),
            add_generation_prompt: chat.add_generation_prompt,
            template_vars: Default::default(),
        }),
        Some(pb::generate_request::Input::TokenIds(ids)) => Ok(PromptInput::Tokens(ids.ids)),
        None => Err(FrontendError::invalid("input", "one of `text`, `chat` or `token_ids` is required")),
    }
}

fn logprobs_to_proto(frontend: &Frontend, logprobs: &[EngineLogprob]) -> Vec<pb::TokenLogprob> {
    let codec = frontend.codec();
    logprobs
        .iter()
        .map(|lp| pb::TokenLogprob {
            token_id: lp.token_id,
            token: codec.token_text(lp.token_id),
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(token_id, logprob)| pb::TopLogprob { token_id, token: codec.token_text(token_id), logprob })
                .collect(),
        })
        .collect()
}

fn prompt_logprobs_to_proto(
    frontend: &Frontend,
    entries: Option<&[Option<baton_core::api::PromptLogprob>]>,
) -> Vec<pb::PromptTokenLogprob> {
    let codec = frontend.codec();
    let top = |top: &[(u32, f32)]| {
        top.iter()
            .map(|&(token_id, logprob)| pb::TopLogprob { token_id, token: codec.token_text(token_id), logprob })
            .collect()
    };
    entries
        .unwrap_or_default()
        .iter()
        .map(|entry| match entry {
            None => pb::PromptTokenLogprob::default(),
            Some(lp) => pb::PromptTokenLogprob {
                present: true,
                token_id: lp.token_id,
                token: codec.token_text(lp.token_id),
                logprob: lp.logprob,
                rank: lp.rank,
                top: top(&lp.top),
            },
        })
        .collect()
}

/// Removes a request from the active table when its stream ends or is dropped.
struct ActiveGuard {
    active: Active,
    key: (String, String),
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.active.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Baton for GrpcService {
    type GenerateStream = GenerateStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let caller = caller_of(&request);
        let mut request = request.into_inner();
        let request_id = if request.request_id.is_empty() {
            uuid::Uuid::new_v4().simple().to_string()
        } else {
            request.request_id.clone()
        };
        let key = (caller, request_id.clone());
        if self.active.lock().unwrap_or_else(PoisonError::into_inner).contains_key(&key) {
            return Err(Status::already_exists(format!("request id {request_id:?} is already running")));
        }
        let prompt = prompt_from_proto(&mut request).map_err(|e| status_of(&e))?;
        let params = sampling_from_proto(request.sampling.take()).map_err(|e| status_of(&e))?;
        let mut generation =
            self.frontend.generate(FrontendRequest::new(prompt, params)).await.map_err(|e| status_of(&e))?;
        generation.refused().await.map_err(|e| status_of(&e))?;
        let prompt_tokens = to_u32(generation.prompt_tokens());
        {
            let mut active = self.active.lock().unwrap_or_else(PoisonError::into_inner);
            if active.contains_key(&key) {
                return Err(Status::already_exists(format!("request id {request_id:?} is already running")));
            }
            active.insert(key.clone(), generation.request_ids().to_vec());
        }
        let guard = ActiveGuard { active: self.active.clone(), key };
        let frontend = self.frontend.clone();
        let stream = async_stream::stream! {
            let _guard = guard;
            while let Some(event) = generation.next().await {
                let (response, last) = match event {
                    ChoiceEvent::Delta(d) => (
                        pb::generate_response::Response::Chunk(pb::Chunk {
                            index: to_u32(d.index),
                            logprobs: logprobs_to_proto(&frontend, &d.logprobs),
                            prompt_logprobs: prompt_logprobs_to_proto(&frontend, d.prompt_logprobs.as_deref()),
                            token_ids: d.token_ids,
                            text: d.text,
                        }),
                        false,
                    ),
                    ChoiceEvent::Finished(end) => (
                        pb::generate_response::Response::Complete(pb::Complete {
                            index: to_u32(end.index),
                            finish_reason: end.reason.as_openai_str().to_owned(),
                            prompt_tokens,
                            completion_tokens: to_u32(end.completion_tokens),
                            cached_tokens: to_u32(end.cached_tokens),
                        }),
                        false,
                    ),
                    ChoiceEvent::Failed { error, .. } => (
                        pb::generate_response::Response::Error(pb::Error {
                            code: code_name(&error).to_owned(),
                            message: error.to_string(),
                            param: error.param().unwrap_or_default().to_owned(),
                        }),
                        true,
                    ),
                };
                yield Ok(pb::GenerateResponse { request_id: request_id.clone(), response: Some(response) });
                if last {
                    break;
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let key = (caller_of(&request), request.into_inner().request_id);
        let ids = self.active.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned();
        let Some(ids) = ids else {
            return Err(Status::not_found(format!(
                "no request {:?} of this caller is running (ids are scoped to the connection that started them)",
                key.1
            )));
        };
        for engine_id in ids {
            self.frontend.engine().abort(engine_id);
        }
        Ok(Response::new(pb::AbortResponse { found: true }))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        let healthy = self.frontend.engine().is_healthy();
        let message = if healthy { "ok" } else { "the engine is not healthy" };
        Ok(Response::new(pb::HealthResponse { healthy, message: message.to_owned() }))
    }

    async fn model_info(&self, _: Request<pb::ModelInfoRequest>) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let info = self.frontend.info();
        Ok(Response::new(pb::ModelInfoResponse {
            model: self.frontend.model().name.clone(),
            max_model_len: to_u32(info.max_model_len),
            vocab_size: to_u32(info.vocab_size),
            block_size: to_u32(info.block_size),
            num_blocks: to_u32(info.num_blocks),
            device: info.device.clone(),
            eos_token_ids: info.eos_token_ids.clone(),
        }))
    }

    async fn loads(&self, _: Request<pb::LoadsRequest>) -> Result<Response<pb::LoadsResponse>, Status> {
        let s = self.frontend.engine().stats();
        Ok(Response::new(pb::LoadsResponse {
            num_running: to_u32(s.num_running),
            num_waiting: to_u32(s.num_waiting),
            num_used_blocks: to_u32(s.num_used_blocks),
            num_total_blocks: to_u32(s.num_total_blocks),
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            num_preemptions: s.num_preemptions,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_params_default_like_the_engine_and_map_every_field() {
        assert_eq!(sampling_from_proto(None).expect("valid"), EngineParams::default());
        let p = pb::SamplingParams {
            temperature: Some(0.0),
            top_k: Some(3),
            max_tokens: Some(7),
            n: Some(2),
            logprobs: Some(4),
            stop: vec!["x".into()],
            logit_bias: [(9, 1.0), (2, -1.0)].into_iter().collect(),
            skip_special_tokens: Some(false),
            ..Default::default()
        };
        let e = sampling_from_proto(Some(p)).expect("valid");
        assert_eq!((e.temperature, e.top_k, e.max_tokens, e.n, e.logprobs), (0.0, 3, Some(7), 2, Some(4)));
        assert_eq!(e.logit_bias, vec![(2, -1.0), (9, 1.0)]);
        assert_eq!(e.stop, vec!["x".to_owned()]);
        assert!(!e.skip_special_tokens);
    }

    #[test]
    fn structured_outputs_map_to_grammar_specs() {
        use pb::sampling_params::StructuredOutputs as S;
        let with =
            |s: S| sampling_from_proto(Some(pb::SamplingParams { structured_outputs: Some(s), ..Default::default() }));
        let cases = [
            (S::JsonObject(true), GrammarSpec::JsonObject),
            (S::JsonSchema("{}".into()), GrammarSpec::JsonSchema("{}".into())),
            (S::Regex("a+".into()), GrammarSpec::Regex("a+".into())),
            (
                S::Choice(pb::Choices { choices: vec!["y".into(), "n".into()] }),
                GrammarSpec::Choice(vec!["y".into(), "n".into()]),
            ),
            (S::Grammar("start: \"x\"".into()), GrammarSpec::Lark("start: \"x\"".into())),
        ];
        for (proto, spec) in cases {
            assert_eq!(with(proto).expect("valid").structured, Some(spec));
        }
        let err = with(S::JsonObject(false)).expect_err("json_object false");
        assert_eq!(status_of(&err).code(), tonic::Code::InvalidArgument);
        assert_eq!(err.param(), Some("json_object"));
        assert_eq!(sampling_from_proto(None).expect("valid").structured, None);
    }

    #[test]
    fn statuses() {
        assert_eq!(status_of(&FrontendError::invalid("n", "x")).code(), tonic::Code::InvalidArgument);
        assert_eq!(status_of(&FrontendError::Overloaded { waiting: 1 }).code(), tonic::Code::ResourceExhausted);
        assert_eq!(status_of(&FrontendError::Busy("full".into())).code(), tonic::Code::ResourceExhausted);
        assert_eq!(status_of(&FrontendError::Unavailable("gone".into())).code(), tonic::Code::Unavailable);
        assert_eq!(status_of(&FrontendError::ModelNotFound("m".into())).code(), tonic::Code::NotFound);
        assert_eq!(code_name(&FrontendError::Unavailable("x".into())), "UNAVAILABLE");
    }
}
