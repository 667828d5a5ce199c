//! Shared harness of the end-to-end tests with real `baton` processes on loopback: spawning
//! (and killing) `serve`, `router` and `worker` processes on free ports, a router with its
//! workers ([`Cluster`]), the tiny random model, reference outputs from `serve`, and the
//! cluster-secret and TLS files the security tests pass.
// Each test binary uses a different part of this harness.
#![allow(dead_code)]

use baton_formats::testing::{TinySpec, write_hf_folder};
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const STARTUP: Duration = Duration::from_secs(120);
pub const MODEL: &str = "tiny";
pub const MAX_TOKENS: usize = 24;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port()
}

pub fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

/// A `baton` child process, killed when dropped.
pub struct Proc {
    child: Child,
    /// Its log file (stderr).
    pub log: PathBuf,
    /// Its HTTP base URL.
    pub http: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn spawn(dir: &Path, tag: &str, args: &[String]) -> Proc {
        let port = free_port();
        let log = dir.join(format!("{tag}-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(args)
            .args(["--port".to_owned(), port.to_string()])
            .current_dir(dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn baton");
        Proc { child, log, http: format!("http://127.0.0.1:{port}") }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub async fn wait_healthy(&mut self, http: &reqwest::Client) {
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(status) = self.exited() {
                panic!("{} exited with {status}:\n{}", self.log.display(), self.log_text());
            }
            if let Ok(r) = http.get(format!("{}/health", self.http)).send().await
                && r.status().is_success()
            {
                return;
            }
            assert!(Instant::now() < deadline, "{} never became healthy:\n{}", self.log.display(), self.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn metric(&self, http: &reqwest::Client, series: &str) -> f64 {
        let text = http.get(format!("{}/metrics", self.http)).send().await.expect("metrics").text().await.expect("t");
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} missing in:\n{text}"))
    }

    /// Waits until the worker holds no KV blocks and runs nothing (the no-leak check).
    pub async fn assert_idle(&self, http: &reqwest::Client) {
        let l = format!("{{model_name=\"{MODEL}\"}}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let used = self.metric(http, &format!("baton_kv_blocks_used{l}")).await;
            let running = self.metric(http, &format!("vllm:num_requests_running{l}")).await;
            let waiting = self.metric(http, &format!("vllm:num_requests_waiting{l}")).await;
            if used == 0.0 && running == 0.0 && waiting == 0.0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {used} blocks used, {running} running, {waiting} waiting",
                self.http
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub fn model_args(model: &Path) -> Vec<String> {
    [
        "--model",
        model.to_str().expect("utf8"),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "512",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--block-size",
        "16",
        "--num-kv-blocks",
        "64",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A router and its workers.
pub struct Cluster {
    /// The router.
    pub router: Proc,
    /// Prefill workers, in start order.
    pub prefill: Vec<Proc>,
    /// Decode workers, in start order.
    pub decode: Vec<Proc>,
    /// A client for their HTTP APIs.
    pub http: reqwest::Client,
    /// The router's registry URL (`http://127.0.0.1:PORT`).
    pub registry: String,
}

impl Cluster {
    /// Starts a router from `config` (ports overridden; `router_flags` added, and overriding
    /// the test defaults they name) plus workers; `extra_p`/`extra_d` give per-worker extra
    /// flags (fault injection, security).
    pub async fn start(
        dir: &Path,
        model: &Path,
        config: &str,
        router_flags: &[&str],
        extra_p: &[Vec<&str>],
        extra_d: &[Vec<&str>],
    ) -> Cluster {
        let http = reqwest::Client::new();
        let registry = free_port();
        let config = configs().join(config);
        let mut router_args: Vec<String> = vec!["router".into(), "--config".into(), config.display().to_string()];
        let (np, nd) = (extra_p.len().to_string(), extra_d.len().to_string());
        let defaults = [
            ("--model", model.to_str().expect("utf8")),
            ("--served-model-name", MODEL),
            ("--max-model-len", "512"),
            ("--grpc-port", "0"),
            ("--heartbeat-interval-ms", "200"),
            ("--eject-after-ms", "1500"),
            ("--kv-deadline-ms", "5000"),
            ("--idle-timeout-ms", "20000"),
            ("--min-prefill-workers", &np),
            ("--min-decode-workers", &nd),
        ];
        // `router_flags` may override a default.
        for (flag, value) in defaults {
            if !router_flags.contains(&flag) {
                router_args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        router_args.extend(["--registry-port".into(), registry.to_string()]);
        router_args.extend(router_flags.iter().map(|s| s.to_string()));
        let router = Proc::spawn(dir, "router", &router_args);
        let worker = |role: &str, i: usize, extra: &[&str]| {
            let mut args: Vec<String> =
                vec!["worker".into(), "--config".into(), config.display().to_string(), "--role".into(), role.into()];
            args.extend(model_args(model));
            args.extend(["--router".into(), format!("http://127.0.0.1:{registry}")]);
            args.extend(extra.iter().map(|s| s.to_string()));
            Proc::spawn(dir, &format!("{role}{i}"), &args)
        };
        let registry = format!("http://127.0.0.1:{registry}");
        let mut c = Cluster { router, prefill: Vec::new(), decode: Vec::new(), http, registry };
        // Decode workers first, in order, so the registration order (and tie-breaks) follows it.
        for (i, extra) in extra_d.iter().enumerate() {
            let mut w = worker("decode", i, extra);
            w.wait_healthy(&c.http).await;
            c.wait_workers(0, i + 1).await;
            c.decode.push(w);
        }
        for (i, extra) in extra_p.iter().enumerate() {
            let mut w = worker("prefill", i, extra);
            w.wait_healthy(&c.http).await;
            c.wait_workers(i + 1, extra_d.len()).await;
            c.prefill.push(w);
        }
        let http = c.http.clone();
        c.router.wait_healthy(&http).await;
        c
    }

    pub async fn workers(&self) -> Vec<Value> {
        let r = self.http.get(format!("{}/workers", self.router.http)).send().await.expect("workers");
        r.json::<Vec<Value>>().await.expect("json")
    }

    pub async fn wait_workers(&mut self, prefill: usize, decode: usize) {
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(status) = self.router.exited() {
                panic!("router exited with {status}:\n{}", self.router.log_text());
            }
            if let Ok(r) = self.http.get(format!("{}/workers", self.router.http)).send().await
                && let Ok(ws) = r.json::<Vec<Value>>().await
            {
                let n = |role: &str| ws.iter().filter(|w| w["role"] == role).count();
                if n("prefill") == prefill && n("decode") == decode {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "workers did not register:\n{}", self.router.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn all_workers(&self) -> impl Iterator<Item = &Proc> {
        self.prefill.iter().chain(&self.decode)
    }
}

pub fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    // Lengths around the block size (16), deterministic contents.
    [3usize, 15, 16, 17, 40, 90]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| ((i * 7919 + j * 104_729 + 11) as u32) % vocab).collect())
        .collect()
}

pub fn completion(prompt: &[u32], stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true,
           "logprobs": 2, "stream": stream})
}

/// Text and per-token logprobs of a completion, non-streaming or streaming.
pub async fn complete(http: &reqwest::Client, base: &str, prompt: &[u32], stream: bool) -> (String, Vec<f64>) {
    let r = http.post(format!("{base}/v1/completions")).json(&completion(prompt, stream)).send().await.expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    assert_eq!(status, 200, "{text}");
    let lps = |c: &Value| -> Vec<f64> {
        c["logprobs"]["token_logprobs"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    if !stream {
        let v: Value = serde_json::from_str(&text).expect("json");
        let c = &v["choices"][0];
        assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS, "{v}");
        return (c["text"].as_str().expect("text").to_owned(), lps(c));
    }
    let mut out = String::new();
    let mut lp = Vec::new();
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("chunk");
        assert!(v.get("error").is_none(), "stream error: {v}");
        let c = &v["choices"][0];
        out.push_str(c["text"].as_str().unwrap_or(""));
        lp.extend(lps(c));
    }
    (out, lp)
}

/// Same text (so the same greedy tokens) and the same logprobs up to float rounding: a
/// prefix-cache hit changes the order of the attention sums, not the tokens.
pub fn assert_same(got: &(String, Vec<f64>), want: &(String, Vec<f64>), what: &str) {
    assert_eq!(got.0, want.0, "{what}: text differs");
    assert_eq!(got.1.len(), want.1.len(), "{what}: logprob count");
    for (i, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
        assert!((a - b).abs() < 1e-4, "{what}: logprob {i} is {a}, serve gave {b}");
    }
}

pub async fn reference(dir: &Path, model: &Path, ps: &[Vec<u32>]) -> Vec<(String, Vec<f64>)> {
    let mut args: Vec<String> = vec!["serve".into(), "--grpc-port".into(), "0".into()];
    args.extend(model_args(model));
    let mut serve = Proc::spawn(dir, "serve", &args);
    let http = reqwest::Client::new();
    serve.wait_healthy(&http).await;
    let mut out = Vec::new();
    for p in ps {
        let r = complete(&http, &serve.http, p, false).await;
        assert_same(&complete(&http, &serve.http, p, true).await, &r, "serve: streaming vs not");
        out.push(r);
    }
    out
}

pub fn tiny(dir: &Path) -> (PathBuf, u32) {
    let spec = TinySpec::llama();
    let path = write_hf_folder(&dir.join("model"), &spec).expect("tiny model");
    (path, spec.vocab_size as u32)
}

/// Waits until the router's pools hold `prefill` and `decode` workers (after an ejection).
pub async fn wait_pools(c: &Cluster, prefill: usize, decode: usize, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let ws = c.workers().await;
        let n = |role: &str| ws.iter().filter(|w| w["role"] == role).count();
        if n("prefill") == prefill && n("decode") == decode {
            return;
        }
        assert!(Instant::now() < deadline, "pools never became {prefill}P{decode}D: {ws:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn wait_exit(p: &mut Proc, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = p.exited() {
            return s;
        }
        assert!(Instant::now() < deadline, "{} did not exit:\n{}", p.http, p.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes a fresh random cluster secret (as `base64 > FILE` would: text and a newline) into
/// `dir` and returns its path.
pub fn secret_file(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let bytes: [u8; 24] = rand::random();
    let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, format!("{text}\n")).expect("write the secret");
    path
}

/// Writes a CA and one certificate for `localhost`/`127.0.0.1` signed by it (for server and
/// client use) into `dir`; returns the `--tls-cert/--tls-key/--tls-ca` flags.
pub fn tls_flags(dir: &Path) -> Vec<String> {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    ca.distinguished_name.push(rcgen::DnType::CommonName, "baton test CA");
    let ca_cert = ca.self_signed(&ca_key).expect("CA cert");
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("params");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &Issuer::new(ca, &ca_key)).expect("cert");
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("write PEM");
        p.display().to_string()
    };
    vec![
        "--tls-cert".into(),
        write("node.pem", cert.pem()),
        "--tls-key".into(),
        write("node.key", key.serialize_pem()),
        "--tls-ca".into(),
        write("ca.pem", ca_cert.pem()),
    ]
}
