//! A scripted OpenAI-compatible SSE server with known delays, run inside the
//! tests: the first content chunk leaves `ttft_ms` after the request arrives,
//! then one chunk (one token) every `itl_ms`, each at an absolute deadline so
//! the schedule does not drift. It also serves `/v1/models`, and a
//! whitespace tokenizer on `/tokenize` and `/detokenize` whose round trip is
//! exact (word `wN` is token N).

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::time::Instant;

/// How the server behaves.
#[derive(Debug, Clone, Copy)]
pub struct Script {
    /// Delay of the first content chunk after the request arrives.
    pub ttft_ms: u64,
    /// Gap between content chunks.
    pub itl_ms: u64,
    /// Every k-th generation request fails with HTTP 500.
    pub fail_every: Option<usize>,
    /// Send the usage chunk when asked for it.
    pub send_usage: bool,
    /// Whether the generated tokens have text (see [`Text`]).
    pub text: Text,
}

/// What the scripted tokens look like on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Text {
    /// `" tok{k}"` per chunk.
    Words,
    /// Each token a chunk with empty text (tokens that decode to nothing).
    Empty,
    /// No token chunks at all, only the chunk that ends the choice (and the usage).
    FinishOnly,
}

impl Script {
    pub fn new(ttft_ms: u64, itl_ms: u64) -> Self {
        Self { ttft_ms, itl_ms, fail_every: None, send_usage: true, text: Text::Words }
    }
}

/// Counters and captured requests, shared with the test.
#[derive(Default)]
pub struct Observed {
    pub requests: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
    pub bodies: Mutex<Vec<Value>>,
}

struct InFlight(Arc<Observed>);

impl InFlight {
    fn enter(obs: &Arc<Observed>) -> Self {
        let now = obs.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        obs.max_in_flight.fetch_max(now, Ordering::SeqCst);
        Self(Arc::clone(obs))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
struct AppState {
    script: Script,
    observed: Arc<Observed>,
}

/// A running scripted server.
pub struct ScriptedServer {
    pub base_url: String,
    pub observed: Arc<Observed>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a server on a free loopback port.
pub async fn start(script: Script) -> ScriptedServer {
    let observed = Arc::new(Observed::default());
    let state = AppState { script, observed: Arc::clone(&observed) };
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    ScriptedServer { base_url: format!("http://{addr}"), observed, task }
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "scripted-model", "object": "model"}]}))
}

fn word_id(word: &str) -> u32 {
    word.strip_prefix('w')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| word.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b))) % 1000)
}

/// Token ids of `text` in the scripted whitespace tokenizer.
pub fn scripted_tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace().map(word_id).collect()
}

async fn tokenize(Json(body): Json<Value>) -> Json<Value> {
    let tokens = scripted_tokenize(body["prompt"].as_str().unwrap_or(""));
    Json(json!({"count": tokens.len(), "max_model_len": 4096, "tokens": tokens}))
}

async fn detokenize(Json(body): Json<Value>) -> Json<Value> {
    let words: Vec<String> = body["tokens"]
        .as_array()
        .map(|a| a.iter().map(|t| format!("w{}", t.as_u64().unwrap_or(0))).collect())
        .unwrap_or_default();
    Json(json!({"prompt": words.join(" ")}))
}

async fn completions(State(s): State<AppState>, Json(body): Json<Value>) -> Response {
    generate(s, body, false)
}

async fn chat(State(s): State<AppState>, Json(body): Json<Value>) -> Response {
    generate(s, body, true)
}

fn generate(s: AppState, body: Value, chat: bool) -> Response {
    let arrived = Instant::now();
    let n = s.observed.requests.fetch_add(1, Ordering::SeqCst) + 1;
    s.observed.bodies.lock().expect("bodies lock").push(body.clone());
    if s.script.fail_every.is_some_and(|k| n.is_multiple_of(k)) {
        let err = json!({"error": {"message": "scripted failure", "type": "server_error", "param": null, "code": 500}});
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(err)).into_response();
    }
    let max_tokens =
        body.get(if chat { "max_completion_tokens" } else { "max_tokens" }).and_then(Value::as_u64).unwrap_or(16)
            as usize;
    let prompt_tokens = if chat {
        body["messages"][0]["content"].as_str().map(|p| scripted_tokenize(p).len())
    } else {
        body["prompt"].as_str().map(|p| scripted_tokenize(p).len())
    }
    .unwrap_or(0);
    let want_usage = s.script.send_usage && body["stream_options"]["include_usage"].as_bool() == Some(true);
    let guard = InFlight::enter(&s.observed);
    let script = s.script;
    let mut events: Vec<(Option<Instant>, String)> = Vec::new();
    if chat {
        // A role-only delta before any content, as real servers send; it must
        // not count as the first token.
        events.push((
            None,
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}).to_string(),
        ));
    }
    for k in 0..max_tokens {
        let due = arrived + Duration::from_millis(script.ttft_ms + k as u64 * script.itl_ms);
        let piece = if script.text == Text::Words { format!(" tok{k}") } else { String::new() };
        let chunk = if chat {
            json!({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}]})
        } else {
            json!({"choices": [{"index": 0, "text": piece, "finish_reason": null}]})
        };
        if script.text != Text::FinishOnly {
            events.push((Some(due), chunk.to_string()));
        }
    }
    // The chunk that ends the choice, after the last token's due time.
    let end = arrived + Duration::from_millis(script.ttft_ms + max_tokens.saturating_sub(1) as u64 * script.itl_ms);
    let finish = if chat {
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    } else {
        json!({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    };
    events.push((Some(end), finish.to_string()));
    if want_usage {
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens});
        events.push((None, json!({"choices": [], "usage": usage}).to_string()));
    }
    events.push((None, "[DONE]".to_string()));
    let stream = futures::stream::unfold((events.into_iter(), guard), |(mut it, guard)| async move {
        let (due, data) = it.next()?;
        if let Some(due) = due {
            tokio::time::sleep_until(due).await;
        }
        Some((Ok::<_, std::convert::Infallible>(Event::default().data(data)), (it, guard)))
    });
    Sse::new(stream).into_response()
}

/// A prompts file of `n` lines in a temp dir.
pub fn prompts_file(dir: &tempfile::TempDir, n: usize) -> std::path::PathBuf {
    let path = dir.path().join("prompts.txt");
    let text: String = (0..n).map(|i| format!("w1 w2 w{i}\n")).collect();
    std::fs::write(&path, text).expect("write prompts");
    path
}
