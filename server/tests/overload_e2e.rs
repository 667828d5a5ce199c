//! Overload, deadlines and runtime hygiene, end to end: a real router with real CPU workers
//! on loopback (the harness in `common`).
//!
//! - Overload: 100 concurrent requests and one 5,000-prompt × n=128 request against two
//!   workers with `--max-waiting 2` get only 200, 429 or 503 (and the 400 for the giant);
//!   the router's in-flight gauge stays under its cap (and the decode worker's open streams
//!   under its own `--max-inflight`), the router's tasks and RSS come back down, and the
//!   workers end idle.
//! - A slow, queued prefill with a small `--kv-deadline-ms`: the deadline counts from the
//!   start of the prefill, so every prompt is computed exactly once (the workers' computed
//!   prompt-token counters add up to the prompts), the output is `serve`'s, blocks are freed.
//! - A prefill longer than the idle timeout (relayed, and kept on the decode worker) completes:
//!   workers report progress while their engine computes it.
//! - Eight 8 MiB `/tokenize` bodies while a stream runs: token gaps stay under a second and
//!   no worker is ejected (tokenizing runs off the router's runtime).

mod common;

use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Sums a counter over the workers.
async fn total(c: &Cluster, name: &str) -> f64 {
    let mut sum = 0.0;
    for w in c.all_workers() {
        sum += w.metric(&c.http, &series(name)).await;
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_cleanly_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let p_flags = vec!["--max-waiting", "2"];
    let d_flags = vec!["--max-waiting", "2", "--max-inflight", "8"];
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &["--max-inflight", "64"], &[p_flags], &[d_flags]).await;
    // One request first, so the router's connections to the workers are part of the baseline.
    let p: Vec<u32> = (0..20u32).map(|j| (j * 3 + 1) % vocab).collect();
    complete(&c.http, &c.router.http, &p, false).await;
    let tasks_idle = c.router.metric(&c.http, &series("baton_runtime_alive_tasks")).await;
    let rss_idle = c.router.rss_kib();

    // The giant request is refused before any work: prompts × n is over the per-request cap.
    let giant: Vec<Vec<u32>> = (0..5000u32).map(|i| vec![(i * 7 + 3) % vocab, 5, 9]).collect();
    let body = json!({"model": MODEL, "prompt": giant, "n": 128, "max_tokens": 4});
    let r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&body).send().await.expect("send");
    let status = r.status().as_u16();
    let v: Value = r.json().await.expect("json");
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");

    // 100 at once (half of them streaming), from a client of their own whose connections
    // close when it is dropped.
    let load = reqwest::Client::new();
    // Peak in-flight gauges of the router and of the decode worker, sampled throughout.
    let peaks = std::sync::Arc::new([std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0)]);
    let sampler = {
        let (http, peaks) = (c.http.clone(), peaks.clone());
        let urls = [c.router.http.clone(), c.decode[0].http.clone()];
        tokio::spawn(async move {
            loop {
                for (url, peak) in urls.iter().zip(peaks.iter()) {
                    if let Ok(r) = http.get(format!("{url}/metrics")).send().await
                        && let Ok(text) = r.text().await
                        && let Some(v) = metric_value(&text, &series("baton_router_inflight"))
                    {
                        peak.fetch_max(v as u64, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let requests = (0..100u32).map(|i| {
        let (load, url) = (load.clone(), c.router.http.clone());
        let prompt: Vec<u32> = (0..40u32).map(|j| (i * 131 + j * 17 + 1) % vocab).collect();
        let stream = i % 2 == 0;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": true, "stream": stream});
        async move {
            let r = load.post(format!("{url}/v1/completions")).json(&body).send().await.expect("send");
            let status = r.status().as_u16();
            let retry_after = r.headers().get("retry-after").is_some();
            let text = r.text().await.expect("body");
            (status, retry_after, stream, text)
        }
    });
    let results = futures::future::join_all(requests).await;
    sampler.abort();
    drop(load);
    let mut by_status = std::collections::BTreeMap::new();
    for (status, retry_after, stream, text) in &results {
        *by_status.entry(*status).or_insert(0) += 1;
        match status {
            200 if *stream => assert!(!text.contains("\"error\""), "a 200 stream failed: {text}"),
            200 => {}
            429 | 503 => {
                assert!(retry_after, "{status} without Retry-After: {text}");
                let v: Value = serde_json::from_str(text).expect("an OpenAI error object");
                assert!(v["error"]["message"].is_string(), "{v}");
            }
            other => panic!("status {other}: {text}\nrouter log:\n{}", c.router.log_text()),
        }
    }
    assert!(by_status.get(&200).is_some_and(|&n| n > 0), "nothing fit: {by_status:?}");
    assert!(by_status.get(&429).is_some_and(|&n| n > 0), "nothing was refused: {by_status:?}");
    let [router_peak, decode_peak] = [0, 1].map(|i| peaks[i].load(std::sync::atomic::Ordering::SeqCst));
    assert!(router_peak <= 64, "{router_peak} sequences in flight over a cap of 64");
    assert!(decode_peak <= 8, "{decode_peak} streams open on the decode worker over its cap of 8");

    // Nothing is left behind: workers idle, router idle, its tasks and memory back down.
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
    c.assert_router_idle().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let tasks = c.router.metric(&c.http, &series("baton_runtime_alive_tasks")).await;
        if tasks <= tasks_idle + 4.0 {
            break;
        }
        assert!(Instant::now() < deadline, "router tasks {tasks} after the load, {tasks_idle} before");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss = c.router.rss_kib();
    assert!(rss < rss_idle + 64 * 1024, "router RSS grew from {rss_idle} KiB to {rss} KiB");
    // And it still serves.
    complete(&c.http, &c.router.http, &p, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_prefill_is_not_recomputed_by_a_short_kv_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = model_of(dir.path(), &wider());
    // 16 distinct 128-token prompts.
    let ps: Vec<Vec<u32>> =
        (0..16u32).map(|i| (0..128u32).map(|j| (i * 7919 + j * 104_729 + 5) % vocab).collect()).collect();
    let want = reference(dir.path(), &model, &ps).await;
    // The prefill worker takes one prompt at a time, 16 tokens per step: the last prompts wait
    // 15 × 8 steps in its queue, far longer than the 300 ms deadline. The decode worker has
    // blocks for all of them at once.
    let slow_p = vec!["--max-num-seqs", "1", "--max-num-batched-tokens", "16"];
    let roomy_d = vec!["--num-kv-blocks", "512"];
    let flags = ["--kv-deadline-ms", "300"];
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &flags, &[slow_p], &[roomy_d]).await;
    let before = total(&c, "baton_prompt_tokens_computed_total").await;
    let started = Instant::now();
    let runs = ps.iter().map(|p| complete(&c.http, &c.router.http, p, false));
    let got = futures::future::join_all(runs).await;
    let took = started.elapsed();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(g, w, &format!("prompt {i}"));
    }
    // The prompts really queued past the deadline (else this test proves nothing).
    assert!(took > Duration::from_millis(600), "all 16 went through in {took:?}");
    let computed = total(&c, "baton_prompt_tokens_computed_total").await - before;
    let prompts: usize = ps.iter().map(Vec::len).sum();
    assert_eq!(
        computed as usize,
        prompts,
        "prompt tokens computed by the workers vs in the prompts (took {took:?})\nrouter log:\n{}",
        c.router.log_text()
    );
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
    c.assert_router_idle().await;
}

/// Wider than the tiny model, so a prompt takes milliseconds to compute, not microseconds.
fn wider() -> baton_formats::testing::TinySpec {
    baton_formats::testing::TinySpec {
        hidden_size: 256,
        num_layers: 4,
        intermediate_size: 768,
        ..baton_formats::testing::TinySpec::llama()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_longer_than_the_idle_timeout_completes_while_it_progresses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = baton_formats::testing::TinySpec { hidden_size: 512, intermediate_size: 1536, ..wider() };
    let (model, vocab) = model_of(dir.path(), &spec);
    let long: Vec<u32> = (0..480u32).map(|j| (j * 104_729 + 17) % vocab).collect();
    let want = reference(dir.path(), &model, std::slice::from_ref(&long)).await;
    // 1 token per step: the prompt takes 480 steps, far more than the 1 s idle timeout.
    let slow = || vec!["--max-num-batched-tokens", "1", "--max-num-seqs", "1"];
    let idle = ["--idle-timeout-ms", "1000", "--kv-deadline-ms", "1000"];
    for route in ["relayed", "kept on the decode worker"] {
        let mut flags = idle.to_vec();
        if route != "relayed" {
            flags.extend(["--disagg-threshold", "1000"]);
        }
        let c = Cluster::start(dir.path(), &model, "1p1d.toml", &flags, &[slow()], &[slow()]).await;
        let started = Instant::now();
        let got = complete(&c.http, &c.router.http, &long, true).await;
        let took = started.elapsed();
        assert_same(&got, &want[0], route);
        assert!(took > Duration::from_millis(1500), "{route}: the prompt took only {took:?}: nothing was tested");
        let computed = total(&c, "baton_prompt_tokens_computed_total").await;
        assert_eq!(computed as usize, long.len(), "{route}: computed once");
        for w in c.all_workers() {
            w.assert_idle(&c.http).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_tokenize_bodies_do_not_stall_streams_or_heartbeats() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &[], &[vec![]], &[vec![]]).await;
    // Just under the 8 MiB body limit.
    let text = "lorem ipsum dolor sit amet ".repeat(8 * 1024 * 1024 / 27 - 8);
    let body = serde_json::to_vec(&json!({"model": MODEL, "prompt": text})).expect("json");
    assert!(body.len() < 8 * 1024 * 1024);
    let mut gaps = Vec::new();
    let window = Duration::from_secs(8);
    let mut tokenizers = Vec::new();
    let started = Instant::now();
    let mut streams = 0;
    while started.elapsed() < window {
        let prompt: Vec<u32> = (0..20u32).map(|j| (j * 11 + streams + 1) % vocab).collect();
        let req = json!({"model": MODEL, "prompt": prompt, "max_tokens": 480, "ignore_eos": true, "stream": true});
        let mut r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&req).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let mut last: Option<Instant> = None;
        while let Some(chunk) = r.chunk().await.expect("chunk") {
            assert!(!String::from_utf8_lossy(&chunk).contains("\"error\""), "{chunk:?}");
            let now = Instant::now();
            if let Some(prev) = last {
                gaps.push(now - prev);
            }
            last = Some(now);
            if tokenizers.is_empty() {
                // The stream is running: now send the eight bodies.
                for _ in 0..8 {
                    let (http, url, body) = (c.http.clone(), c.router.http.clone(), body.clone());
                    tokenizers.push(tokio::spawn(async move {
                        http.post(format!("{url}/tokenize"))
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await
                    }));
                }
            }
        }
        streams += 1;
    }
    let worst = gaps.iter().max().copied().unwrap_or_default();
    assert!(gaps.len() > 100, "only {} token gaps measured", gaps.len());
    assert!(worst < Duration::from_secs(1), "a token gap of {worst:?} while bodies were tokenized");
    let log = c.router.log_text();
    assert!(!log.contains("ejected"), "a worker was ejected:\n{log}");
    assert_eq!(c.workers().await.len(), 2);
    for t in tokenizers {
        t.abort();
    }
}
