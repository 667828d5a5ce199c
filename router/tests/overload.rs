//! Overload over HTTP, against a fake engine: the in-flight cap (429 with `Retry-After`, the
//! `baton_router_inflight` gauge back to 0), the prompts × n cap (a 400 naming the field
//! before any work), refusals that arrive on an engine stream (429/503, streaming or not),
//! and CPU-heavy tokenization kept off the async runtime.

mod common;

use baton_core::api::EngineError;
use baton_router::AdmissionLimits;
use common::{FakeConfig, MODEL, TestServer, eventually};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const INFLIGHT: &str = "baton_router_inflight{model_name=\"tiny-test\"}";

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": true});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_flight_cap_refuses_with_429_and_the_gauge_returns_to_zero() {
    let config = FakeConfig { token_delay: Duration::from_millis(20), ..Default::default() };
    let s = TestServer::start_limited(config, AdmissionLimits { max_inflight: 3, max_sequences_per_request: 8 }).await;
    // Two streams hold 1 + 2 sequences: the cap is full.
    let a = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&completion(json!({"stream": true})))
        .send()
        .await
        .expect("send");
    let b = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&completion(json!({"stream": true, "n": 2})))
        .send()
        .await
        .expect("send");
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    assert_eq!(s.metric(INFLIGHT).await, Some(3.0));
    for body in [completion(json!({})), completion(json!({"stream": true}))] {
        let r = s.client.post(format!("{}/v1/completions", s.url)).json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 429);
        assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("in flight")), "{v}");
    }
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    assert_eq!(s.post("/v1/chat/completions", chat.clone()).await.0, 429);
    // Finishing (or dropping) a request gives its sequences back.
    drop(b);
    let _ = a.text().await;
    assert!(eventually(Duration::from_secs(5), || async { s.metric(INFLIGHT).await == Some(0.0) }).await);
    assert_eq!(s.post("/v1/chat/completions", chat).await.0, 200);
    assert!(eventually(Duration::from_secs(2), || async { s.engine.live() == 0 }).await);
}

#[tokio::test]
async fn prompts_times_n_over_the_cap_is_a_400_before_any_work() {
    let s = TestServer::start_limited(
        FakeConfig { capacity: 4096, ..Default::default() },
        AdmissionLimits { max_inflight: 1 << 20, max_sequences_per_request: 2048 },
    )
    .await;
    let prompts: Vec<Vec<u32>> = (0..5000u32).map(|i| vec![20 + i % 50, 21, 22]).collect();
    let started = Instant::now();
    let (status, body) = s.post("/v1/completions", completion(json!({"prompt": prompts, "n": 128}))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("640000") && message.contains("2048"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(s.engine.submitted().is_empty(), "nothing reached the engine");
    // Within the cap it runs: 16 prompts × n = 128 is exactly 2048.
    let prompts: Vec<Vec<u32>> = (0..16u32).map(|i| vec![20 + i, 21]).collect();
    let (status, body) =
        s.post("/v1/completions", completion(json!({"prompt": prompts, "n": 128, "max_tokens": 1}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(2048));
}

#[tokio::test]
async fn refusals_on_the_engine_stream_are_429_or_503_never_a_200_that_fails() {
    for (error, status) in [
        (EngineError::Overloaded("all 2 decode worker(s) tried are at capacity".into()), 429),
        (EngineError::Unavailable("none of the 2 decode worker(s) tried could start it".into()), 503),
    ] {
        let s =
            TestServer::start(FakeConfig { refuse_with: Some(error), ..Default::default() }, Default::default()).await;
        let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        let mut stream_chat = chat.clone();
        stream_chat["stream"] = json!(true);
        let bodies = [
            ("/v1/completions", completion(json!({}))),
            ("/v1/completions", completion(json!({"stream": true}))),
            ("/v1/completions", completion(json!({"stream": true, "prompt": ["a", "b"], "n": 2}))),
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", stream_chat),
        ];
        for (path, body) in bodies {
            let r = s.client.post(format!("{}{path}", s.url)).json(&body).send().await.expect("send");
            assert_eq!(r.status().as_u16(), status, "{path} {body}");
            assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
            let v: Value = r.json().await.expect("an OpenAI error object, not an event stream");
            assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("decode worker")), "{v}");
        }
        assert_eq!(s.metric(INFLIGHT).await, Some(0.0), "refused requests hold nothing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn tokenizing_huge_bodies_does_not_stall_the_runtime() {
    // One runtime thread: were tokenization done on it, nothing else would run meanwhile.
    let s = TestServer::default_start().await;
    let text = "the quick brown fox jumps over the lazy dog ".repeat(12_000);
    let one = Instant::now();
    let (status, body) = s.post("/tokenize", json!({"model": MODEL, "prompt": text})).await;
    assert_eq!(status, 200, "{body}");
    let alone = one.elapsed();
    let jobs: Vec<_> = (0..3)
        .map(|_| {
            let (client, url, text) = (s.client.clone(), s.url.clone(), text.clone());
            tokio::spawn(async move {
                client.post(format!("{url}/tokenize")).json(&json!({"prompt": text})).send().await.map(|r| r.status())
            })
        })
        .collect();
    // Meanwhile the health endpoint answers at once, again and again.
    let mut worst = Duration::ZERO;
    let until = Instant::now() + alone * 2;
    let mut probes = 0;
    while Instant::now() < until || probes < 5 {
        let t = Instant::now();
        let r = s.get("/health").await;
        assert_eq!(r.status().as_u16(), 200);
        worst = worst.max(t.elapsed());
        probes += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for j in jobs {
        assert_eq!(j.await.expect("join").expect("send").as_u16(), 200);
    }
    assert!(
        worst < Duration::from_millis(250).max(alone / 4),
        "a health check waited {worst:?} while bodies were tokenized (one alone takes {alone:?})"
    );
}
