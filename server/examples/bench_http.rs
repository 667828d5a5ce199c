//! The HTTP/SSE host path on the CPU, with no GPU (a benchmark program, not a test).
//!
//! A [`SyntheticEngine`] produces tokens as a fast GPU would: every step gives each of up to
//! `--max-num-seqs` running requests one token, one step every `--step-ms` (512 × 1 / 3 ms ≈
//! 170k tok/s), with token ids from the served model's own vocabulary (this repository's
//! README tokenized with the model's tokenizer), so detokenization costs what it costs.
//!
//! 1. **Offline**: every prompt submitted at once to the engine and drained directly (what
//!    `engine/examples/bench_throughput.rs` measures on the GPU): the engine's tok/s.
//! 2. **Served**: the same engine behind the real `Frontend` + axum app on loopback, driven at
//!    `--concurrency` streams by an in-process client (`--client lean`: counts SSE events and
//!    reads the usage chunk, so the client costs little) or by `baton-loadtest`'s library
//!    (`--client loadtest`: parses every event, as the real load generator does). Delivered
//!    tok/s is output tokens ÷ wall time of the timed run.
//!
//! The ratio delivered/offline is the figure of merit (target ≥ 0.9 at 512 streams). The
//! program also reports the CPU time each part spent per delivered token (server runtime
//! threads, client threads, engine thread, from `/proc/self/task/*/schedstat`), which does
//! not depend on how many cores the machine has. Results go to `--out` (default
//! `bench/results/http-path-<label>-cpu<N>c-<date>.json`).
//!
//! Usage: `bench_http [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--step-ms 3]
//! [--max-num-seqs 512] [--prompts 2000] [--isl 128] [--osl 256] [--concurrency 512]
//! [--client lean|loadtest|both] [--server-threads N] [--client-threads N] [--endpoint
//! completions|chat] [--label L] [--out PATH] [--commit C] [--trace FILE]`.

