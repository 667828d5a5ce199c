//! The HTTP server's routes: the OpenAI-compatible `/v1/*` API and vLLM's `/tokenize` and
//! `/detokenize` (all behind the optional API key, see [`crate::auth`]), and the open
//! operational endpoints `/health` and `/metrics`.
//!
//! Invariants: every error response, including unknown routes, wrong methods, oversized
//! bodies and authentication failures, has the OpenAI error shape; `/health` and `/metrics`
//! never require the API key.

use crate::auth::{ApiKey, protect};
use crate::error::FrontendError;
use crate::openai::chat::chat_completions;
use crate::openai::chat::chat_turns;
use crate::openai::completions::completions;
use crate::openai::error::ApiError;
use crate::openai::extract::JsonBody;
use crate::openai::protocol::{
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
};
use crate::openai::sse::unix_now;
use crate::openai::tools::choice::ToolConfig;
use crate::pipeline::{Frontend, PromptInput};
use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

/// Default request body limit (bytes).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Options of the HTTP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// When set, `/v1/*`, `/tokenize` and `/detokenize` require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body; larger ones get a 413.
    pub max_body_bytes: usize,
    /// Tool calling and reasoning options of `/v1/chat/completions`.
    pub tools: ToolConfig,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self { api_key: None, max_body_bytes: DEFAULT_MAX_BODY_BYTES, tools: ToolConfig::default() }
    }
}

/// State shared by all handlers.
#[derive(Clone)]
pub struct AppState {
    frontend: Frontend,
    tools: ToolConfig,
    started: u64,
}

impl FromRef<AppState> for Frontend {
    fn from_ref(state: &AppState) -> Frontend {
        state.frontend.clone()
    }
}

impl FromRef<AppState> for ToolConfig {
    fn from_ref(state: &AppState) -> ToolConfig {
        state.tools
    }
}

/// The full HTTP application for one served model.
pub fn http_router(frontend: Frontend, config: HttpConfig) -> Router {
    let state = AppState { frontend, tools: config.tools, started: unix_now() };
    let guarded = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    Router::new()
        .merge(protect(guarded, ApiKey::from_config(config.api_key.as_deref())))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::route_not_found(uri.path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn health(State(frontend): State<Frontend>) -> Response {
    if frontend.engine().is_healthy() {
        StatusCode::OK.into_response()
    } else {
        ApiError::from(FrontendError::Unavailable("the engine is not healthy".into())).into_response()
    }
}

async fn metrics(State(frontend): State<Frontend>) -> Response {
    let text = frontend.render_metrics();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let model = state.frontend.model();
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: model.name.clone(),
            object: "model",
            created: state.started,
            owned_by: "baton",
            root: model.root.clone(),
            parent: None,
            max_model_len: state.frontend.info().max_model_len,
        }],
    })
}

async fn tokenize(State(frontend): State<Frontend>, body: JsonBody) -> Result<Json<TokenizeResponse>, ApiError> {
    let request: TokenizeRequest = body.parse()?;
    frontend.check_model(request.model.as_deref())?;
    let prompt = match (request.prompt, request.messages) {
        (Some(text), None) => {
            PromptInput::Text { text, add_special_tokens: request.add_special_tokens.unwrap_or(true) }
        }
        (None, Some(messages)) => {
            let turns = chat_turns(messages)?;
            PromptInput::Chat {
                messages: turns,
                add_generation_prompt: request.add_generation_prompt.unwrap_or(true),
                template_vars: Default::default(),
            }
        }
        _ => return Err(FrontendError::invalid_request("exactly one of `prompt` and `messages` is required").into()),
    };
    // Templating, tokenizing and the token strings run on the text pool: an 8 MiB prompt
    // takes seconds of CPU that the runtime's threads must not spend.
    let (tokens, _) = frontend.tokenize(prompt).await?;
    let (tokens, token_strs) = if request.return_token_strs.unwrap_or(false) {
        let codec = frontend.codec_handle();
        frontend
            .offload()
            .run(move || {
                let strs = tokens.iter().map(|&t| codec.vocab_string(t)).collect();
                (tokens, Some(strs))
            })
            .await?
    } else {
        (tokens, None)
    };
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: frontend.info().max_model_len, tokens, token_strs }))
}

async fn detokenize(State(frontend): State<Frontend>, body: JsonBody) -> Result<Json<DetokenizeResponse>, ApiError> {
    let request: DetokenizeRequest = body.parse()?;
    frontend.check_model(request.model.as_deref())?;
    let vocab = frontend.info().vocab_size;
    let ids = request
        .tokens
        .iter()
        .map(|&t| match u32::try_from(t) {
            Ok(id) if (id as usize) < vocab => Ok(id),
            _ => {
                Err(FrontendError::invalid("tokens", format!("token id {t} is outside the vocabulary (size {vocab})")))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let codec = frontend.codec_handle();
    let prompt = frontend.offload().run(move || codec.decode(&ids, false)).await??;
    Ok(Json(DetokenizeResponse { prompt }))
}
