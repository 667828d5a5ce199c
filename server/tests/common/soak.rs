//! The soak: a 2P2D CPU cluster under a steady random load (streaming and not, `n` up to 3,
//! stop strings, clients that hang up mid-request) while workers are killed and restarted,
//! sampled every interval with the load paused. A sample is taken once the cluster is idle
//! again and records, per process: KV blocks in use, work in flight, tasks alive on its
//! runtime, RSS, open file descriptors and sockets.
//!
//! It fails when the cluster does not come back to idle (blocks or work left behind), when
//! requests fail outside the windows around a kill, or when a resource grows: the last sample
//! against the first (taken after a warm-up interval, so lazily grown pools and caches are in
//! the baseline), with small fixed slack for noise.
//!
//! Shared by the 3-minute CI test (`server/tests/soak.rs`) and the 30-minute program
//! (`server/examples/soak.rs`); both include this file next to `cluster.rs`.

use crate::cluster::{Cluster, Proc, metric_value, series, tiny};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// The `baton` executable.
    pub exe: PathBuf,
    /// Load time, from the first request to the last sample.
    pub duration: Duration,
    /// Time between samples.
    pub sample_every: Duration,
    /// Client loops sending requests back to back.
    pub clients: usize,
    /// Time between worker kills (each killed worker is restarted a few seconds later); the
    /// first kill comes half an interval after the first sample.
    pub kill_every: Duration,
    /// Seed of the load's randomness.
    pub seed: u64,
}

/// Slack allowed between the first and the last sample.
const TASK_SLACK: f64 = 16.0;
const FD_SLACK: f64 = 16.0;
const RSS_SLACK_KIB: f64 = 16.0 * 1024.0;
/// Requests may fail this long after a kill (in-flight work of the killed worker).
const KILL_WINDOW: Duration = Duration::from_secs(15);
/// The longest the cluster may take to become idle when the load pauses.
const QUIESCE: Duration = Duration::from_secs(20);

/// A small deterministic generator (xorshift64*), enough for a load mix.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}

/// Outcome counters of the load.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    disconnected: AtomicU64,
    refused: AtomicU64,
    failed_in_window: AtomicU64,
    /// Failures outside a kill window: each one fails the soak.
    failures: Mutex<Vec<String>>,
}

/// Pauses the clients between requests.
struct Gate {
    paused: AtomicBool,
    stop: AtomicBool,
    active: AtomicUsize,
    /// When the latest kill happened (failures shortly after are expected).
    last_kill: Mutex<Option<Instant>>,
}

impl Gate {
    fn in_kill_window(&self) -> bool {
        self.last_kill.lock().ok().and_then(|k| *k).is_some_and(|k| k.elapsed() < KILL_WINDOW)
    }
}

async fn one_request(http: &reqwest::Client, url: &str, vocab: u32, rng: &mut Rng) -> Result<&'static str, String> {
    let len = 5 + rng.below(120) as usize;
    let prompt: Vec<u32> = (0..len).map(|_| rng.below(u64::from(vocab)) as u32).collect();
    let stream = rng.below(2) == 0;
    let n = [1, 1, 1, 2, 3][rng.below(5) as usize];
    let mut body = json!({"model": crate::cluster::MODEL, "prompt": prompt, "n": n,
        "max_tokens": 8 + rng.below(40), "temperature": 0.8, "seed": rng.below(1000), "stream": stream});
    if rng.below(3) == 0 {
        body["stop"] = json!(["e", "a b"]);
    }
    let hang_up = rng.below(5) == 0;
    let mut req = http.post(format!("{url}/v1/completions")).json(&body);
    if hang_up && !stream {
        req = req.timeout(Duration::from_millis(20 + rng.below(200)));
    }
    let mut r = match req.send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Ok("disconnected"),
        Err(e) => return Err(format!("send: {e}")),
    };
    let status = r.status().as_u16();
    if status == 429 || status == 503 {
        return Ok("refused");
    }
    if status != 200 {
        return Err(format!("status {status}: {}", r.text().await.unwrap_or_default()));
    }
    let keep = 1 + rng.below(3);
    let mut chunks = 0;
    let mut text = String::new();
    loop {
        match r.chunk().await {
            Ok(Some(c)) => {
                text.push_str(&String::from_utf8_lossy(&c));
                chunks += 1;
                if hang_up && stream && chunks >= keep {
                    return Ok("disconnected");
                }
            }
            Ok(None) => break,
            Err(e) if e.is_timeout() => return Ok("disconnected"),
            Err(e) => return Err(format!("body: {e}")),
        }
    }
    if text.contains("\"error\"") {
        return Err(format!("error in the body: {text}"));
    }
    if stream && !text.trim_end().ends_with("data: [DONE]") {
        return Err(format!("a stream without [DONE]: {text}"));
    }
    Ok("ok")
}

