//! SIGSTOP chaos, end to end: a stopped worker holds its connections open but answers nothing,
//! the case TCP alone takes minutes to notice.
//!
//! - The prefill worker stopped before or during a request: the request still completes with
//!   `serve`'s tokens (the relay gives up on the prefill at its deadline and the decode worker
//!   computes the prompt) within the deadlines.
//! - The decode worker stopped mid-stream: the client gets an error event within the idle
//!   timeout, not a hang.
//! - After SIGCONT each worker rejoins its pool, its blocks are free, and the router has
//!   nothing in flight.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// Deadlines short enough for a test: 1 s hand-off, 2 s for a worker's answer, 3 s of silence.
const ROUTER_FLAGS: [&str; 6] = ["--kv-deadline-ms", "1000", "--rpc-timeout-ms", "2000", "--idle-timeout-ms", "3000"];

/// Waits for the worker to be registered again and idle, and the router to be idle.
async fn recovered(c: &Cluster) {
    wait_pools(c, c.prefill.len(), c.decode.len(), Duration::from_secs(20)).await;
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
    c.assert_router_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_prefill_worker_costs_a_recompute_not_a_hang() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[4..6]).await;
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &ROUTER_FLAGS, &[vec![]], &[vec![]]).await;
    // Stopped before the request: the prefill call gets no answer.
    c.prefill[0].signal("STOP").expect("SIGSTOP");
    let started = Instant::now();
    let got = complete(&c.http, &c.router.http, &ps[4], false).await;
    assert_same(&got, &want[0], "with the prefill worker stopped");
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
    c.prefill[0].signal("CONT").expect("SIGCONT");
    recovered(&c).await;
    // Stopped while the request runs (wherever it is by then: queued, computing, sending).
    for (i, delay) in [5u64, 30].into_iter().enumerate() {
        let (http, url, p) = (c.http.clone(), c.router.http.clone(), ps[5].clone());
        let request = tokio::spawn(async move { complete(&http, &url, &p, true).await });
        tokio::time::sleep(Duration::from_millis(delay)).await;
        c.prefill[0].signal("STOP").expect("SIGSTOP");
        let started = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(10), request).await.expect("no hang").expect("join");
        assert_same(&got, &want[1], &format!("prefill stopped mid-request ({i})"));
        assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
        c.prefill[0].signal("CONT").expect("SIGCONT");
        recovered(&c).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_decode_worker_fails_its_stream_within_the_idle_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[4..5]).await;
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &ROUTER_FLAGS, &[vec![]], &[vec![]]).await;
    let body =
        serde_json::json!({"model": MODEL, "prompt": ps[4], "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let first = r.chunk().await.expect("chunk");
    assert!(first.is_some());
    c.decode[0].signal("STOP").expect("SIGSTOP");
    let stopped = Instant::now();
    let mut rest = String::new();
    let read = async {
        while let Some(chunk) = r.chunk().await.expect("chunk") {
            rest.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    tokio::time::timeout(Duration::from_secs(15), read).await.expect("the stream hung");
    let waited = stopped.elapsed();
    assert!(rest.contains("\"error\""), "the stream must end with an error event: {rest}");
    assert!(rest.contains("decode"), "the error names the decode worker: {rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    assert!(waited < Duration::from_secs(8), "the client waited {waited:?} (idle timeout 3 s)");
    // Meanwhile the router noticed the silent worker; it has no decode worker to offer.
    wait_pools(&c, 1, 0, Duration::from_secs(10)).await;
    c.decode[0].signal("CONT").expect("SIGCONT");
    recovered(&c).await;
    let got = complete(&c.http, &c.router.http, &ps[4], false).await;
    assert_same(&got, &want[0], "after the decode worker came back");
    recovered(&c).await;
}
