//! Real `baton router` and `baton worker` processes on loopback serving a tiny random model,
//! with helpers to read their `/metrics`, their RSS and open descriptors, to stop and
//! continue them (SIGSTOP/SIGCONT), and to kill and restart a worker.
//!
//! Shared by the end-to-end tests (through `common`) and the soak program
//! (`server/examples/soak.rs` includes this file), so it names the `baton` executable it runs
//! instead of reading the test-only `CARGO_BIN_EXE_baton`.

use baton_formats::testing::{TinySpec, write_hf_folder};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Long enough for a debug build to load a tiny model on a busy 2-core machine.
pub const STARTUP: Duration = Duration::from_secs(120);
/// The served model name (the `model_name` label of every metric).
pub const MODEL: &str = "tiny";
/// Output tokens of [`completion`].
pub const MAX_TOKENS: usize = 24;

#[path = "port.rs"]
mod port;
pub use port::free_port;

/// The repository's `configs/`.
pub fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

/// `series{model_name="tiny"}`.
pub fn series(name: &str) -> String {
    format!("{name}{{model_name=\"{MODEL}\"}}")
}

/// The value of `series` (name with labels) in Prometheus text.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A `baton` child process, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
    /// Its HTTP base URL.
    pub http: String,
    /// How it was started (to restart it).
    args: Vec<String>,
    dir: PathBuf,
    tag: String,
    port: u16,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too; a test that stopped one may have failed first.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Runs the `baton` at `exe` with `args` plus `--port` (a free one), logging to a file.
    pub fn spawn_exe(exe: &Path, dir: &Path, tag: &str, args: &[String]) -> Proc {
        Self::spawn_on(exe, dir, tag, args, free_port())
    }

    fn spawn_on(exe: &Path, dir: &Path, tag: &str, args: &[String], port: u16) -> Proc {
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let start = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("{tag}-{port}-{start}.log"));
        let child = Command::new(exe)
            .args(args)
            .args(["--port".to_owned(), port.to_string()])
            .current_dir(dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn baton");
        Proc {
            child,
            log,
            http: format!("http://127.0.0.1:{port}"),
            args: args.to_vec(),
            dir: dir.to_owned(),
            tag: tag.to_owned(),
            port,
        }
    }

    /// Kills the process and starts it again with the same arguments and HTTP port.
    pub fn restart(&mut self, exe: &Path) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let fresh = Self::spawn_on(exe, &self.dir, &self.tag, &self.args, self.port);
        *self = fresh;
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `SIG<name>` (e.g. `STOP`, `CONT`).
    pub fn signal(&self, name: &str) -> std::io::Result<()> {
        let status = Command::new("kill").arg(format!("-{name}")).arg(self.pid().to_string()).status()?;
        if status.success() { Ok(()) } else { Err(std::io::Error::other(format!("kill -{name} failed"))) }
    }

    /// Resident memory in KiB (`VmRSS` of /proc/<pid>/status).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Open file descriptors, and how many of them are sockets.
    pub fn fds(&self) -> (usize, usize) {
        let Ok(entries) = std::fs::read_dir(format!("/proc/{}/fd", self.pid())) else { return (0, 0) };
        let mut all = 0;
        let mut sockets = 0;
        for e in entries.flatten() {
            all += 1;
            if std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:")) {
                sockets += 1;
            }
        }
        (all, sockets)
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

    /// The process's `/metrics` text.
    pub async fn metrics_text(&self, http: &reqwest::Client) -> String {
        let r = http.get(format!("{}/metrics", self.http)).timeout(Duration::from_secs(10)).send().await;
        r.expect("metrics").text().await.expect("metrics text")
    }

    /// One sample of its `/metrics`; panics when missing.
    pub async fn metric(&self, http: &reqwest::Client, series: &str) -> f64 {
        let text = self.metrics_text(http).await;
        metric_value(&text, series).unwrap_or_else(|| panic!("{series} missing in:\n{text}"))
    }

    /// KV blocks used, requests running and waiting on a worker.
    pub async fn load(&self, http: &reqwest::Client) -> (f64, f64, f64) {
        let text = self.metrics_text(http).await;
        let get = |name: &str| metric_value(&text, &series(name)).unwrap_or(f64::NAN);
        (get("baton_kv_blocks_used"), get("vllm:num_requests_running"), get("vllm:num_requests_waiting"))
    }

    /// Waits until the worker holds no KV blocks and runs nothing (the no-leak check).
    pub async fn assert_idle(&self, http: &reqwest::Client) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (used, running, waiting) = self.load(http).await;
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

