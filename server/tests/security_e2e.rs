//! End to end, security: real `baton serve`, `router` and `worker` processes on loopback.
//!
//! - `--api-key` guards HTTP `/v1/*`, `/tokenize`, `/detokenize` (and the router's
//!   `/workers`) with 401, and every public gRPC method with `UNAUTHENTICATED`, on `serve` and
//!   on `router`; `/health` and `/metrics` stay open; the scheme is case-insensitive.
//! - With a cluster secret, registry and worker calls without it (or with another secret)
//!   are refused; a signed registration for a live worker's URL does not evict it, nor does
//!   a heartbeat naming its id without its session; a KV connection without the proof, or
//!   for a reservation bound to another prefill worker, is refused, and the reservation then
//!   recomputes by itself and completes.
//! - Binding 0.0.0.0 without a secret refuses to start (router and worker), and starts with
//!   `--insecure-cluster` or a secret.
//! - A worker restarted on the same address replaces its still-live old entry at once: the
//!   router asks the address which instance serves it.

mod common;

use baton_core::cluster_auth::{ClusterSecret, ReservationToken};
use baton_core::kv_transfer::{KvDtype, KvLayout};
use baton_engine::kv_transport::tcp::TcpKvSender;
use baton_engine::kv_transport::{Handshake, TransportError};
use baton_proto::ClusterSecurity;
use baton_proto::worker as pb;
use baton_proto::worker::registry_client::RegistryClient;
use baton_proto::worker::worker_client::WorkerClient;
use common::*;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};

const KEY: &str = "the-api-key";

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

async fn channel(url: &str) -> Channel {
    Endpoint::from_shared(url.to_owned()).expect("url").connect().await.expect("connect")
}

fn unauthenticated<T: std::fmt::Debug>(r: Result<T, tonic::Status>, what: &str) {
    match r {
        Err(s) => assert_eq!(s.code(), tonic::Code::Unauthenticated, "{what}: {s:?}"),
        Ok(v) => panic!("{what} must be refused, got {v:?}"),
    }
}

fn with_auth<T>(message: T, value: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", value.parse().expect("ascii"));
    r
}

/// The HTTP and gRPC API-key checks common to `serve` and `router`.
async fn check_api_key(http: &reqwest::Client, base: &str, grpc: &str) {
    for path in ["/v1/models"] {
        let r = http.get(format!("{base}{path}")).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{path}");
        let r = http.get(format!("{base}{path}")).header("authorization", format!("bearer {KEY}")).send().await;
        assert_eq!(r.expect("send").status().as_u16(), 200, "{path} with a lower-case scheme");
    }
    for (path, body) in [
        ("/v1/completions", json!({"prompt": [1, 2], "max_tokens": 1})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})),
        ("/tokenize", json!({"prompt": "hello"})),
        ("/detokenize", json!({"tokens": [1, 2]})),
    ] {
        let r = http.post(format!("{base}{path}")).json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{path} without a key");
        let err: Value = r.json().await.expect("json");
        assert_eq!(err["error"]["code"], "invalid_api_key", "{path}: {err}");
        let r = http.post(format!("{base}{path}")).bearer_auth("nope").json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{path} with a wrong key");
    }
    for path in ["/tokenize"] {
        let r = http.post(format!("{base}{path}")).bearer_auth(KEY).json(&json!({"prompt": "hi"})).send().await;
        assert_eq!(r.expect("send").status().as_u16(), 200, "{path} with the key");
    }
    assert_eq!(http.get(format!("{base}/metrics")).send().await.expect("metrics").status().as_u16(), 200);
    let health = http.get(format!("{base}/health")).send().await.expect("health").status().as_u16();
    assert_ne!(health, 401, "/health stays open");
    let mut client = baton_proto::v1::baton_client::BatonClient::new(channel(grpc).await);
    use baton_proto::v1::{HealthRequest, ModelInfoRequest};
    unauthenticated(client.model_info(ModelInfoRequest {}).await, "ModelInfo without metadata");
    unauthenticated(client.health(with_auth(HealthRequest {}, "Bearer nope")).await, "Health with a bad key");
    unauthenticated(client.model_info(with_auth(ModelInfoRequest {}, &format!("Basic {KEY}"))).await, "Basic");
    let info = client.model_info(with_auth(ModelInfoRequest {}, &format!("bearer {KEY}"))).await.expect("ModelInfo");
    assert_eq!(info.into_inner().model, MODEL);
}