use axum::serve::ListenerExt;
use baton_core::api::{EngineClient, EngineInfo, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::synthetic::{SyntheticConfig, SyntheticCounters, SyntheticEngine};
use baton_formats::{LoadFormat, ModelInfo, load_model_info};
use baton_metrics::Metrics;
use baton_router::{Frontend, HttpConfig, ServedModel, TextCodec, http_router};
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Text the engine's output tokens come from.
const CORPUS: &str = include_str!("../../README.md");
/// Thread-name prefixes of the parts whose CPU time is reported.
const SERVER_THREADS: &str = "bench-server";
const CLIENT_THREADS: &str = "bench-client";
const ENGINE_THREAD: &str = "synthetic-engi";

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_http: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Res<T>
where
    T::Err: std::error::Error + 'static,
{
    match flag(args, name) {
        Some(v) => Ok(v.parse()?),
        None => Ok(default),
    }
}

struct Shape {
    step: Duration,
    max_num_seqs: usize,
    prompts: usize,
    isl: usize,
    osl: usize,
    concurrency: usize,
    chat: bool,
    /// `--trace FILE` (lean client): a line per request, `start_s ttft_s e2e_s` from the timed
    /// run's start, and the server's latency sums printed at the end (where a run loses time).
    trace: Option<PathBuf>,
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let model =
        PathBuf::from(flag(&args, "--model").unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into()));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let shape = Shape {
        step: Duration::from_secs_f64(num(&args, "--step-ms", 3.0)? / 1000.0),
        max_num_seqs: num(&args, "--max-num-seqs", 512)?,
        prompts: num(&args, "--prompts", 2000)?,
        isl: num(&args, "--isl", 128)?,
        osl: num(&args, "--osl", 256)?,
        concurrency: num(&args, "--concurrency", 512)?,
        chat: match flag(&args, "--endpoint").as_deref().unwrap_or("completions") {
            "completions" => false,
            "chat" => true,
            other => return Err(format!("--endpoint takes completions or chat, not {other}").into()),
        },
        trace: flag(&args, "--trace").map(PathBuf::from),
    };
    let clients: Vec<&str> = match flag(&args, "--client").as_deref().unwrap_or("lean") {
        "lean" => vec!["lean"],
        "loadtest" => vec!["loadtest"],
        "both" => vec!["lean", "loadtest"],
        other => return Err(format!("--client takes lean, loadtest or both, not {other}").into()),
    };
    let server_threads: usize = num(&args, "--server-threads", cores)?;
    let client_threads: usize = num(&args, "--client-threads", cores)?;
    let label = flag(&args, "--label").unwrap_or_else(|| "run".into());
    let commit = flag(&args, "--commit").unwrap_or_else(git_commit);
    let out = flag(&args, "--out")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("bench/results/http-path-{label}-cpu{cores}c-{}.json", today())));

    let info = load_model_info(&model, LoadFormat::Auto)?;
    let tokenizer = info.tokenizer.clone().ok_or("the model has no tokenizer")?;
    let pool: Arc<[u32]> = tokenizer.encode(CORPUS, false)?.into();
    let engine_info = EngineInfo {
        max_model_len: shape.isl + shape.osl + 64,
        vocab_size: tokenizer.vocab_size(),
        block_size: 16,
        num_blocks: 1 << 20,
        eos_token_ids: info.generation.eos_token_ids.clone(),
        device: "synthetic".into(),
    };
    let engine_config = SyntheticConfig {
        step_time: shape.step,
        max_num_seqs: shape.max_num_seqs,
        tokens: pool.clone(),
        info: engine_info,
    };
    eprintln!(
        "bench_http: {} pool tokens, step {:?} × {} seqs (nominal {:.0} tok/s), {} prompts {}→{}, concurrency {}, {} cores",
        pool.len(),
        shape.step,
        shape.max_num_seqs,
        shape.max_num_seqs as f64 / shape.step.as_secs_f64(),
        shape.prompts,
        shape.isl,
        shape.osl,
        shape.concurrency,
        cores
    );

    let offline = offline(&engine_config, &shape)?;
    eprintln!("offline: {:.0} tok/s", offline["tok_s"].as_f64().unwrap_or(0.0));
    let mut served = Vec::new();
    for client in clients {
        let setup = Setup { engine: &engine_config, model: &info, server_threads, client_threads };
        let r = serve_and_drive(&setup, &shape, client)?;
        let tok_s = r["tok_s"].as_f64().unwrap_or(0.0);
        let ratio = tok_s / offline["tok_s"].as_f64().unwrap_or(f64::NAN);
        eprintln!(
            "served ({client}): {tok_s:.0} tok/s = {ratio:.3}× offline; server {:.2} µs/token, client {:.2}, engine {:.2}; mean batch {:.0}",
            r["cpu_us_per_token"]["server"].as_f64().unwrap_or(0.0),
            r["cpu_us_per_token"]["client"].as_f64().unwrap_or(0.0),
            r["cpu_us_per_token"]["engine"].as_f64().unwrap_or(0.0),
            r["engine"]["mean_batch"].as_f64().unwrap_or(0.0),
        );
        eprintln!("  ttft ms {}  e2e ms {}", r["ttft_ms"], r["e2e_ms"]);
        let mut r = r;
        r["ratio_to_offline"] = json!(ratio);
        served.push(r);
    }

    let result = json!({
        "name": "http-path",
        "label": label,
        "device": format!("cpu ({cores} cores), synthetic engine"),
        "commit": commit,
        "date": today(),
        "command": args.join(" "),
        "shape": {
            "step_ms": shape.step.as_secs_f64() * 1000.0,
            "max_num_seqs": shape.max_num_seqs,
            "nominal_tok_s": shape.max_num_seqs as f64 / shape.step.as_secs_f64(),
            "prompts": shape.prompts,
            "isl": shape.isl,
            "osl": shape.osl,
            "concurrency": shape.concurrency,
            "endpoint": if shape.chat { "chat" } else { "completions" },
            "server_threads": server_threads,
            "client_threads": client_threads,
            "token_pool": format!("README.md tokenized by {} ({} tokens)", model.display(), pool.len()),
        },
        "offline": offline,
        "served": served,
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&result)? + "\n")?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Today's UTC date as `YYYY-MM-DD` (civil-from-days, H. Hinnant).
fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn counters_json(before: SyntheticCounters, after: SyntheticCounters, elapsed: f64) -> Value {
    let steps = after.steps - before.steps;
    let tokens = after.tokens - before.tokens;
    json!({
        "steps": steps,
        "tokens": tokens,
        "tok_s": tokens as f64 / elapsed,
        "mean_batch": (after.batch_sum - before.batch_sum) as f64 / steps.max(1) as f64,
        "late_steps": after.late_steps - before.late_steps,
    })
}

