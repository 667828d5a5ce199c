//! End to end: the real `baton` binary serving a tiny random model (written by
//! `baton_formats::testing`) on loopback. Covers every HTTP endpoint streaming and not, the
//! bad-input table, auth, config layering (flag > env > file), disconnects freeing KV blocks,
//! the gRPC API (streaming, abort) with its example client, and the CLI's own errors.

#[path = "common/port.rs"]
mod port;
use port::free_port;

use baton_formats::testing::{TinySpec, write_hf_folder};
use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::{
    AbortRequest, GenerateRequest, LoadsRequest, SamplingParams, generate_request::Input,
    generate_response::Response as Msg,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Long enough for a debug build to load a tiny model on a busy 2-core machine.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
const MODEL: &str = "tiny";
/// How soon after a disconnect/abort the engine must be idle again.
const ABORT_DEADLINE: Duration = Duration::from_millis(1500);

struct Serve {
    child: Child,
    log: PathBuf,
    http: String,
    grpc: String,
    client: reqwest::Client,
    /// The served model name (the `model_name` label of metrics).
    name: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tiny_model(dir: &Path) -> PathBuf {
    write_hf_folder(&dir.join("model"), &TinySpec::llama()).expect("tiny model")
}

impl Serve {
    async fn start(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> Serve {
        let (port, grpc_port) = (free_port(), free_port());
        let log = dir.join(format!("serve-{port}.log"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.arg("serve")
            .args(["--device", "cpu", "--port", &port.to_string(), "--grpc-port", &grpc_port.to_string()])
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn baton serve");
        let mut serve = Serve {
            child,
            log,
            http: format!("http://127.0.0.1:{port}"),
            grpc: format!("http://127.0.0.1:{grpc_port}"),
            client: reqwest::Client::new(),
            name: name.to_owned(),
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(Some(status)) = serve.child.try_wait() {
                panic!("baton serve exited with {status}:\n{}", serve.log_text());
            }
            if let Ok(r) = serve.client.get(format!("{}/health", serve.http)).send().await
                && r.status().is_success()
            {
                return serve;
            }
            assert!(Instant::now() < deadline, "baton serve did not come up:\n{}", serve.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.http)).json(&body).send().await.expect("send");
        (r.status().as_u16(), r.json().await.expect("json"))
    }

    async fn post_raw(&self, path: &str, body: String) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.http)).body(body).send().await.expect("send");
        (r.status().as_u16(), r.json().await.expect("json"))
    }

    async fn sse(&self, path: &str, body: Value) -> Vec<Value> {
        let r = self.client.post(format!("{}{path}", self.http)).json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let text = r.text().await.expect("body");
        let data: Vec<&str> = text.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk")).collect()
    }

    async fn metric(&self, series: &str) -> f64 {
        let text =
            self.client.get(format!("{}/metrics", self.http)).send().await.expect("send").text().await.expect("text");
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} missing in:\n{text}"))
    }

    async fn idle(&self) -> bool {
        let l = format!("{{model_name=\"{}\"}}", self.name);
        self.metric(&format!("baton_kv_blocks_used{l}")).await == 0.0
            && self.metric(&format!("vllm:num_requests_running{l}")).await == 0.0
            && self.metric(&format!("vllm:num_requests_waiting{l}")).await == 0.0
    }

    async fn wait_idle(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.idle().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.idle().await
    }
}

fn assert_error(status: u16, body: &Value, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let err = body["error"].as_object().unwrap_or_else(|| panic!("not an OpenAI error: {body}"));
    for key in ["message", "type", "param", "code"] {
        assert!(err.contains_key(key), "{key} missing: {body}");
    }
    if let Some(p) = want_param {
        assert_eq!(err["param"], p, "{body}");
    }
}

#[tokio::test]
async fn serve_end_to_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let s = Serve::start(
        dir.path(),
        MODEL,
        &[
            "--model",
            model.to_str().expect("utf8"),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "1",
        ],
        &[],
    )
    .await;
    let log = s.log_text();
    for fact in ["device", "kv_blocks", "kv_tokens", "listening"] {
        assert!(log.contains(fact), "startup log lacks {fact}:\n{log}");
    }

    // GET /v1/models, /health, /tokenize, /detokenize.
    let models: Value =
        s.client.get(format!("{}/v1/models", s.http)).send().await.expect("models").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], 512);
    let (status, tok) = s.post("/tokenize", json!({"prompt": "Hello world"})).await;
    assert_eq!(status, 200, "{tok}");
    let (_, detok) = s.post("/detokenize", json!({"tokens": tok["tokens"]})).await;
    assert_eq!(detok["prompt"], "Hello world");

    // Chat, non-streaming and streaming agree (greedy).
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, full) = s.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["usage"]["completion_tokens"], 12);
    let mut streaming = chat.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let chunks = s.sse("/v1/chat/completions", streaming).await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().expect("content"));
    assert_eq!(chunks.last().expect("usage")["usage"], full["usage"]);

    // Completions: n, logprobs, echo, seed reproducibility, stop strings.
    let comp = json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "n": 2, "logprobs": 2, "seed": 42, "temperature": 0.9, "ignore_eos": true});
    let (status, a) = s.post("/v1/completions", comp.clone()).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["choices"].as_array().expect("choices").len(), 2);
    assert_eq!(a["choices"][0]["logprobs"]["tokens"].as_array().expect("tokens").len(), 8);
    let (_, b) = s.post("/v1/completions", comp).await;
    assert_eq!(a["choices"], b["choices"], "same seed, same samples");
    let (_, greedy) = s
        .post("/v1/completions", json!({"prompt": "Once upon", "max_tokens": 40, "temperature": 0, "ignore_eos": true}))
        .await;
    let text = greedy["choices"][0]["text"].as_str().expect("text").to_owned();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let (_, stopped) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Once upon", "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": stop}),
        )
        .await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["text"].as_str().expect("text"), &text[..text.find(&stop).expect("stop")]);
    let chunks =
        s.sse("/v1/completions", json!({"prompt": "Once upon", "max_tokens": 5, "echo": true, "stream": true})).await;
    let echoed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect::<Vec<_>>().concat();
    assert!(echoed.starts_with("Once upon"), "{echoed}");

    // The bad-input table; the server keeps serving after each.
    let (st, body) = s.post_raw("/v1/chat/completions", "{\"messages\": [".into()).await;
    assert_error(st, &body, 400, None);
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", json!({"messages": "hi"}), 400, Some("messages")),
        ("/v1/chat/completions", json!({"model": MODEL}), 400, Some("messages")),
        ("/v1/chat/completions", json!({"messages": []}), 400, Some("messages")),
        ("/v1/completions", json!({"max_tokens": 3}), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": "x", "temperature": -1}), 400, Some("temperature")),
        ("/v1/completions", json!({"prompt": "x", "top_p": 7}), 400, Some("top_p")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -5}), 400, Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "x", "n": 100000}), 400, Some("n")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 100000}), 400, Some("max_tokens")),
        ("/v1/completions", json!({"model": "nope", "prompt": "x"}), 404, Some("model")),
    ];
    for (path, body, status, param) in cases {
        let (st, response) = s.post(path, body.clone()).await;
        assert_error(st, &response, status, param);
    }
    let (_, too_long) = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 100000})).await;
    let message = too_long["error"]["message"].as_str().expect("message");
    assert!(message.contains("512") && message.contains("100000"), "{message}");
    let (_, nf) = s.post("/v1/completions", json!({"model": "nope", "prompt": "x"})).await;
    assert_eq!(nf["error"]["code"], "model_not_found");
    assert!(s.wait_idle(Duration::from_secs(5)).await, "nothing leaked from bad requests");

    // Disconnect mid-stream: every sequence is aborted and its blocks freed. With one running
    // sequence at a time, 64 x 480 tokens take seconds, so "idle within ABORT_DEADLINE" shows
    // the abort, not a natural finish.
    let l = format!("{{model_name=\"{MODEL}\"}}");
    let long = json!({"prompt": "Tell me everything", "max_tokens": 480, "n": 64, "ignore_eos": true, "stream": true});
    let mut r = s.client.post(format!("{}/v1/completions", s.http)).json(&long).send().await.expect("send");
    let mut seen = String::new();
    while seen.matches("\"text\":\"").count() < 3 {
        let chunk = r.chunk().await.expect("read").expect("more");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(s.metric(&format!("baton_kv_blocks_used{l}")).await > 0.0, "running when the client leaves");
    drop(r);
    assert!(s.wait_idle(ABORT_DEADLINE).await, "blocks freed after disconnect:\n{}", s.log_text());

    // gRPC: stream a generation; abort another mid-stream; blocks are freed.
    let mut grpc = BatonClient::connect(s.grpc.clone()).await.expect("connect grpc");
    let request = |id: &str, n: u32, max_tokens: u32| GenerateRequest {
        request_id: id.into(),
        input: Some(Input::Text("Once upon".into())),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            n: Some(n),
            ignore_eos: true,
            ..Default::default()
        }),
        add_special_tokens: None,
    };
    let mut stream = grpc.generate(request("g1", 1, 6)).await.expect("generate").into_inner();
    let (mut tokens, mut finish) = (0, String::new());
    while let Some(m) = stream.message().await.expect("message") {
        match m.response.expect("response") {
            Msg::Chunk(c) => tokens += c.token_ids.len(),
            Msg::Complete(c) => finish = c.finish_reason,
            Msg::Error(e) => panic!("{e:?}"),
        }
    }
    assert_eq!((tokens, finish.as_str()), (6, "length"));
    let mut stream = grpc.generate(request("g2", 64, 480)).await.expect("generate").into_inner();
    let _ = stream.message().await.expect("message").expect("first");
    assert!(grpc.abort(AbortRequest { request_id: "g2".into() }).await.expect("abort").into_inner().found);
    let mut aborted = 0;
    while let Some(m) = stream.message().await.expect("message") {
        if let Some(Msg::Complete(c)) = m.response
            && c.finish_reason == "abort"
        {
            aborted += 1;
        }
    }
    assert!(aborted > 0, "some sequences ended by the abort");
    assert!(s.wait_idle(ABORT_DEADLINE).await);
    assert_eq!(grpc.loads(LoadsRequest {}).await.expect("loads").into_inner().num_used_blocks, 0);
    // Cancelling the call aborts too.
    let mut stream = grpc.generate(request("g3", 64, 480)).await.expect("generate").into_inner();
    let _ = stream.message().await.expect("message").expect("first");
    drop(stream);
    assert!(s.wait_idle(ABORT_DEADLINE).await, "cancel freed blocks");

    // The example client.
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["client", "grpc", "--addr", &s.grpc, "--prompt", "Once upon", "--max-tokens", "5"])
        .output()
        .expect("run client");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("finish_reason=length"));

    assert_eq!(s.client.get(format!("{}/health", s.http)).send().await.expect("health").status().as_u16(), 200);
}