async fn wait_up(p: &mut Proc, http: &reqwest::Client) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(s) = p.exited() {
            panic!("{} exited with {s}:\n{}", p.log.display(), p.log_text());
        }
        if http.get(format!("{}/metrics", p.http)).send().await.is_ok() {
            return;
        }
        assert!(Instant::now() < deadline, "{} never came up:\n{}", p.log.display(), p.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_router_require_the_api_key_on_http_and_grpc() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, _) = tiny(dir.path());
    let http = reqwest::Client::new();
    // serve
    let grpc = free_port();
    let mut args = strings(&["serve", "--api-key", KEY, "--grpc-port", &grpc.to_string()]);
    args.extend(model_args(&model));
    let mut serve = Proc::spawn(dir.path(), "serve", &args);
    serve.wait_healthy(&http).await;
    check_api_key(&http, &serve.http, &format!("http://127.0.0.1:{grpc}")).await;
    // The key also works for generation over gRPC.
    let mut client =
        baton_proto::v1::baton_client::BatonClient::new(channel(&format!("http://127.0.0.1:{grpc}")).await);
    let request = baton_proto::v1::GenerateRequest {
        request_id: String::new(),
        input: Some(baton_proto::v1::generate_request::Input::TokenIds(baton_proto::v1::TokenIds {
            ids: vec![1, 2, 3],
        })),
        sampling: Some(baton_proto::v1::SamplingParams { max_tokens: Some(3), ..Default::default() }),
        add_special_tokens: None,
    };
    unauthenticated(client.generate(request.clone()).await.map(|_| ()), "Generate without metadata");
    let mut stream =
        client.generate(with_auth(request, &format!("Bearer {KEY}"))).await.expect("generate").into_inner();
    let mut completes = 0;
    while let Some(m) = stream.message().await.expect("message") {
        completes += usize::from(matches!(m.response, Some(baton_proto::v1::generate_response::Response::Complete(_))));
    }
    assert_eq!(completes, 1);
    drop(serve);
    // router (no workers needed for these checks)
    let grpc = free_port();
    let mut args = strings(&["router", "--model", model.to_str().expect("utf8"), "--served-model-name", MODEL]);
    args.extend(strings(&["--api-key", KEY, "--grpc-port", &grpc.to_string()]));
    args.extend(strings(&["--registry-port", &free_port().to_string()]));
    let mut router = Proc::spawn(dir.path(), "router", &args);
    wait_up(&mut router, &http).await;
    check_api_key(&http, &router.http, &format!("http://127.0.0.1:{grpc}")).await;
    let r = http.get(format!("{}/workers", router.http)).send().await.expect("workers");
    assert_eq!(r.status().as_u16(), 401, "/workers lists addresses: it needs the key");
    let r = http.get(format!("{}/workers", router.http)).bearer_auth(KEY).send().await.expect("workers");
    assert_eq!(r.status().as_u16(), 200);
}

fn secret_flags(path: &Path) -> Vec<String> {
    vec!["--cluster-secret-file".into(), path.display().to_string()]
}

