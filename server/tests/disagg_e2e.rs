//! End to end, disaggregated: the real `baton router` and `baton worker` processes on
//! loopback (CPU, TCP KV transport) serving a tiny random model, against `baton serve`.
//!
//! - 1P1D and 2P2D give greedy output identical to `serve`, streaming and not, for prompts
//!   around block boundaries; afterwards every worker's `/metrics` shows zero KV blocks in use.
//! - A prefill worker that dies in the middle of a hand-off: the request still completes with
//!   the same tokens (recompute on D; or retry on another P), and the dead worker is ejected.
//! - A decode worker that dies mid-stream: its client gets a clear error, the router ejects
//!   it, and the next request completes on the other decode worker.
//! - `prefix_aware` sends a repeated long prefix to the prefill worker that holds it; that
//!   worker's `/metrics` shows the hits, the other's none.
//! - With a cluster secret (and with mutual TLS on top), 1P1D gives the same greedy output.
//! - Qwen3, Qwen3-MoE, Phi-4-mini, Gemma 2 and Gemma 3 (text) checkpoints written by
//!   transformers: serve gives transformers' greedy tokens, and 1P1D gives what serve gives.

mod common;

use baton_formats::Tokenizer;
use baton_formats::testing::{TinySpec, load_golden, write_hf_folder};
use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn disaggregated_matches_serve(config: &str, n: usize) {
    disaggregated_matches_serve_with(config, n, |_| Vec::new()).await;
}

/// As [`disaggregated_matches_serve`], with `flags(dir)` given to the router and every worker.
async fn disaggregated_matches_serve_with(config: &str, n: usize, flags: impl FnOnce(&std::path::Path) -> Vec<String>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps).await;
    let flags = flags(dir.path());
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let each: Vec<Vec<&str>> = vec![flags.clone(); n];
    let c = Cluster::start(dir.path(), &model, config, &flags, &each, &each).await;
    for round in 0..2 {
        for (p, w) in ps.iter().zip(&want) {
            for stream in [false, true] {
                let got = complete(&c.http, &c.router.http, p, stream).await;
                assert_same(&got, w, &format!("{config} round {round}, prompt of {} tokens, stream {stream}", p.len()));
            }
        }
    }
    let workers = c.workers().await;
    assert_eq!(workers.len(), 2 * n, "{workers:?}");
    let tls = flags.contains(&"--tls-cert");
    for w in &workers {
        let url = w["url"].as_str().expect("url");
        assert_eq!(url.starts_with("https://"), tls, "worker URLs follow the TLS setting: {url}");
    }
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
    // Every prefill worker handed KV off and every decode worker received some.
    for w in c.all_workers() {
        let bytes = w.metric(&c.http, &format!("baton_kv_transfer_bytes_total{{model_name=\"{MODEL}\"}}")).await;
        assert!(bytes > 0.0, "{} moved no KV:\n{}", w.http, w.log_text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_matches_serve() {
    disaggregated_matches_serve("1p1d.toml", 1).await;
}

/// A checkpoint transformers wrote: `baton serve` continues each of its golden prompts that
/// `keep` accepts with transformers' greedy tokens, and router + 1P1D over TCP gives what
/// serve gives.
async fn golden_checkpoint_through_serve_and_one_prefill_one_decode(name: &str, keep: impl Fn(usize) -> bool) {
    let (model, golden) = load_golden(name).expect("fixture");
    let tok = Tokenizer::from_file(&model.join("tokenizer.json")).expect("tokenizer");
    let dir = tempfile::tempdir().expect("tempdir");
    let prompts: Vec<_> = golden.prompts.iter().filter(|p| keep(p.ids.len())).collect();
    assert!(!prompts.is_empty(), "{name}: no prompt kept");
    let ps: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let want = reference(dir.path(), &model, &ps).await;
    for (p, (text, _)) in prompts.iter().zip(&want) {
        // Serve runs MAX_TOKENS (more than the 16 golden ones): its text starts with theirs.
        let head = tok.decode(&p.greedy, true).expect("decode");
        // Only the last character can be a byte sequence the 17th token would complete; earlier
        // replacement characters are invalid bytes the serve text must show too.
        let head = head.strip_suffix('\u{FFFD}').unwrap_or(&head);
        assert!(!head.is_empty(), "{name} prompt {:?}: transformers' tokens decode to nothing", p.ids);
        assert!(text.starts_with(head), "{name} prompt {:?}: serve gave {text:?}, transformers {head:?}", p.ids);
    }
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &[], &[vec![]], &[vec![]]).await;
    for (p, w) in ps.iter().zip(&want) {
        for stream in [false, true] {
            let got = complete(&c.http, &c.router.http, p, stream).await;
            assert_same(&got, w, &format!("{name} 1p1d, prompt of {} tokens, stream {stream}", p.len()));
        }
    }
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
}

/// Qwen3: q/k norm, transformers 5 config keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("qwen3", |_| true).await;
}