/// The context every process of a test serves: 512 tokens, or the model's own context where
/// its `config.json` says it is shorter (a tiny fixture such as Phi-4-mini's 144).
pub fn max_model_len(model: &Path) -> String {
    let own = std::fs::read(model.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|c| c.get("max_position_embeddings").and_then(|v| v.as_u64()));
    own.map_or(512, |n| n.min(512)).to_string()
}

/// The flags of a tiny CPU model every process of a test shares.
pub fn model_args(model: &Path) -> Vec<String> {
    let context = max_model_len(model);
    [
        "--model",
        model.to_str().expect("utf8"),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        &context,
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

/// `flags` with `--name value` added unless `flags` sets `--name` itself.
fn with_default(flags: &mut Vec<String>, given: &[&str], name: &str, value: &str) {
    if !given.contains(&name) {
        flags.extend([name.to_owned(), value.to_owned()]);
    }
}

/// A router and its workers.
pub struct Cluster {
    pub router: Proc,
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
    pub http: reqwest::Client,
    /// The router's registry URL (`http://127.0.0.1:PORT`).
    pub registry: String,
    exe: PathBuf,
}

impl Cluster {
    /// Starts a router from `config` (ports overridden; the tiny model, 200 ms heartbeats,
    /// ejection after 1.5 s, a 5 s KV deadline and a 20 s idle timeout unless `router_flags`
    /// set them) plus one worker per entry of `extra_p`/`extra_d`, each with those extra flags
    /// (fault injection, security; they replace the shared model flags of the same name).
    pub async fn start_exe(
        exe: &Path,
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
        let context = max_model_len(model);
        for (flag, value) in [
            ("--model", model.to_str().expect("utf8")),
            ("--served-model-name", MODEL),
            ("--max-model-len", &context),
            ("--grpc-port", "0"),
            ("--heartbeat-interval-ms", "200"),
            ("--eject-after-ms", "1500"),
            ("--kv-deadline-ms", "5000"),
            ("--idle-timeout-ms", "20000"),
            ("--min-prefill-workers", &np),
            ("--min-decode-workers", &nd),
        ] {
            with_default(&mut router_args, router_flags, flag, value);
        }
        router_args.extend(["--registry-port".into(), registry.to_string()]);
        router_args.extend(router_flags.iter().map(|s| s.to_string()));
        let router = Proc::spawn_exe(exe, dir, "router", &router_args);
        let worker = |role: &str, i: usize, extra: &[&str]| {
            let mut args: Vec<String> =
                vec!["worker".into(), "--config".into(), config.display().to_string(), "--role".into(), role.into()];
            // The shared model flags, except those `extra` sets itself.
            let shared = model_args(model);
            for pair in shared.chunks(2) {
                if !extra.contains(&pair[0].as_str()) {
                    args.extend(pair.iter().cloned());
                }
            }
            args.extend(["--router".into(), format!("http://127.0.0.1:{registry}")]);
            args.extend(extra.iter().map(|s| s.to_string()));
            Proc::spawn_exe(exe, dir, &format!("{role}{i}"), &args)
        };
        let registry = format!("http://127.0.0.1:{registry}");
        let mut c = Cluster { router, prefill: Vec::new(), decode: Vec::new(), http, registry, exe: exe.to_owned() };
        // Decode workers first, in order, so registry ids (and tie-breaks) follow this order.
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

    /// The `baton` executable the cluster runs.
    pub fn exe(&self) -> &Path {
        &self.exe
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

    /// The router's `baton_router_inflight` gauge.
    pub async fn router_inflight(&self) -> f64 {
        self.router.metric(&self.http, &series("baton_router_inflight")).await
    }

    /// Waits until the router has nothing in flight, and neither has it toward any worker.
    pub async fn assert_router_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let inflight = self.router_inflight().await;
            let ws = self.workers().await;
            if inflight == 0.0 && ws.iter().all(|w| w["inflight"] == 0) {
                return;
            }
            assert!(Instant::now() < deadline, "router: {inflight} in flight; workers {ws:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
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

/// Prompts of lengths around the block size (16), deterministic contents.
pub fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    [3usize, 15, 16, 17, 40, 90]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| ((i * 7919 + j * 104_729 + 11) as u32) % vocab).collect())
        .collect()
}

/// A greedy completions body of [`MAX_TOKENS`] tokens with logprobs.
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

/// The tiny random model in `dir`, and its vocabulary size.
pub fn tiny(dir: &Path) -> (PathBuf, u32) {
    model_of(dir, &TinySpec::llama())
}

/// A random model of `spec` in `dir`, and its vocabulary size.
pub fn model_of(dir: &Path, spec: &TinySpec) -> (PathBuf, u32) {
    let path = write_hf_folder(&dir.join("model"), spec).expect("random model");
    (path, spec.vocab_size as u32)
}
