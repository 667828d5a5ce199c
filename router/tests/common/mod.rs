//! Test support: a deterministic fake [`EngineClient`] with configurable pace, capacity and
//! health, KV-block accounting visible through `stats()`, and a record of aborts; plus a
//! tokenizer and chat template from `baton_formats::testing`, and a server on loopback.
#![allow(dead_code)]

use baton_core::api::{
    AbortSink, EngineClient, EngineError, EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason,
    OutputStream, PromptLogprob, RequestId, SubmitError, TokenLogprob,
};
use baton_formats::testing::{EOS_ID, TinySpec, write_hf_folder};
use baton_formats::{ChatTemplate, LoadFormat, Tokenizer};
use baton_metrics::Metrics;
use baton_router::{Frontend, HttpConfig, ServedModel, TextCodec};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;

/// Name the test server serves under.
pub const MODEL: &str = "tiny-test";
/// Context length of the fake engine.
pub const MAX_MODEL_LEN: usize = 256;
/// Tokens per KV block of the fake engine.
pub const BLOCK_SIZE: usize = 4;
/// First token id the fake generates from (below are special tokens).
const FIRST_PLAIN_ID: u32 = 16;

/// How the fake engine behaves.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    /// Pause before each generated token.
    pub token_delay: Duration,
    /// Requests (running + waiting) beyond which `submit` answers `QueueFull`.
    pub capacity: usize,
    /// Generate EOS as this (0-based) output token unless `ignore_eos`.
    pub eos_at: Option<usize>,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Fail with a backend error instead of producing this (0-based) output token.
    pub fail_at: Option<usize>,
    /// Accept every request but answer its stream with this error first, as a remote engine
    /// that refuses after submission (the cluster client) does.
    pub refuse_with: Option<EngineError>,
    /// Generate exactly these tokens, then EOS (instead of the pseudo-random ones).
    pub script: Option<Vec<u32>>,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            token_delay: Duration::from_millis(1),
            capacity: 64,
            eos_at: None,
            num_blocks: 1024,
            fail_at: None,
            refuse_with: None,
            script: None,
        }
    }
}

#[derive(Default)]
struct State {
    /// Blocks held by each live request.
    blocks: HashMap<RequestId, usize>,
    /// Abort flags of live requests.
    live: HashMap<RequestId, Arc<AtomicBool>>,
    aborted: HashSet<RequestId>,
    submitted: Vec<EngineRequest>,
}

struct Inner {
    config: FakeConfig,
    info: EngineInfo,
    state: Mutex<State>,
    next_id: AtomicU64,
    healthy: AtomicBool,
}

impl AbortSink for Inner {
    fn abort(&self, id: RequestId) {
        let mut state = self.state.lock().expect("state");
        if let Some(flag) = state.live.get(&id) {
            flag.store(true, Ordering::SeqCst);
            state.aborted.insert(id);
        }
    }
}

impl Inner {
    fn release(&self, id: RequestId) {
        let mut state = self.state.lock().expect("state");
        state.blocks.remove(&id);
        state.live.remove(&id);
    }
}

/// A deterministic fake engine. Token `i` of a sequence is a function of the prompt, the seed
/// and `i`, so equal requests with equal seeds produce equal outputs.
#[derive(Clone)]
pub struct FakeEngine {
    inner: Arc<Inner>,
}

impl FakeEngine {
    /// A fake over a vocabulary of `vocab_size`.
    pub fn new(vocab_size: usize, config: FakeConfig) -> Self {
        let info = EngineInfo {
            max_model_len: MAX_MODEL_LEN,
            vocab_size,
            block_size: BLOCK_SIZE,
            num_blocks: config.num_blocks,
            eos_token_ids: vec![EOS_ID],
            device: "fake".into(),
        };
        Self {
            inner: Arc::new(Inner {
                config,
                info,
                state: Mutex::default(),
                next_id: AtomicU64::new(1),
                healthy: AtomicBool::new(true),
            }),
        }
    }

