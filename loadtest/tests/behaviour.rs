//! Run behaviour against the scripted server: failures are counted and shown,
//! missing usage is estimated and flagged, warmup is not counted, `--duration`
//! stops sending at the deadline, exact random prompt lengths, datasets and
//! setup errors are clear.

mod common;

use std::sync::atomic::Ordering;

use baton_loadtest::{BackendKind, DatasetConfig, LoadtestError, Rate, RunConfig, run};
use common::{Script, start};

fn prompts_config(base_url: &str, dir: &tempfile::TempDir, n: usize) -> RunConfig {
    let mut c = RunConfig::new(
        BackendKind::Openai,
        base_url,
        DatasetConfig::Prompts { path: common::prompts_file(dir, n), output_len: 3 },
    );
    c.num_prompts = n;
    c.max_concurrency = Some(4);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_are_counted_and_shown() {
    let mut script = Script::new(20, 20);
    script.fail_every = Some(3);
    let server = start(script).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let result = run(&prompts_config(&server.base_url, &dir, 9)).await.expect("run completes");
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (6, 3));
    assert_eq!(s.errors.len(), 1);
    assert_eq!(s.errors[0].count, 3);
    assert_eq!(s.errors[0].error, "HTTP 500: scripted failure");
    let failed: Vec<_> = result.records.iter().filter(|r| !r.success).collect();
    assert_eq!(failed.len(), 3);
    assert!(failed.iter().all(|r| r.error.is_some()));
    let table = baton_loadtest::report::summary_table(&result);
    assert!(table.contains("Failed requests:                         3"), "{table}");
    assert!(table.contains("3 × HTTP 500: scripted failure"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_ask_for_usage_and_exact_lengths() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = prompts_config(&server.base_url, &dir, 2);
    run(&cfg).await.expect("run completes");
    {
        let bodies = server.observed.bodies.lock().expect("lock");
        let b = &bodies[0];
        assert_eq!(b["model"], "scripted-model");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["min_tokens"], 3);
        assert_eq!(b["max_tokens"], 3);
    }
    cfg.ignore_eos = false;
    cfg.model = Some("other".into());
    run(&cfg).await.expect("run completes");
    {
        let bodies = server.observed.bodies.lock().expect("lock");
        let b = bodies.last().expect("a request");
        assert_eq!(b["model"], "other");
        assert!(b.get("ignore_eos").is_none() && b.get("min_tokens").is_none());
    }
    // --extra-body fields reach every request and override the tester's own.
    cfg.extra_body =
        serde_json::from_str(r#"{"response_format": {"type": "json_object"}, "temperature": 0.5}"#).expect("an object");
    run(&cfg).await.expect("run completes");
    let bodies = server.observed.bodies.lock().expect("lock");
    let b = bodies.last().expect("a request");
    assert_eq!(b["response_format"]["type"], "json_object");
    assert_eq!(b["temperature"], 0.5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_usage_is_estimated_and_flagged() {
    let mut script = Script::new(20, 20);
    script.send_usage = false;
    let server = start(script).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let result = run(&prompts_config(&server.base_url, &dir, 4)).await.expect("run completes");
    let s = &result.summary;
    assert_eq!(s.failed, 0);
    assert_eq!(s.estimated_output_requests, 4);
    // One chunk per token in the script, so the chunk count is exact here.
    assert_eq!(s.total_output_tokens, 12);
    assert!(result.records.iter().all(|r| r.output_tokens_estimated));
    assert!(baton_loadtest::report::summary_table(&result).contains("ESTIMATED for 4 requests"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_requests_are_sent_but_not_counted() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = prompts_config(&server.base_url, &dir, 5);
    cfg.warmup = 3;
    let result = run(&cfg).await.expect("run completes");
    assert_eq!(result.records.len(), 5);
    assert_eq!(result.summary.completed, 5);
    assert_eq!(server.observed.requests.load(Ordering::SeqCst), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_that_all_fails_stops_the_run() {
    let mut script = Script::new(20, 20);
    script.fail_every = Some(1);
    let server = start(script).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = prompts_config(&server.base_url, &dir, 5);
    cfg.warmup = 2;
    match run(&cfg).await {
        Err(LoadtestError::Warmup { count, first_error }) => {
            assert_eq!(count, 2);
            assert!(first_error.contains("scripted failure"), "{first_error}");
        }
        other => panic!("expected a warmup error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_mode_stops_sending_at_the_deadline() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = prompts_config(&server.base_url, &dir, 4);
    cfg.duration_s = Some(1.0);
    cfg.max_concurrency = Some(2);
    cfg.request_rate = Rate::INFINITE;
    // Each request takes 20 + 2·20 = 60 ms, so two slots fit ~33 in 1 s.
    let result = run(&cfg).await.expect("run completes");
    let n = result.records.len();
    assert!((16..=34).contains(&n), "{n} requests in 1 s");
    assert!(result.records.iter().all(|r| r.start_s < 1.0));
    assert_eq!(result.summary.failed, 0);
    assert!(result.summary.duration_s >= 1.0 - 0.07 && result.summary.duration_s < 1.5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_prompts_have_exact_lengths_via_server_tokenizer() {
    let server = start(Script::new(20, 20)).await;
    let mut cfg = RunConfig::new(
        BackendKind::Openai,
        server.base_url.clone(),
        DatasetConfig::Random { input_len: 40, output_len: 4, range_ratio: 0.5 },
    );
    cfg.num_prompts = 12;
    cfg.seed = 5;
    // One at a time, so the server sees the requests in record order.
    cfg.max_concurrency = Some(1);
    let result = run(&cfg).await.expect("run completes");
    let bodies = server.observed.bodies.lock().expect("lock");
    assert_eq!(bodies.len(), 12);
    let mut lengths = Vec::new();
    for (record, body) in result.records.iter().zip(bodies.iter()) {
        let sent = common::scripted_tokenize(body["prompt"].as_str().expect("prompt"));
        assert_eq!(sent.len() as u64, record.input_tokens);
        assert!((20..=60).contains(&sent.len()));
        let max = body["max_tokens"].as_u64().expect("max_tokens");
        assert!((2..=6).contains(&max));
        assert_eq!(record.output_tokens, max);
        lengths.push(sent.len());
    }
    // A range ratio of 0.5 gives varied lengths, not one repeated value.
    lengths.dedup();
    assert!(lengths.len() > 3);
}

/// A word-level tokenizer.json: "a".."z" are tokens 1..26, with a special.
fn write_word_tokenizer(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for (i, c) in ('a'..='z').enumerate() {
        vocab.insert(c.to_string(), (i + 1).into());
    }
    vocab.insert("<s>".into(), 27.into());
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 27, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string()).expect("write tokenizer");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_prompts_with_local_tokenizer_are_exact_and_seeded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_word_tokenizer(&dir);
    let tok = baton_loadtest::tokenizer::TextTokenizer::from_file(&path).expect("load");
    let config = DatasetConfig::Random { input_len: 10, output_len: 5, range_ratio: 0.3 };
    let a = baton_loadtest::dataset::load(&config, 20, 1, Some(&tok)).await.expect("dataset");
    let b = baton_loadtest::dataset::load(&config, 20, 1, Some(&tok)).await.expect("dataset");
    let c = baton_loadtest::dataset::load(&config, 20, 2, Some(&tok)).await.expect("dataset");
    assert_eq!(a, b);
    assert_ne!(a, c);
    for spec in &a {
        let ids = tok.encode(&spec.prompt).await.expect("encode");
        assert_eq!(Some(ids.len()), spec.input_tokens);
        assert!((7..=13).contains(&ids.len()));
        assert!((3..=7).contains(&spec.output_tokens));
        // Added special tokens are never drawn.
        assert!(!spec.prompt.contains("<s>") && !ids.contains(&27));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_is_filtered_and_measured() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sharegpt.json");
    let long = "w1 ".repeat(8);
    let data = serde_json::json!([
        {"id": "a", "conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "w1 w2 w3 w4 w5"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w1 w2 w3 w4"}]},
        {"id": "lonely", "conversations": [{"from": "human", "value": long}]},
        {"id": "b", "conversations": [{"from": "human", "value": "w1 w2 w3 w4"}, {"from": "gpt", "value": long}]}
    ]);
    std::fs::write(&path, data.to_string()).expect("write");
    let mut cfg = RunConfig::new(
        BackendKind::Openai,
        server.base_url.clone(),
        DatasetConfig::Sharegpt { path, output_len: None },
    );
    cfg.num_prompts = 4;
    let result = run(&cfg).await.expect("run completes");
    assert_eq!(result.summary.completed, 4);
    let mut pairs: Vec<(u64, u64)> = result.records.iter().map(|r| (r.input_tokens, r.output_tokens)).collect();
    pairs.sort_unstable();
    // Two usable conversations, reused to reach 4 requests.
    assert_eq!(pairs, vec![(4, 8), (4, 8), (8, 5), (8, 5)]);
}

#[tokio::test]
async fn bad_dataset_files_give_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.txt");
    let cfg = DatasetConfig::Prompts { path: missing.clone(), output_len: 4 };
    match baton_loadtest::dataset::load(&cfg, 3, 0, None).await {
        Err(LoadtestError::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("expected an I/O error, got {other:?}"),
    }
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n \n").expect("write");
    let cfg = DatasetConfig::Prompts { path: empty, output_len: 4 };
    let err = baton_loadtest::dataset::load(&cfg, 3, 0, None).await.expect_err("empty file");
    assert!(err.to_string().contains("no prompts"), "{err}");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").expect("write");
    let cfg = DatasetConfig::Sharegpt { path: bad, output_len: Some(4) };
    let err = baton_loadtest::dataset::load(&cfg, 3, 0, None).await.expect_err("bad json");
    assert!(err.to_string().contains("not a ShareGPT JSON array"), "{err}");
    let cfg = DatasetConfig::Random { input_len: 4, output_len: 4, range_ratio: 0.0 };
    let err = baton_loadtest::dataset::load(&cfg, 3, 0, None).await.expect_err("no tokenizer");
    assert!(err.to_string().contains("--tokenizer"), "{err}");
}

#[tokio::test]
async fn unreachable_server_is_a_clear_error() {
    // Bind then drop to get a port with nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = prompts_config(&format!("http://127.0.0.1:{port}"), &dir, 2);
    let err = run(&cfg).await.expect_err("nothing listens");
    assert!(matches!(err, LoadtestError::Server(_)), "{err:?}");
    assert!(err.to_string().contains("/v1/models"), "{err}");
}