#[tokio::test]
async fn auth_limits_and_config_layers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let config = dir.path().join("baton.toml");
    // The file names the model and two limits; env and flags override some of them.
    std::fs::write(
        &config,
        format!(
            "[serve]\nmodel = {:?}\nserved_model_name = \"from-file\"\nmax_body_bytes = 2048\nmax_waiting = 100\nport = 1\n",
            model.to_str().expect("utf8")
        ),
    )
    .expect("write config");
    let s = Serve::start(
        dir.path(),
        "from-file",
        &["--config", config.to_str().expect("utf8")],
        // env beats the file (one waiting request at most, one running: a wide `n` must be
        // refused with 429); the --port flag from Serve::start beats the file's port 1.
        &[("BATON_API_KEY", "sekret"), ("BATON_MAX_WAITING", "1"), ("BATON_MAX_NUM_SEQS", "1")],
    )
    .await;
    let url = |p: &str| format!("{}{p}", s.http);
    let r = s.client.get(url("/v1/models")).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let body: Value = r.json().await.expect("json");
    assert_error(401, &body, 401, None);
    let r = s.client.get(url("/v1/models")).bearer_auth("wrong").send().await.expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let models: Value =
        s.client.get(url("/v1/models")).bearer_auth("sekret").send().await.expect("send").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], "from-file");
    let r = s
        .client
        .post(url("/v1/completions"))
        .bearer_auth("sekret")
        .json(&json!({"prompt": "x", "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 200, "one sequence fits");
    let wide = json!({"prompt": "x", "max_tokens": 400, "n": 64, "ignore_eos": true});
    let r = s.client.post(url("/v1/completions")).bearer_auth("sekret").json(&wide).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 429);
    assert!(r.headers().get("retry-after").is_some());
    let body: Value = r.json().await.expect("json");
    assert_error(429, &body, 429, None);
    assert!(s.wait_idle(Duration::from_secs(3)).await, "children accepted before the refusal were aborted");
    let r = s
        .client
        .post(url("/v1/completions"))
        .bearer_auth("sekret")
        .body(format!("{{\"prompt\": \"{}\"}}", "y".repeat(4096)))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 413);
    // /health and /metrics stay open.
    assert_eq!(s.client.get(url("/health")).send().await.expect("send").status().as_u16(), 200);
    assert_eq!(s.client.get(url("/metrics")).send().await.expect("send").status().as_u16(), 200);
}