fn work(prompt: &[u32], max_tokens: u32, deadline_ms: u32, prefill: &str) -> pb::WorkRequest {
    let params = baton_core::params::SamplingParams {
        max_tokens: Some(max_tokens as usize),
        seed: Some(1),
        ignore_eos: true,
        ..baton_core::params::SamplingParams::greedy()
    };
    pb::WorkRequest {
        prompt_token_ids: prompt.to_vec(),
        params: Some(baton_proto::wire::sampling_to_wire(&params)),
        priority: 0,
        deadline_ms,
        prefill_instance: prefill.into(),
        // No progress reports: these calls check refusals, not liveness.
        progress_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secured_cluster_refuses_unsigned_calls_forged_identities_and_unproven_kv() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let secret_path = secret_file(dir.path(), "cluster.secret");
    let flags = secret_flags(&secret_path);
    let f: Vec<&str> = flags.iter().map(String::as_str).collect();
    let each = std::slice::from_ref(&f);
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &f, each, each).await;
    let workers = c.workers().await;
    let decode = workers.iter().find(|w| w["role"] == "decode").expect("decode worker").clone();
    let url = decode["url"].as_str().expect("url").to_owned();
    let kv_addr = decode["kv_addr"].as_str().expect("kv").to_owned();
    let decode_id = decode["id"].as_u64().expect("id");

    let secret = ClusterSecret::from_bytes(&std::fs::read(&secret_path).expect("secret")).expect("secret");
    let insider = ClusterSecurity::new(Some(secret.clone()), "tester", None);
    let outsider = ClusterSecurity::new(
        Some(ClusterSecret::from_bytes(b"not the cluster's secret at all").expect("secret")),
        "tester",
        None,
    );
    let info = baton_formats::load_model_info(&model, baton_formats::LoadFormat::Auto).expect("model info");
    let register = |url: &str, instance: &str| pb::RegisterRequest {
        role: pb::Role::Decode as i32,
        worker_url: url.into(),
        kv_addr: "127.0.0.1:1".into(),
        model_fingerprint: info.config.fingerprint(),
        vocab_size: vocab,
        max_model_len: 512,
        num_blocks: 64,
        layout: Some(pb::KvLayout {
            num_layers: 2,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 16,
            dtype: "f32".into(),
        }),
        device: "cpu".into(),
        instance: instance.into(),
        eos_token_ids: vec![],
    };
    let beat = |id: u64, session: Vec<u8>| pb::HeartbeatRequest {
        worker_id: id,
        load: None,
        events: vec![],
        healthy: true,
        session,
    };

    // The registry: unsigned, or signed with another secret, is refused.
    let reg_ch = channel(&c.registry).await;
    let mut open = RegistryClient::new(reg_ch.clone());
    unauthenticated(open.register(register("http://127.0.0.1:9", "intruder")).await, "unsigned Register");
    unauthenticated(open.heartbeat(beat(decode_id, vec![])).await, "unsigned Heartbeat");
    let mut forged = RegistryClient::new(outsider.client(reg_ch.clone()));
    unauthenticated(forged.register(register("http://127.0.0.1:9", "intruder")).await, "Register, wrong secret");
    unauthenticated(forged.heartbeat(beat(decode_id, vec![0; 16])).await, "Heartbeat, wrong secret");
    // Signed, but claiming a live worker's URL or id: refused, and the worker stays.
    let mut signed = RegistryClient::new(insider.client(reg_ch));
    let err = signed.register(register(&url, "tester")).await.expect_err("a live worker's URL");
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    let err = signed.register(register("http://127.0.0.1:9", "someone-else")).await.expect_err("not its signer");
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    let err = signed.heartbeat(beat(decode_id, vec![7; 16])).await.expect_err("another worker's id");
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(!signed.heartbeat(beat(decode_id ^ 1, vec![7; 16])).await.expect("unknown id").into_inner().known);
    let now = c.workers().await;
    assert!(now.iter().any(|w| w["id"].as_u64() == Some(decode_id) && w["url"] == url.as_str()), "{now:?}");

    // The worker service: every method refuses unsigned calls and another secret's.
    let w_ch = channel(&url).await;
    let p = [3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3];
    let mut forged = WorkerClient::new(outsider.client(w_ch.clone()));
    unauthenticated(forged.generate(work(&p, 2, 1000, "")).await.map(|_| ()), "Generate, wrong secret");
    unauthenticated(forged.decode(work(&p, 2, 1000, "x")).await.map(|_| ()), "Decode, wrong secret");
    unauthenticated(forged.identify(pb::IdentifyRequest {}).await, "Identify, wrong secret");
    let mut open = WorkerClient::new(w_ch.clone());
    unauthenticated(open.generate(work(&p, 2, 1000, "")).await.map(|_| ()), "unsigned Generate");
    unauthenticated(open.decode(work(&p, 2, 1000, "x")).await.map(|_| ()), "unsigned Decode");
    let prefill = pb::PrefillRequest {
        request: Some(work(&p, 2, 1000, "")),
        kv_addr: kv_addr.clone(),
        decode_block_table: vec![0, 1],
        deadline_ms: 1000,
        reservation: vec![0; 16],
    };
    unauthenticated(open.prefill(prefill).await.map(|_| ()), "unsigned Prefill");
    unauthenticated(open.recompute(pb::RecomputeRequest { reservation: vec![0; 16] }).await, "unsigned Recompute");
    let rebind = pb::RebindRequest { reservation: vec![0; 16], prefill_instance: "x".into() };
    unauthenticated(open.rebind(rebind).await, "unsigned Rebind");
    unauthenticated(open.identify(pb::IdentifyRequest {}).await, "unsigned Identify");

    // A reservation bound to the prefill instance "p-bound", made with the secret (as the
    // router would), waits 1.5 s for its KV.
    let mut w = WorkerClient::new(insider.client(w_ch));
    let mut stream = w.decode(work(&p, 6, 1500, "p-bound")).await.expect("signed Decode").into_inner();
    let reserved = match stream.message().await.expect("message").and_then(|e| e.event) {
        Some(pb::work_event::Event::Reserved(r)) => r,
        other => panic!("expected a reservation, got {other:?}"),
    };
    assert_eq!(reserved.reservation.len(), 16, "a 128-bit token");
    let token = ReservationToken::from_slice(&reserved.reservation).expect("token");
    let layout = KvLayout { num_layers: 2, block_size: 16, num_kv_heads: 2, head_dim: 16, dtype: KvDtype::F32 };
    let addr = baton_engine::kv_transport::handoff::resolve(&reserved.kv_addr).await.expect("kv addr");
    let plan =
        baton_core::kv_transfer::plan_transfer(&layout, &[0, 1], &reserved.block_table, p.len(), 0).expect("plan");
    let hs = |sender: &str, token: ReservationToken| Handshake {
        layout,
        sender: sender.into(),
        reservation: Some(token),
        num_tokens: p.len(),
        runs: plan.runs.clone(),
        bytes_per_layer_half: plan.bytes_per_layer / 2,
        nccl: None,
    };
    let d = Duration::from_secs(5);
    let refused = |r: Result<TcpKvSender, TransportError>| match r {
        Err(TransportError::Refused(m)) => m,
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, got an accepted hand-off"),
    };
    // No proof, or a proof with another secret: refused before anything else.
    let m = refused(TcpKvSender::connect(addr, hs("p-bound", token), d, None).await);
    assert!(m.contains("authentication"), "{m}");
    let other = ClusterSecret::from_bytes(b"not the cluster's secret at all").expect("secret");
    let m = refused(TcpKvSender::connect(addr, hs("p-bound", token), d, Some(&other)).await);
    assert!(m.contains("authentication"), "{m}");
    // With the secret, but from another prefill worker, or for a guessed token: refused.
    let m = refused(TcpKvSender::connect(addr, hs("p-other", token), d, Some(&secret)).await);
    assert!(m.contains("not waiting"), "{m}");
    let m = refused(TcpKvSender::connect(addr, hs("p-bound", ReservationToken::random()), d, Some(&secret)).await);
    assert!(m.contains("not waiting"), "{m}");
    // The reservation is untouched: at its deadline it recomputes here and completes.
    let started = Instant::now();
    let mut generated = 0;
    let mut finished = false;
    while let Some(ev) =
        tokio::time::timeout(Duration::from_secs(30), stream.message()).await.expect("in time").expect("ok")
    {
        if let Some(pb::work_event::Event::Tokens(t)) = ev.event {
            generated += t.token_ids.len();
            finished |= !t.finish_reason.is_empty();
        }
    }
    assert!(finished && generated == 6, "{generated} tokens, finished {finished}");
    assert!(started.elapsed() < Duration::from_secs(20));
    let log = c.decode[0].log_text();
    assert!(log.contains("unauthenticated internal call refused"), "{log}");
    assert!(log.contains("no KV within the deadline"), "{log}");
    // And the cluster still serves, with the real worker in place.
    let r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&completion(&p, false)).send().await;
    assert_eq!(r.expect("send").status().as_u16(), 200);
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
}