    /// Marks the engine (un)healthy.
    pub fn set_healthy(&self, healthy: bool) {
        self.inner.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Requests aborted so far.
    pub fn aborted(&self) -> HashSet<RequestId> {
        self.inner.state.lock().expect("state").aborted.clone()
    }

    /// Requests still holding blocks.
    pub fn live(&self) -> usize {
        self.inner.state.lock().expect("state").live.len()
    }

    /// Every request submitted so far.
    pub fn submitted(&self) -> Vec<EngineRequest> {
        self.inner.state.lock().expect("state").submitted.clone()
    }

    fn token(vocab: usize, prompt: &[u32], seed: u64, i: usize) -> u32 {
        let span = (vocab as u64).saturating_sub(FIRST_PLAIN_ID as u64).max(1);
        let base =
            prompt.iter().fold(seed.wrapping_mul(0x9E37_79B9), |acc, &t| acc.wrapping_mul(31).wrapping_add(t as u64));
        FIRST_PLAIN_ID + ((base.wrapping_add(i as u64 * 7919)) % span) as u32
    }
}

impl EngineClient for FakeEngine {
    fn submit(&self, request: EngineRequest) -> Result<OutputStream, SubmitError> {
        if !self.is_healthy() {
            return Err(SubmitError::Unavailable("fake engine is down".into()));
        }
        assert_eq!(request.params.n, 1, "the frontend must fan out");
        request.params.validate(self.inner.info.vocab_size)?;
        let prompt_len = request.prompt_token_ids.len();
        let max_tokens = request.params.max_tokens.unwrap_or(MAX_MODEL_LEN - prompt_len.min(MAX_MODEL_LEN));
        if prompt_len + max_tokens > MAX_MODEL_LEN {
            return Err(SubmitError::ContextTooLong {
                prompt_tokens: prompt_len,
                max_tokens,
                max_model_len: MAX_MODEL_LEN,
            });
        }
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::SeqCst));
        let abort = Arc::new(AtomicBool::new(false));
        {
            let mut state = self.inner.state.lock().expect("state");
            if state.live.len() >= self.inner.config.capacity {
                return Err(SubmitError::QueueFull { waiting: state.live.len() });
            }
            state.live.insert(id, abort.clone());
            state.blocks.insert(id, prompt_len.div_ceil(BLOCK_SIZE));
            state.submitted.push(request.clone());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(e) = &self.inner.config.refuse_with {
            let _ = tx.send(Err(e.clone()));
            self.inner.release(id);
            return Ok(OutputStream::new(id, rx, self.inner.clone()));
        }
        let inner = self.inner.clone();
        let vocab = self.inner.info.vocab_size;
        let cached = if request.share_prefix_with.is_some() { prompt_len / BLOCK_SIZE * BLOCK_SIZE } else { 0 };
        tokio::spawn(async move {
            let p = &request.params;
            let seed = p.seed.unwrap_or(0);
            for i in 0..max_tokens {
                tokio::time::sleep(inner.config.token_delay).await;
                if abort.load(Ordering::SeqCst) {
                    break;
                }
                if inner.config.fail_at == Some(i) {
                    let _ = tx.send(Err(EngineError::Backend("fake failure".into())));
                    break;
                }
                let mut token = match &inner.config.script {
                    Some(script) => script.get(i).copied().unwrap_or(EOS_ID),
                    None => Self::token(vocab, &request.prompt_token_ids, seed, i),
                };
                let mut finish = None;
                let mut stop_token = None;
                if inner.config.eos_at == Some(i) && !p.ignore_eos && i >= p.min_tokens {
                    token = EOS_ID;
                }
                if (token == EOS_ID && !p.ignore_eos) || (p.stop_token_ids.contains(&token) && i >= p.min_tokens) {
                    finish = Some(FinishReason::Stop);
                    stop_token = Some(token);
                } else if i + 1 == max_tokens {
                    finish = Some(FinishReason::Length);
                }
                let logprobs = match p.logprobs {
                    None => Vec::new(),
                    Some(k) => {
                        let lp = -0.25 - i as f32 * 0.01;
                        let mut top = vec![(token, lp)];
                        top.extend((1..k as u32).map(|j| ((token + j) % vocab as u32, lp - j as f32)));
                        vec![TokenLogprob { token_id: token, logprob: lp, top }]
                    }
                };
                {
                    let mut state = inner.state.lock().expect("state");
                    if let Some(b) = state.blocks.get_mut(&id) {
                        *b = (prompt_len + i + 1).div_ceil(BLOCK_SIZE);
                    }
                }
                let prompt_logprobs = match p.prompt_logprobs {
                    Some(k) if i == 0 => fake_prompt_logprobs(&request.prompt_token_ids, k, vocab),
                    _ => Vec::new(),
                };
                let out = EngineOutput {
                    new_token_ids: vec![token],
                    logprobs,
                    finish_reason: finish,
                    stop_token,
                    num_prompt_tokens: prompt_len,
                    num_cached_tokens: cached,
                    prompt_logprobs,
                };
                if tx.send(Ok(out)).is_err() || finish.is_some() {
                    break;
                }
            }
            if abort.load(Ordering::SeqCst) {
                let _ = tx.send(Ok(EngineOutput {
                    new_token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish_reason: Some(FinishReason::Abort),
                    stop_token: None,
                    num_prompt_tokens: prompt_len,
                    num_cached_tokens: cached,
                    prompt_logprobs: Vec::new(),
                }));
            }
            inner.release(id);
        });
        Ok(OutputStream::new(id, rx, self.inner.clone()))
    }