#[test]
fn missing_default_model_and_bad_flags_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).arg("serve").current_dir(dir.path()).output().expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("scripts/fetch-default-model.sh"), "{stderr}");
    assert!(stderr.contains("models/SmolLM2-135M-Instruct.Q4_1.gguf"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(["serve", "--port", "http"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--port"));
    let bad_device = dir.path().join("m");
    std::fs::create_dir_all(&bad_device).expect("dir");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--device", "tpu", "--model", bad_device.to_str().expect("utf8")])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tpu"));
}

#[test]
fn help_lists_every_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(["serve", "--help"]).output().expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--model",
        "--device",
        "--host",
        "--port",
        "--grpc-port",
        "--api-key",
        "--served-model-name",
        "--load-format",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--num-kv-blocks",
        "--max-waiting",
        "--disable-prefix-caching",
        "--disable-chunked-prefill",
        "--threads",
        "--max-body-bytes",
        "--max-inflight",
        "BATON_MODEL",
        "BATON_PORT",
    ] {
        assert!(help.contains(flag), "{flag} missing from serve --help:\n{help}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(["client", "grpc", "--help"]).output().expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("--prompt"));
}

/// Every start-up phase is logged once, in the format `bench_startup` reads back, and the
/// total (process start to healthy) covers the phases before it.
#[tokio::test]
async fn startup_phases_are_logged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let s =
        Serve::start(dir.path(), MODEL, &["--model", model.to_str().expect("utf8"), "--served-model-name", MODEL], &[])
            .await;
    let log = s.log_text();
    let phase_ms = |phase: &str| -> f64 {
        let tag = format!("phase=\"{phase}\" ms=");
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("startup phase") && l.contains(&tag)).collect();
        assert_eq!(lines.len(), 1, "phase {phase} logged {} times:\n{log}", lines.len());
        let rest = &lines[0][lines[0].find(&tag).expect("tag") + tag.len()..];
        rest.split(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("ms of {phase}: {}", lines[0]))
    };
    let (files, weights, kv, engine, total) = (
        phase_ms("config_tokenizer"),
        phase_ms("weights"),
        phase_ms("kv_cache"),
        phase_ms("engine"),
        phase_ms("total"),
    );
    assert!(engine >= weights && engine >= kv, "engine {engine} ms covers weights {weights} and kv {kv}");
    assert!(total >= files + engine - 2.0, "total {total} ms covers files {files} + engine {engine}");
    // The tiny model's tensors: embeddings, norm, head and 9 per layer (2 layers, no biases).
    assert!(log.contains("tensors=21"), "{log}");
}