/// Qwen3-MoE: routed experts in some layers, dense MLPs in others; the decode worker's MoE
/// layers continue from KV the prefill worker computed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_moe_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("qwen3_moe", |_| true).await;
}

/// Gemma 3 (text): sliding-window layers (window 16), q/k norm, per-layer-kind RoPE; the KV
/// of every layer, windowed ones included, crosses from P to D. The prompts of 20, 40 and 64
/// tokens run past the window. Left out: those of 6 and 13 tokens, whose greedy tokens are
/// bytes of no complete UTF-8 character (text cannot show them; `engine/tests/golden.rs`
/// checks their ids).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemma3_text_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("gemma3_text", |len| len == 1 || len >= 20).await;
}

/// Gemma 2: attention and final logit soft-capping, alternating windowed and global layers;
/// the 40-token prompt runs past the window (16). Left out, as for Gemma 3: the prompts of 1,
/// 13 and 64 tokens, whose greedy tokens decode to no text (partial UTF-8, special tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemma2_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("gemma2", |len| matches!(len, 6 | 20 | 40)).await;
}

/// Phi-4-mini: fused qkv/gate_up in the checkpoint, partial rotary, LongRoPE, tied. Served at
/// its whole context, LongRoPE uses `long_factor`, which transformers used for the prompts
/// longer than `original_max_position_embeddings` (36): those are the ones checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phi4_mini_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("phi4_mini", |len| len > 36).await;
}

/// gpt-oss: learned sinks in every layer, alternating windowed (16) and full layers, YaRN,
/// biased experts with the clamped SwiGLU; the prompts of 20, 40 and 64 tokens run past the
/// window, and the decode worker continues from the prefill worker's KV of both kinds of layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpt_oss_checkpoint_gives_transformers_tokens_through_serve_and_one_prefill_one_decode() {
    golden_checkpoint_through_serve_and_one_prefill_one_decode("gpt_oss", |len| len >= 20).await;
}