/// Every prompt at once, drained directly: the engine's own rate.
fn offline(config: &SyntheticConfig, shape: &Shape) -> Res<Value> {
    let engine = SyntheticEngine::start(config.clone())?;
    let params = SamplingParams { max_tokens: Some(shape.osl), ignore_eos: true, ..SamplingParams::default() };
    let prompt: Vec<u32> = config.tokens.iter().copied().cycle().take(shape.isl).collect();
    let t0 = Instant::now();
    let before = engine.counters();
    let streams = (0..shape.prompts)
        .map(|_| engine.submit(EngineRequest::new(prompt.clone(), params.clone())))
        .collect::<Result<Vec<_>, _>>()?;
    let mut tokens = 0usize;
    for mut s in streams {
        while let Some(out) = s.blocking_next() {
            tokens += out?.new_token_ids.len();
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let counters = counters_json(before, engine.counters(), elapsed);
    engine.shutdown();
    Ok(json!({ "output_tokens": tokens, "elapsed_s": elapsed, "tok_s": tokens as f64 / elapsed, "engine": counters }))
}

/// CPU nanoseconds per thread-name prefix, from `/proc/self/task/*/{comm,schedstat}`.
fn cpu_by_thread() -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return by };
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim().to_owned();
        let ns: u64 = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
            .unwrap_or(0);
        let group = [SERVER_THREADS, CLIENT_THREADS, ENGINE_THREAD]
            .into_iter()
            .find(|p| comm.starts_with(p))
            .unwrap_or("other");
        *by.entry(group.to_owned()).or_insert(0) += ns;
    }
    by
}

fn runtime(name: &str, threads: usize) -> Res<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()?)
}

/// What a served run needs besides the workload shape.
struct Setup<'a> {
    engine: &'a SyntheticConfig,
    model: &'a ModelInfo,
    server_threads: usize,
    client_threads: usize,
}

fn serve_and_drive(setup: &Setup<'_>, shape: &Shape, client: &str) -> Res<Value> {
    let Setup { engine: engine_config, model: info, server_threads, client_threads } = *setup;
    let pool = &engine_config.tokens;
    let engine = SyntheticEngine::start(engine_config.clone())?;
    let tokenizer = info.tokenizer.clone().ok_or("the model has no tokenizer")?;
    let metrics = Arc::new(Metrics::new("bench")?);
    let frontend = Frontend::new(
        Arc::new(engine.clone()),
        Arc::new(TextCodec::new(tokenizer.clone(), info.chat_template.clone())),
        ServedModel { name: "bench".into(), root: "bench".into() },
        metrics,
    );
    let server = runtime(SERVER_THREADS, server_threads)?;
    let listener = server.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let app = http_router(frontend, HttpConfig::default());
    // As `baton serve` does (server/src/listeners.rs): streamed tokens are small writes.
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    server.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let base = format!("http://{addr}");
    let client_rt = runtime(CLIENT_THREADS, client_threads)?;
    // Prompt texts of about `isl` tokens, each from its own place in the pool.
    let prompts: Vec<String> = (0..shape.prompts)
        .map(|i| {
            let start = i.wrapping_mul(7919) % pool.len();
            let ids: Vec<u32> = pool.iter().copied().cycle().skip(start).take(shape.isl).collect();
            tokenizer.decode(&ids, true).unwrap_or_default()
        })
        .collect();
    let result = match client {
        "loadtest" => client_rt.block_on(drive_loadtest(&base, shape, &engine)),
        _ => client_rt.block_on(drive_lean(&base, shape, prompts, &engine)),
    }?;
    engine.shutdown();
    drop(client_rt);
    server.shutdown_timeout(Duration::from_secs(1));
    Ok(result)
}

struct Timed {
    completed: usize,
    failed: usize,
    output_tokens: u64,
    elapsed: f64,
    first_error: Option<String>,
    cpu_before: BTreeMap<String, u64>,
    cpu_after: BTreeMap<String, u64>,
    counters_before: SyntheticCounters,
    counters_after: SyntheticCounters,
}