async fn refuses_to_start(dir: &Path, tag: &str, args: &[String]) {
    let mut p = Proc::spawn(dir, tag, args);
    let status = wait_exit(&mut p, Duration::from_secs(60)).await;
    assert!(!status.success(), "{tag} started:\n{}", p.log_text());
    let log = p.log_text();
    assert!(log.contains("refusing to bind 0.0.0.0 without a cluster secret"), "{tag}:\n{log}");
    assert!(log.contains("--cluster-secret-file") && log.contains("--insecure-cluster"), "{tag}:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_all_interfaces_needs_a_secret_or_insecure_cluster() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, _) = tiny(dir.path());
    let http = reqwest::Client::new();
    let secret = secret_file(dir.path(), "cluster.secret");
    let router = |extra: &[String]| {
        let mut a = strings(&["router", "--host", "0.0.0.0", "--model", model.to_str().expect("utf8")]);
        a.extend(strings(&["--grpc-port", "0", "--registry-port", &free_port().to_string()]));
        a.extend(extra.iter().cloned());
        a
    };
    let worker = |extra: &[String]| {
        let mut a = strings(&["worker", "--role", "decode", "--host", "0.0.0.0", "--router", "http://127.0.0.1:9"]);
        a.extend(model_args(&model));
        a.extend(extra.iter().cloned());
        a
    };
    refuses_to_start(dir.path(), "router-open", &router(&[])).await;
    refuses_to_start(dir.path(), "worker-open", &worker(&[])).await;
    let insecure = strings(&["--insecure-cluster"]);
    for (tag, args) in [
        ("router-insecure", router(&insecure)),
        ("router-secret", router(&secret_flags(&secret))),
        ("worker-insecure", worker(&insecure)),
        ("worker-secret", worker(&secret_flags(&secret))),
    ] {
        let mut p = Proc::spawn(dir.path(), tag, &args);
        wait_up(&mut p, &http).await;
        assert!(p.exited().is_none(), "{tag}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_replaces_its_old_entry_at_once_after_the_router_asks_its_url() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let secret = secret_file(dir.path(), "cluster.secret");
    let grpc = free_port().to_string();
    let mut decode_flags = secret_flags(&secret);
    decode_flags.extend(strings(&["--grpc-port", &grpc]));
    let p_flags = secret_flags(&secret);
    let p_flags: Vec<&str> = p_flags.iter().map(String::as_str).collect();
    let d_flags: Vec<&str> = decode_flags.iter().map(String::as_str).collect();
    // A long eject_after: the old entry is still live when the new process registers.
    let mut router_flags = p_flags.clone();
    router_flags.extend(["--eject-after-ms", "60000"]);
    let mut c = Cluster::start(dir.path(), &model, "1p1d.toml", &router_flags, &[p_flags], &[d_flags]).await;
    let before = c.workers().await;
    let old = before.iter().find(|w| w["role"] == "decode").expect("decode").clone();
    // The decode worker restarts on the same address: a new instance, a live old entry.
    drop(c.decode.remove(0));
    let mut args = strings(&["worker", "--role", "decode", "--router", &c.registry]);
    args.extend(model_args(&model));
    args.extend(decode_flags.iter().cloned());
    let mut restarted = Proc::spawn(dir.path(), "decode-restarted", &args);
    restarted.wait_healthy(&c.http).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let new = loop {
        let ws = c.workers().await;
        let decoders: Vec<&Value> = ws.iter().filter(|w| w["role"] == "decode").collect();
        if decoders.len() == 1 && decoders[0]["id"] != old["id"] {
            break decoders[0].clone();
        }
        assert!(Instant::now() < deadline, "the old entry was never replaced: {ws:?}\n{}", c.router.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(new["url"], old["url"], "same address");
    assert!(c.router.log_text().contains("a new instance serves a registered URL; replacing"));
    // Requests run on the new process.
    let p: Vec<u32> = (0..20u32).map(|j| (j * 7 + 1) % vocab).collect();
    let r = c.http.post(format!("{}/v1/completions", c.router.http)).json(&completion(&p, false)).send().await;
    assert_eq!(r.expect("send").status().as_u16(), 200);
    c.decode.push(restarted);
}