async fn client_loop(id: usize, url: String, vocab: u32, seed: u64, gate: Arc<Gate>, tally: Arc<Tally>) {
    let http = reqwest::Client::new();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(id as u64 + 1) | 1);
    while !gate.stop.load(Ordering::SeqCst) {
        if gate.paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        gate.active.fetch_add(1, Ordering::SeqCst);
        let outcome = one_request(&http, &url, vocab, &mut rng).await;
        gate.active.fetch_sub(1, Ordering::SeqCst);
        match outcome {
            Ok("ok") => tally.ok.fetch_add(1, Ordering::Relaxed),
            Ok("refused") => tally.refused.fetch_add(1, Ordering::Relaxed),
            Ok(_) => tally.disconnected.fetch_add(1, Ordering::Relaxed),
            Err(_) if gate.in_kill_window() => tally.failed_in_window.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                if let Ok(mut f) = tally.failures.lock() {
                    f.push(format!("client {id}: {e}"));
                }
                0
            }
        };
    }
}

/// One process's figures in a sample.
async fn process_sample(name: &str, p: &Proc, http: &reqwest::Client) -> Value {
    let text = match http.get(format!("{}/metrics", p.http)).timeout(Duration::from_secs(10)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    let get = |m: &str| metric_value(&text, &series(m));
    let (fds, sockets) = p.fds();
    // The router holds no blocks: its figure is the sum of the workers' last heartbeats.
    let blocks = if name == "router" { None } else { get("baton_kv_blocks_used") };
    json!({
        "name": name,
        "pid": p.pid(),
        "kv_blocks_used": blocks,
        "inflight": get("baton_router_inflight"),
        "tasks": get("baton_runtime_alive_tasks"),
        "rss_kib": p.rss_kib(),
        "fds": fds,
        "sockets": sockets,
    })
}

/// Waits for the cluster to be idle; the reasons it is not, if it never gets there.
async fn quiesce(c: &Cluster) -> Vec<String> {
    let deadline = Instant::now() + QUIESCE;
    loop {
        let mut busy = Vec::new();
        for (i, w) in c.all_workers().enumerate() {
            let (used, running, waiting) = w.load(&c.http).await;
            if used != 0.0 || running != 0.0 || waiting != 0.0 {
                busy.push(format!("worker {i} ({}): {used} blocks, {running} running, {waiting} waiting", w.http));
            }
        }
        let text = c.router.metrics_text(&c.http).await;
        let inflight = metric_value(&text, &series("baton_router_inflight")).unwrap_or(f64::NAN);
        if inflight != 0.0 {
            busy.push(format!("router: {inflight} sequences in flight"));
        }
        if let Ok(r) = c.http.get(format!("{}/workers", c.router.http)).send().await
            && let Ok(ws) = r.json::<Vec<Value>>().await
            && let Some(w) = ws.iter().find(|w| w["inflight"] != 0)
        {
            busy.push(format!("router → worker {}: {} in flight", w["url"], w["inflight"]));
        }
        if busy.is_empty() || Instant::now() >= deadline {
            return busy;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The soak's result.
pub struct Report {
    /// Samples, outcome counts, growth and verdict (what the program writes out).
    pub json: Value,
    /// Why it failed; empty when it passed.
    pub failures: Vec<String>,
}

/// Compares the last sample with the first, process by process.
fn growth(first: &Value, last: &Value, failures: &mut Vec<String>) -> Value {
    let mut out = Vec::new();
    let procs = |s: &Value| s["processes"].as_array().cloned().unwrap_or_default();
    let (a, b) = (procs(first), procs(last));
    for (p0, p1) in a.iter().zip(b.iter().chain(std::iter::repeat(&Value::Null))) {
        let name = p0["name"].as_str().unwrap_or("?").to_owned();
        let restarted = p0["pid"] != p1["pid"];
        let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
        let d = |k: &str| num(p1, k) - num(p0, k);
        let rss_limit = RSS_SLACK_KIB.max(num(p0, "rss_kib") * 0.25);
        // A restarted process started over; its figures are not a trend.
        if !restarted {
            if d("tasks") > TASK_SLACK {
                failures.push(format!("{name}: tasks grew by {}", d("tasks")));
            }
            if d("fds") > FD_SLACK {
                failures.push(format!("{name}: file descriptors grew by {}", d("fds")));
            }
            if d("rss_kib") > rss_limit {
                failures.push(format!("{name}: RSS grew by {} KiB", d("rss_kib")));
            }
        }
        out.push(json!({"name": name, "restarted": restarted, "tasks": d("tasks"), "fds": d("fds"),
            "sockets": d("sockets"), "rss_kib": d("rss_kib")}));
    }
    Value::Array(out)
}

/// Runs the soak.
pub async fn run(cfg: &SoakConfig) -> Report {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let none: Vec<Vec<&str>> = vec![vec![], vec![]];
    let mut c = Cluster::start_exe(&cfg.exe, dir.path(), &model, "2p2d.toml", &[], &none, &none).await;
    let gate = Arc::new(Gate {
        paused: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        active: AtomicUsize::new(0),
        last_kill: Mutex::new(None),
    });
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..cfg.clients)
        .map(|i| tokio::spawn(client_loop(i, c.router.http.clone(), vocab, cfg.seed, gate.clone(), tally.clone())))
        .collect();
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut failures = Vec::new();
    let mut next_sample = cfg.sample_every;
    let mut next_kill = cfg.sample_every + cfg.kill_every / 2;
    let mut kills = 0usize;
    let mut restart_at: Option<(Instant, bool, usize)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = started.elapsed();
        if let Some((at, prefill, i)) = restart_at
            && Instant::now() >= at
        {
            let exe = cfg.exe.clone();
            let w = if prefill { &mut c.prefill[i] } else { &mut c.decode[i] };
            w.restart(&exe);
            w.wait_healthy(&c.http).await;
            restart_at = None;
        }
        if restart_at.is_none() && now >= next_kill && now + Duration::from_secs(10) < cfg.duration {
            // Alternate: a prefill worker, then a decode worker, each slot in turn.
            let prefill = kills.is_multiple_of(2);
            let i = (kills / 2) % 2;
            let w = if prefill { &mut c.prefill[i] } else { &mut c.decode[i] };
            if let Ok(mut k) = gate.last_kill.lock() {
                *k = Some(Instant::now());
            }
            let _ = w.child.kill();
            let _ = w.child.wait();
            kills += 1;
            restart_at = Some((Instant::now() + Duration::from_secs(3), prefill, i));
            next_kill += cfg.kill_every;
        }
        if now < next_sample || restart_at.is_some() {
            continue;
        }
        // Pause, let the cluster drain, sample, go on.
        gate.paused.store(true, Ordering::SeqCst);
        let drained = Instant::now() + QUIESCE;
        while gate.active.load(Ordering::SeqCst) > 0 && Instant::now() < drained {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Every worker is back in the pools before the sample.
        let pools = Instant::now() + QUIESCE;
        loop {
            let ws = c.workers().await;
            if ws.len() == 4 || Instant::now() >= pools {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let busy = quiesce(&c).await;
        let minute = now.as_secs_f64() / 60.0;
        for b in &busy {
            failures.push(format!("not idle at {minute:.1} min: {b}"));
        }
        let mut processes = vec![process_sample("router", &c.router, &c.http).await];
        for (i, w) in c.prefill.iter().enumerate() {
            processes.push(process_sample(&format!("prefill{i}"), w, &c.http).await);
        }
        for (i, w) in c.decode.iter().enumerate() {
            processes.push(process_sample(&format!("decode{i}"), w, &c.http).await);
        }
        for p in &processes {
            if p["kv_blocks_used"].as_f64().is_some_and(|b| b != 0.0) {
                failures.push(format!("{} holds {} KV blocks while idle", p["name"], p["kv_blocks_used"]));
            }
        }
        samples.push(json!({
            "minute": minute,
            "idle": busy.is_empty(),
            "workers_registered": c.workers().await.len(),
            "requests": {
                "ok": tally.ok.load(Ordering::Relaxed),
                "disconnected": tally.disconnected.load(Ordering::Relaxed),
                "refused": tally.refused.load(Ordering::Relaxed),
                "failed_near_a_kill": tally.failed_in_window.load(Ordering::Relaxed),
            },
            "processes": processes,
        }));
        gate.paused.store(false, Ordering::SeqCst);
        next_sample += cfg.sample_every;
        if now >= cfg.duration {
            break;
        }
    }
    gate.stop.store(true, Ordering::SeqCst);
    for t in clients {
        let _ = t.await;
    }
    if let Ok(f) = tally.failures.lock() {
        failures.extend(f.iter().take(20).cloned());
        if f.len() > 20 {
            failures.push(format!("... and {} more failed requests", f.len() - 20));
        }
    }
    if tally.ok.load(Ordering::Relaxed) == 0 {
        failures.push("no request succeeded".into());
    }
    let growth = match (samples.first(), samples.last()) {
        (Some(a), Some(b)) if samples.len() > 1 => growth(a, b, &mut failures),
        _ => {
            failures.push(format!("only {} sample(s): the soak must span two intervals", samples.len()));
            Value::Null
        }
    };
    let json = json!({
        "duration_s": cfg.duration.as_secs_f64(),
        "sample_every_s": cfg.sample_every.as_secs_f64(),
        "clients": cfg.clients,
        "kills": kills,
        "samples": samples,
        "growth_first_to_last": growth,
        "passed": failures.is_empty(),
        "failures": failures,
    });
    if !failures.is_empty() {
        eprintln!("router log:\n{}", c.router.log_text());
    }
    Report { json, failures }
}