#[test]
fn kernels_build_is_documented_and_refuses_unknown_architectures() {
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(["kernels", "build", "--help"]).output().expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--arch", "--out", "sm_90a", "BATON_KERNEL_CACHE_DIR"] {
        assert!(help.contains(flag), "{flag} missing from kernels build --help:\n{help}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("kernels");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["kernels", "build", "--arch", "hopper", "--out", cache.to_str().expect("utf8")])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown architecture \"hopper\""), "{stderr}");
    assert!(!cache.exists(), "nothing is written for a refused architecture");
}

/// `baton kernels build` fills a cache (NVRTC only, no device), and a second run finds every
/// module there.
#[test]
fn gpu_kernels_build_fills_a_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("kernels");
    let build = || {
        let out = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["kernels", "build", "--arch", "sm_90a"])
            .env("BATON_KERNEL_CACHE_DIR", &cache)
            .output()
            .expect("run");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = build();
    assert!(first.contains("0 already there"), "{first}");
    let cubins = std::fs::read_dir(&cache)
        .expect("cache")
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "cubin")))
        .count();
    assert!(cubins >= 10, "{cubins} modules in the cache:\n{first}");
    let second = build();
    assert!(second.contains(&format!("(0 compiled, {cubins} already there)")), "{second}");
}