fn timed_json(client: &str, t: Timed) -> Value {
    let per_token = |group: &str| {
        let ns =
            t.cpu_after.get(group).copied().unwrap_or(0).saturating_sub(t.cpu_before.get(group).copied().unwrap_or(0));
        ns as f64 / 1000.0 / t.output_tokens.max(1) as f64
    };
    let busy = |group: &str| {
        let ns =
            t.cpu_after.get(group).copied().unwrap_or(0).saturating_sub(t.cpu_before.get(group).copied().unwrap_or(0));
        ns as f64 / 1e9 / t.elapsed
    };
    json!({
        "client": client,
        "completed": t.completed,
        "failed": t.failed,
        "first_error": t.first_error,
        "output_tokens": t.output_tokens,
        "elapsed_s": t.elapsed,
        "tok_s": t.output_tokens as f64 / t.elapsed,
        "cpu_us_per_token": {
            "server": per_token(SERVER_THREADS),
            "client": per_token(CLIENT_THREADS),
            "engine": per_token(ENGINE_THREAD),
            "other": per_token("other"),
        },
        "cores_busy": {
            "server": busy(SERVER_THREADS),
            "client": busy(CLIENT_THREADS),
            "engine": busy(ENGINE_THREAD),
        },
        "engine": counters_json(t.counters_before, t.counters_after, t.elapsed),
    })
}

async fn drive_loadtest(base: &str, shape: &Shape, engine: &SyntheticEngine) -> Res<Value> {
    use baton_loadtest::{BackendKind, DatasetConfig, RunConfig, Target};
    let backend = if shape.chat { BackendKind::OpenaiChat } else { BackendKind::Openai };
    let mut config = RunConfig::new(
        backend,
        base,
        DatasetConfig::Random { input_len: shape.isl, output_len: shape.osl, range_ratio: 0.0 },
    );
    config.num_prompts = shape.prompts;
    config.max_concurrency = Some(shape.concurrency);
    config.request_timeout_s = Some(600.0);
    let target = Target::prepare(&config).await?;
    let cpu_before = cpu_by_thread();
    let counters_before = engine.counters();
    let result = target.execute(&config).await?;
    let cpu_after = cpu_by_thread();
    let counters_after = engine.counters();
    let s = &result.summary;
    let first_error = s.errors.first().map(|e| e.error.clone());
    let mut out = timed_json(
        "loadtest",
        Timed {
            completed: s.completed,
            failed: s.failed,
            output_tokens: s.total_output_tokens,
            elapsed: s.duration_s,
            first_error,
            cpu_before,
            cpu_after,
            counters_before,
            counters_after,
        },
    );
    out["ttft_ms"] = json!({ "mean": s.ttft_ms.mean, "median": s.ttft_ms.median, "p99": s.ttft_ms.p99 });
    out["e2e_ms"] = json!({ "mean": s.e2el_ms.mean, "median": s.e2el_ms.median, "p99": s.e2el_ms.p99 });
    out["itl_ms"] = json!({ "mean": s.itl_ms.mean, "median": s.itl_ms.median, "p99": s.itl_ms.p99 });
    Ok(out)
}

/// One streamed request: its completion tokens from the usage chunk (checking `[DONE]`) and
/// the time to its first body bytes after the role/first chunk.
async fn lean_request(client: &reqwest::Client, url: &str, body: Vec<u8>) -> Result<(u64, Duration), String> {
    let t0 = Instant::now();
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status()));
    }
    let mut bytes = resp.bytes_stream();
    // Only the end of the stream matters: the usage chunk and `[DONE]`.
    let mut tail: Vec<u8> = Vec::new();
    let mut ttft = None;
    while let Some(piece) = bytes.next().await {
        let piece = piece.map_err(|e| e.to_string())?;
        ttft.get_or_insert_with(|| t0.elapsed());
        tail.extend_from_slice(&piece);
        if tail.len() > 4096 {
            tail.drain(..tail.len() - 1024);
        }
    }
    let text = String::from_utf8_lossy(&tail);
    if !text.trim_end().ends_with("data: [DONE]") {
        return Err("stream ended before data: [DONE]".into());
    }
    let usage = text
        .rsplit("data: ")
        .nth(1)
        .and_then(|event| serde_json::from_str::<Value>(event.trim()).ok())
        .and_then(|v| v.get("usage").and_then(|u| u.get("completion_tokens")).and_then(Value::as_u64));
    let tokens = usage.ok_or_else(|| "no usage chunk before [DONE]".to_owned())?;
    Ok((tokens, ttft.unwrap_or_default()))
}