/// LongRoPE picks its factor list from the served context: a Phi-4-mini worker serving less
/// than the original context (short factors) cannot join a cluster serving more (long
/// factors); the router refuses it, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_context_picks_other_longrope_factors_is_refused() {
    let (model, _) = load_golden("phi4_mini").expect("fixture");
    let dir = tempfile::tempdir().expect("tempdir");
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &[], &[vec![]], &[vec![]]).await;
    let mut args: Vec<String> = vec!["worker".into(), "--role".into(), "decode".into()];
    args.extend(model_args(&model).into_iter().map(|a| if a == "144" { "32".to_owned() } else { a }));
    assert!(args.contains(&"32".to_owned()), "the fixture's context is 144: {args:?}");
    args.extend(["--router".into(), c.registry.clone()]);
    let worker = Proc::spawn(dir.path(), "short-context-worker", &args);
    let deadline = Instant::now() + STARTUP;
    while !worker.log_text().contains("the router refused this worker") {
        assert!(Instant::now() < deadline, "no refusal:\n{}", worker.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = worker.log_text();
    assert!(log.contains("longrope-short") && log.contains("longrope-long"), "the refusal names both:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_two_decode_matches_serve() {
    disaggregated_matches_serve("2p2d.toml", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_with_a_cluster_secret_matches_serve() {
    disaggregated_matches_serve_with("1p1d.toml", 1, |dir| {
        vec!["--cluster-secret-file".into(), secret_file(dir, "cluster.secret").display().to_string()]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_over_mutual_tls_with_a_secret_matches_serve() {
    disaggregated_matches_serve_with("1p1d.toml", 1, |dir| {
        let mut flags = tls_flags(dir);
        flags.extend(["--cluster-secret-file".into(), secret_file(dir, "cluster.secret").display().to_string()]);
        flags
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_dying_mid_transfer_is_recomputed_on_the_decode_worker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[4..5]).await;
    // The prefill worker exits after sending 1 of its 2 layers of its first hand-off.
    let mut c = Cluster::start(
        dir.path(),
        &model,
        "1p1d.toml",
        &["--on-transfer-failure", "recompute"],
        &[vec!["--chaos-exit-after-kv-layers", "1"]],
        &[vec![]],
    )
    .await;
    let started = Instant::now();
    let got = complete(&c.http, &c.router.http, &ps[4], false).await;
    assert_same(&got, &want[0], "recomputed after the prefill worker died");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}: it waited for a deadline", started.elapsed());
    let status = wait_exit(&mut c.prefill[0], Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(101), "the prefill worker died by the chaos hook");
    // The dead worker leaves the pool; requests go on (prefilled on the decode worker).
    wait_pools(&c, 0, 1, Duration::from_secs(5)).await;
    let got = complete(&c.http, &c.router.http, &ps[4], true).await;
    assert_same(&got, &want[0], "after the ejection");
    c.decode[0].assert_idle(&c.http).await;
    let router_log = c.router.log_text();
    assert!(router_log.contains("recomputes"), "the router log says what happened:\n{router_log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_dying_mid_transfer_is_retried_on_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[4..6]).await;
    let c = Cluster::start(
        dir.path(),
        &model,
        "2p2d.toml",
        &["--on-transfer-failure", "retry", "--policy", "round_robin"],
        &[vec!["--chaos-exit-after-kv-layers", "1"], vec![]],
        &[vec![]],
    )
    .await;
    // Round robin: the first request goes to the dying worker, the retry to the other.
    for (p, w) in ps[4..6].iter().zip(&want) {
        let got = complete(&c.http, &c.router.http, p, false).await;
        assert_same(&got, w, "retried on the healthy prefill worker");
    }
    let retried = c.router.log_text().contains("retrying the prefill on another worker");
    assert!(retried, "{}", c.router.log_text());
    // The healthy prefill worker did the work.
    let bytes = c.prefill[1].metric(&c.http, &format!("baton_kv_transfer_bytes_total{{model_name=\"{MODEL}\"}}")).await;
    assert!(bytes > 0.0);
    for w in [&c.prefill[1], &c.decode[0]] {
        w.assert_idle(&c.http).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_dying_fails_its_client_clearly_and_others_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[3..4]).await;
    // Decode worker 0 exits after streaming 5 tokens; decode worker 1 is healthy.
    let mut c = Cluster::start(
        dir.path(),
        &model,
        "1p1d.toml",
        &[],
        &[vec![]],
        &[vec!["--chaos-exit-after-tokens", "5"], vec![]],
    )
    .await;
    // Decode picks rotate from the first registered worker: this request lands on worker 0.
    let started = Instant::now();
    let r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&completion(&ps[3], true)).send().await;
    let body = r.expect("response").text().await.unwrap_or_default();
    assert!(started.elapsed() < Duration::from_secs(10), "the client waited {:?}", started.elapsed());
    assert!(body.contains("\"error\""), "the stream must end with an error event: {body}");
    assert!(body.contains("decode worker"), "the error names the failed worker: {body}");
    assert_eq!(wait_exit(&mut c.decode[0], Duration::from_secs(5)).await.code(), Some(101));
    wait_pools(&c, 1, 1, Duration::from_secs(5)).await;
    for stream in [false, true] {
        let got = complete(&c.http, &c.router.http, &ps[3], stream).await;
        assert_same(&got, &want[0], "on the surviving decode worker");
    }
    for w in [&c.prefill[0], &c.decode[1]] {
        w.assert_idle(&c.http).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_sends_a_repeated_prefix_to_the_worker_that_holds_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let c =
        Cluster::start(dir.path(), &model, "2p2d.toml", &["--policy", "prefix_aware"], &[vec![], vec![]], &[vec![]])
            .await;
    let prefix: Vec<u32> = (0..160u32).map(|j| (j * 31 + 7) % vocab).collect();
    let with_suffix = |k: u32| -> Vec<u32> {
        let mut p = prefix.clone();
        p.extend((0..5).map(|j| (k * 13 + j * 3 + 1) % vocab));
        p
    };
    complete(&c.http, &c.router.http, &with_suffix(0), false).await;
    // Wait until the holder has reported its cached blocks (heartbeats every 200 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ws = c.workers().await;
        if ws.iter().any(|w| w["role"] == "prefill" && w["cached_blocks"].as_u64() >= Some(10)) {
            break;
        }
        assert!(Instant::now() < deadline, "no prefill worker reported the cached prefix: {ws:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for k in 1..6 {
        complete(&c.http, &c.router.http, &with_suffix(k), false).await;
    }
    let hits_series = format!("vllm:prefix_cache_hits_total{{model_name=\"{MODEL}\"}}");
    let mut hits = Vec::new();
    for w in &c.prefill {
        hits.push(w.metric(&c.http, &hits_series).await);
    }
    hits.sort_by(f64::total_cmp);
    // 5 repeats × 10 cached blocks × 16 tokens on the holder; nothing on the other.
    assert_eq!(hits, vec![0.0, 5.0 * 160.0], "prefix hits per prefill worker");
    let ws = c.workers().await;
    assert!(ws.iter().any(|w| w["role"] == "prefill" && w["cached_blocks"].as_u64() >= Some(10)), "{ws:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_blocks_on_both_sides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &[], &[vec![]], &[vec![]]).await;
    let p: Vec<u32> = (0..70u32).map(|j| (j * 17 + 3) % vocab).collect();
    for _ in 0..3 {
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true});
        let mut r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&body).send().await.expect("send");
        // Read the first chunk, then hang up.
        let first = r.chunk().await.expect("chunk");
        assert!(first.is_some());
        drop(r);
    }
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
    // The router has nothing in flight either, and the streams really were cut short.
    let ws = c.workers().await;
    assert!(ws.iter().all(|w| w["inflight"] == 0), "{ws:?}");
    let generated = c.router.metric(&c.http, &format!("vllm:generation_tokens_total{{model_name=\"{MODEL}\"}}")).await;
    assert!(generated < 3.0 * 400.0, "{generated} tokens: the disconnects did not abort the requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_missing_workers_get_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let http = reqwest::Client::new();
    let args: Vec<String> = ["router", "--model", model.to_str().expect("utf8"), "--served-model-name", MODEL]
        .iter()
        .map(|s| s.to_string())
        .chain(["--grpc-port".into(), "0".into(), "--registry-port".into(), free_port().to_string()])
        .collect();
    let mut router = Proc::spawn(dir.path(), "router", &args);
    let deadline = Instant::now() + STARTUP;
    let health = loop {
        if let Some(s) = router.exited() {
            panic!("router exited with {s}:\n{}", router.log_text());
        }
        if let Ok(r) = http.get(format!("{}/health", router.http)).send().await {
            break r.status().as_u16();
        }
        assert!(Instant::now() < deadline, "router did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(health, 503, "no workers: not ready");
    let post = |body: Value| {
        let http = http.clone();
        let url = format!("{}/v1/completions", router.http);
        async move {
            let r = http.post(url).json(&body).send().await.expect("send");
            (r.status().as_u16(), r.json::<Value>().await.expect("json"))
        }
    };
    let (status, body) = post(json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("no decode")), "{body}");
    // Validation happens before routing: bad requests are 400 even with no workers.
    let (status, body) = post(json!({"model": MODEL, "prompt": [1, vocab + 5], "max_tokens": 4})).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(json!({"model": MODEL, "prompt": [1, 2], "temperature": -1})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("temperature")), "{body}");
    let (status, body) = post(json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 100000})).await;
    assert_eq!(status, 400, "{body}");
    // A worker of another model is refused with the reason in its log.
    let other_dir = dir.path().join("other");
    let other = write_hf_folder(&other_dir, &TinySpec { num_layers: 3, ..TinySpec::llama() }).expect("model");
    let registry = args[args.len() - 1].clone();
    let mut wargs: Vec<String> = vec!["worker".into(), "--role".into(), "decode".into()];
    wargs.extend(model_args(&other));
    wargs.extend(["--router".into(), format!("127.0.0.1:{registry}")]);
    let worker = Proc::spawn(dir.path(), "wrong-worker", &wargs);
    let deadline = Instant::now() + STARTUP;
    while !worker.log_text().contains("the router refused this worker") {
        assert!(Instant::now() < deadline, "no refusal:\n{}", worker.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(worker.log_text().contains("layers3"), "the refusal names the models:\n{}", worker.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_stay_on_the_decode_worker_under_conditional_disaggregation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps).await;
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &["--disagg-threshold", "32"], &[vec![]], &[vec![]]).await;
    let bytes = format!("baton_kv_transfer_bytes_total{{model_name=\"{MODEL}\"}}");
    // Prompts of 3..17 tokens (< 32) run on the decode worker alone: nothing moves.
    for (p, w) in ps.iter().zip(&want).filter(|(p, _)| p.len() < 32) {
        assert_same(&complete(&c.http, &c.router.http, p, false).await, w, "short prompt kept on D");
    }
    assert_eq!(c.prefill[0].metric(&c.http, &bytes).await, 0.0, "a short prompt was handed off");
    // Longer ones are disaggregated.
    for (p, w) in ps.iter().zip(&want).filter(|(p, _)| p.len() >= 32) {
        assert_same(&complete(&c.http, &c.router.http, p, true).await, w, "long prompt handed off");
    }
    assert!(c.prefill[0].metric(&c.http, &bytes).await > 0.0, "long prompts were not handed off");
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
}

/// A prefill worker whose engine panics in its first step: the request still completes
/// (recomputed on the decode worker), the worker's `/health` answers 503 and its heartbeats
/// report it unhealthy, so the router lists it unhealthy and sends it no more work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_whose_engine_panics_reports_unhealthy_and_requests_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let ps = prompts(vocab);
    let want = reference(dir.path(), &model, &ps[4..5]).await;
    let c = Cluster::start(
        dir.path(),
        &model,
        "1p1d.toml",
        &["--on-transfer-failure", "recompute"],
        &[vec!["--chaos-engine-fault", "panic@1"]],
        &[vec![]],
    )
    .await;
    let got = complete(&c.http, &c.router.http, &ps[4], false).await;
    assert_same(&got, &want[0], "recomputed after the prefill engine panicked");
    let p = &c.prefill[0];
    let health = c.http.get(format!("{}/health", p.http)).send().await.expect("health").status().as_u16();
    assert_eq!(health, 503, "{}", p.log_text());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ws = c.workers().await;
        let prefill: Vec<&Value> = ws.iter().filter(|w| w["role"] == "prefill").collect();
        if prefill.len() == 1 && prefill[0]["healthy"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "the router never saw the unhealthy heartbeat: {ws:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = complete(&c.http, &c.router.http, &ps[4], true).await;
    assert_same(&got, &want[0], "with the prefill worker unhealthy");
    c.decode[0].assert_idle(&c.http).await;
    assert!(p.log_text().contains("panicked"), "{}", p.log_text());
}