    fn abort(&self, id: RequestId) {
        self.inner.abort(id);
    }

    fn info(&self) -> EngineInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> EngineStats {
        let state = self.inner.state.lock().expect("state");
        EngineStats {
            num_running: state.live.len(),
            num_waiting: 0,
            num_used_blocks: state.blocks.values().sum(),
            num_total_blocks: self.inner.config.num_blocks,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            num_preemptions: 0,
        }
    }

    fn is_healthy(&self) -> bool {
        self.inner.healthy.load(Ordering::SeqCst)
    }
}

/// The tiny test model's tokenizer and chat template (written once per test binary).
pub fn codec_parts() -> (Tokenizer, Option<ChatTemplate>) {
    static PARTS: OnceLock<(Tokenizer, Option<ChatTemplate>)> = OnceLock::new();
    PARTS
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = write_hf_folder(&dir.path().join("tiny"), &TinySpec::llama()).expect("tiny model");
            let model = baton_formats::load_model(&path, LoadFormat::Auto).expect("loads");
            (model.tokenizer.expect("tokenizer"), model.chat_template)
        })
        .clone()
}

/// A frontend over `engine` with the tiny tokenizer.
pub fn frontend(engine: &FakeEngine) -> Frontend {
    let (tokenizer, template) = codec_parts();
    let metrics = Arc::new(Metrics::new(MODEL).expect("metrics"));
    Frontend::new(
        Arc::new(engine.clone()),
        Arc::new(TextCodec::new(tokenizer, template)),
        ServedModel { name: MODEL.into(), root: "/models/tiny".into() },
        metrics,
    )
}

/// A test server on loopback.
pub struct TestServer {
    /// The fake engine behind it.
    pub engine: FakeEngine,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// HTTP client.
    pub client: reqwest::Client,
}

impl TestServer {
    /// Starts the HTTP app over a fresh fake engine.
    pub async fn start(config: FakeConfig, http: HttpConfig) -> Self {
        let vocab = codec_parts().0.vocab_size();
        let engine = FakeEngine::new(vocab, config);
        let app = baton_router::http_router(frontend(&engine), http);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        Self { engine, url: format!("http://{addr}"), client: reqwest::Client::new() }
    }

    /// Starts the HTTP app over a fresh fake engine with these admission limits.
    pub async fn start_limited(config: FakeConfig, limits: baton_router::AdmissionLimits) -> Self {
        let vocab = codec_parts().0.vocab_size();
        let engine = FakeEngine::new(vocab, config);
        let app = baton_router::http_router(frontend(&engine).with_admission(limits), HttpConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        Self { engine, url: format!("http://{addr}"), client: reqwest::Client::new() }
    }

    /// Starts with defaults.
    pub async fn default_start() -> Self {
        Self::start(FakeConfig::default(), HttpConfig::default()).await
    }

    /// POSTs JSON and returns status and parsed body.
    pub async fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self.client.post(format!("{}{path}", self.url)).json(&body).send().await.expect("send");
        let status = r.status().as_u16();
        (status, r.json().await.expect("json body"))
    }

    /// POSTs a raw body.
    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("send")
    }

    /// GET, returning the response.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(format!("{}{path}", self.url)).send().await.expect("send")
    }

    /// The value of one sample in `/metrics`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = self.get("/metrics").await.text().await.expect("text");
        metric_value(&text, series)
    }

    /// POSTs a streaming request and returns the `data:` payloads until `[DONE]`.
    pub async fn stream(&self, path: &str, body: serde_json::Value) -> Vec<String> {
        let r = self.client.post(format!("{}{path}", self.url)).json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let content_type = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        assert!(content_type.starts_with("text/event-stream"), "{content_type}");
        let text = r.text().await.expect("body");
        sse_data(&text)
    }
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))))
        .map(|s| s.trim().to_owned())
        .collect()
}

/// The value of `series` (name with labels) in Prometheus text.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls `cond` every 20 ms for up to `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond().await
}

/// The fake engine's prompt logprobs: entry `i > 0` scores `prompt[i]` at `-0.5 i - 0.1`, rank
/// `i`, with `k` alternatives `(prompt[i] + j) % vocab` at `-0.5 i - 0.1 - j` (the first is the
/// token itself, as for a rank-1 token).
pub fn fake_prompt_logprobs(prompt: &[u32], k: usize, vocab: usize) -> Vec<Option<PromptLogprob>> {
    prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            (i > 0).then(|| {
                let lp = -0.5 * i as f32 - 0.1;
                let top = (0..k as u32).map(|j| ((t + j) % vocab as u32, lp - j as f32)).collect();
                PromptLogprob { token_id: t, logprob: lp, rank: i as u32, top }
            })
        })
        .collect()
}