/// Mean, median and p99 of latencies, in milliseconds.
fn latency_json(mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    let pick = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0) * 1000.0;
    json!({ "mean": v.iter().sum::<f64>() / v.len().max(1) as f64 * 1000.0, "median": pick(0.5), "p99": pick(0.99) })
}

async fn drive_lean(base: &str, shape: &Shape, prompts: Vec<String>, engine: &SyntheticEngine) -> Res<Value> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(usize::MAX).build()?;
    let url = format!("{base}{}", if shape.chat { "/v1/chat/completions" } else { "/v1/completions" });
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new(
        prompts
            .iter()
            .map(|p| {
                let mut body = json!({
                    "model": "bench", "stream": true, "stream_options": {"include_usage": true},
                    "temperature": 0.0, "ignore_eos": true, "min_tokens": shape.osl,
                });
                if shape.chat {
                    body["messages"] = json!([{"role": "user", "content": p}]);
                    body["max_completion_tokens"] = json!(shape.osl);
                } else {
                    body["prompt"] = json!(p);
                    body["max_tokens"] = json!(shape.osl);
                }
                serde_json::to_vec(&body)
            })
            .collect::<Result<_, _>>()?,
    );
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_before = cpu_by_thread();
    let counters_before = engine.counters();
    let t0 = Instant::now();
    let workers: Vec<_> = (0..shape.concurrency.min(bodies.len()))
        .map(|_| {
            let (client, url, bodies, next) = (client.clone(), url.clone(), bodies.clone(), next.clone());
            let trace = shape.trace.clone();
            tokio::spawn(async move {
                let mut done = (0usize, 0usize, 0u64, None::<String>, Vec::new(), Vec::new());
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(body) = bodies.get(i) else { break };
                    let started = Instant::now();
                    match lean_request(&client, &url, body.clone()).await {
                        Ok((tokens, ttft)) => {
                            done.0 += 1;
                            done.2 += tokens;
                            done.4.push(ttft.as_secs_f64());
                            done.5.push(started.elapsed().as_secs_f64());
                            if let Some(path) = &trace {
                                use std::io::Write;
                                if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(path) {
                                    let line = format!(
                                        "{} {} {}\n",
                                        (started - t0).as_secs_f64(),
                                        ttft.as_secs_f64(),
                                        started.elapsed().as_secs_f64()
                                    );
                                    let _ = f.write_all(line.as_bytes());
                                }
                            }
                        }
                        Err(e) => {
                            done.1 += 1;
                            done.3.get_or_insert(e);
                        }
                    }
                }
                done
            })
        })
        .collect();
    let (mut completed, mut failed, mut output_tokens, mut first_error) = (0, 0, 0, None);
    let (mut ttfts, mut e2es) = (Vec::new(), Vec::new());
    for w in workers {
        let (c, f, t, e, ttft, e2e) = w.await?;
        completed += c;
        failed += f;
        output_tokens += t;
        first_error = first_error.or(e);
        ttfts.extend(ttft);
        e2es.extend(e2e);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu_after = cpu_by_thread();
    let counters_after = engine.counters();
    if shape.trace.is_some() {
        let text = client.get(format!("{base}/metrics")).send().await?.text().await?;
        for l in text.lines().filter(|l| l.contains("_sum") || l.contains("_count")) {
            eprintln!("  {l}");
        }
    }
    let mut result = timed_json(
        "lean",
        Timed {
            completed,
            failed,
            output_tokens,
            elapsed,
            first_error,
            cpu_before,
            cpu_after,
            counters_before,
            counters_after,
        },
    );
    result["ttft_ms"] = latency_json(ttfts);
    result["e2e_ms"] = latency_json(e2es);
    Ok(result)
}