/// Engine faults injected into one forward pass (the hidden `--chaos-engine-fault` flag): a
/// panic turns `/health` to 503 for good; a stall past `--engine-stall-timeout-ms` turns it
/// to 503 until the step returns; a recoverable error fails one request and the next one
/// succeeds; a fatal error ends the process with its own status and a clear log line.
#[tokio::test]
async fn engine_faults_show_on_health_and_a_fatal_one_exits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let model = model.to_str().expect("utf8");
    let start = |extra: &'static [&'static str]| {
        let mut args = vec!["--model", model, "--served-model-name", MODEL, "--max-model-len", "256"];
        args.extend_from_slice(extra);
        let dir = dir.path().to_owned();
        async move { Serve::start(&dir, MODEL, &args, &[]).await }
    };
    let completion = |max_tokens: u32| json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens});
    let health = |s: &Serve| {
        let url = format!("{}/health", s.http);
        let client = s.client.clone();
        async move { client.get(url).send().await.expect("health").status().as_u16() }
    };

    // A panic at the second forward pass.
    let s = start(&["--chaos-engine-fault", "panic@2"]).await;
    assert_eq!(s.post("/v1/completions", completion(1)).await.0, 200, "the first step is fine");
    let (status, body) = s.post("/v1/completions", completion(4)).await;
    assert!(status >= 500, "{status} {body}");
    assert_eq!(health(&s).await, 503);
    let (status, body) = s.post("/v1/completions", completion(1)).await;
    assert_eq!(status, 503, "{body}");
    assert!(s.log_text().contains("panicked"), "{}", s.log_text());
    drop(s);

    // A step that hangs for 3 s with a 300 ms stall timeout.
    let s = start(&["--chaos-engine-fault", "stall=3000@1", "--engine-stall-timeout-ms", "300"]).await;
    let (url, client) = (format!("{}/v1/completions", s.http), s.client.clone());
    let stalled =
        tokio::spawn(async move { client.post(url).json(&completion(2)).send().await.expect("send").status() });
    let t0 = Instant::now();
    while health(&s).await != 503 {
        assert!(t0.elapsed() < Duration::from_millis(2500), "/health never reported the stall");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stalled.await.expect("join").as_u16(), 200, "the stalled request completes once the step returns");
    assert_eq!(health(&s).await, 200, "healthy again");
    drop(s);

    // A recoverable error at the first forward pass.
    let s = start(&["--chaos-engine-fault", "error@1"]).await;
    let (status, body) = s.post("/v1/completions", completion(3)).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(health(&s).await, 200);
    let (status, body) = s.post("/v1/completions", completion(3)).await;
    assert_eq!(status, 200, "{body}");
    drop(s);

    // A fatal error: the process exits with status 70 and says why.
    let mut s = start(&["--chaos-engine-fault", "fatal@1"]).await;
    let (status, _) = s.post("/v1/completions", completion(3)).await;
    assert!(status >= 500);
    let t0 = Instant::now();
    let code = loop {
        if let Some(status) = s.child.try_wait().expect("wait") {
            break status.code();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the process did not exit:\n{}", s.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(70), "{}", s.log_text());
    assert!(s.log_text().contains("FATAL: the engine lost its device"), "{}", s.log_text());
}

/// Prompt logprobs through the real server: `echo` + `logprobs` with a token prompt and
/// `max_tokens: 1` (lm-evaluation-harness's loglikelihood request) scores a continuation that
/// greedy decoding produced with the logprobs decoding reported (teacher forcing = decoding),
/// the continuation reads as greedy the way lm-eval decides it, and a second identical request
/// (its prompt now in the prefix cache) scores the same.
#[tokio::test]
async fn echo_logprobs_score_the_prompt_like_decoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let s = Serve::start(
        dir.path(),
        MODEL,
        &["--model", model.to_str().expect("utf8"), "--served-model-name", MODEL, "--max-model-len", "512"],
        &[],
    )
    .await;
    let context: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % 300).collect();
    // Decode greedily over gRPC (which returns token ids), asking for the context's prompt
    // logprobs as well.
    let mut grpc = BatonClient::connect(s.grpc.clone()).await.expect("connect grpc");
    let request = GenerateRequest {
        request_id: "decode".into(),
        input: Some(Input::TokenIds(baton_proto::v1::TokenIds { ids: context.clone() })),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(6),
            ignore_eos: true,
            logprobs: Some(1),
            prompt_logprobs: Some(1),
            ..Default::default()
        }),
        add_special_tokens: None,
    };
    let mut stream = grpc.generate(request).await.expect("generate").into_inner();
    let (mut continuation, mut generated, mut prompt_entries) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(m) = stream.message().await.expect("message") {
        match m.response.expect("response") {
            Msg::Chunk(c) => {
                if continuation.is_empty() {
                    prompt_entries = c.prompt_logprobs.clone();
                } else {
                    assert!(c.prompt_logprobs.is_empty(), "prompt logprobs come with the first chunk only");
                }
                continuation.extend(c.token_ids.iter().map(|&t| t as u64));
                generated.extend(c.logprobs.iter().map(|l| l.logprob as f64));
            }
            Msg::Complete(_) => {}
            Msg::Error(e) => panic!("{e:?}"),
        }
    }
    assert_eq!((continuation.len(), generated.len()), (6, 6));
    assert_eq!(prompt_entries.len(), context.len());
    assert!(!prompt_entries[0].present && prompt_entries[1..].iter().all(|e| e.present && e.top.len() == 1));
    let prompt: Vec<u64> = context.iter().map(|&t| t as u64).chain(continuation.iter().copied()).collect();
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true, "logprobs": 1});
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (status, scored) = s.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{scored}");
        runs.push(scored["choices"][0]["logprobs"].clone());
    }
    let lp = &runs[0];
    let token_logprobs = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(token_logprobs.len(), prompt.len() + 1);
    assert!(token_logprobs[0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    let ctxlen = context.len();
    for (i, e) in prompt_entries.iter().enumerate().skip(1) {
        let http = token_logprobs[i].as_f64().expect("number");
        assert!((http - e.logprob as f64).abs() < 1e-5, "context token {i}: HTTP {http} vs gRPC {}", e.logprob);
    }
    let scored = &token_logprobs[ctxlen..token_logprobs.len() - 1];
    for (i, (a, b)) in scored.iter().zip(&generated).enumerate() {
        let (a, b) = (a.as_f64().expect("number"), *b);
        assert!((a - b).abs() < 1e-3, "continuation token {i}: teacher forcing {a} vs decoding {b}");
    }
    let tops = &lp["top_logprobs"].as_array().expect("top")[ctxlen..token_logprobs.len() - 1];
    let greedy = scored.iter().zip(tops).all(|(t, top)| {
        let best = top.as_object().expect("top").values().filter_map(Value::as_f64).fold(f64::NEG_INFINITY, f64::max);
        t.as_f64() == Some(best)
    });
    assert!(greedy, "a greedy continuation must read as greedy: {lp}");
    assert_eq!(runs[0]["token_logprobs"], runs[1]["token_logprobs"], "a prefix-cache hit changed the scores");
    assert!(s.wait_idle(ABORT_DEADLINE).await, "blocks still held");
}
