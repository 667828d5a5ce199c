//! Per-request size limits (stop strings, `logit_bias`, `stop_token_ids`, prompts per
//! completions request): over a limit is a 400 naming the field on HTTP chat and
//! completions, and `INVALID_ARGUMENT` naming it on gRPC; at the limit is accepted. Nothing
//! over a limit reaches the engine.

mod common;

use baton_core::params::{MAX_LOGIT_BIAS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS};
use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::{GenerateRequest, SamplingParams, generate_request::Input};
use baton_router::GrpcService;
use baton_router::openai::completions::MAX_PROMPTS;
use common::{FakeConfig, FakeEngine, TestServer, frontend};
use serde_json::{Value, json};

/// `(field, value over its limit, value at its limit)`.
fn cases() -> Vec<(&'static str, Value, Value)> {
    let bias = |n: usize| Value::Object((0..n).map(|t| (t.to_string(), json!(1.0))).collect());
    vec![
        ("stop", json!(vec!["x"; MAX_STOP_STRINGS + 1]), json!(vec!["x"; MAX_STOP_STRINGS])),
        ("stop", json!(["s".repeat(MAX_STOP_STRING_BYTES + 1)]), json!(["s".repeat(MAX_STOP_STRING_BYTES)])),
        ("logit_bias", bias(MAX_LOGIT_BIAS + 1), bias(MAX_LOGIT_BIAS)),
        ("stop_token_ids", json!(vec![5; MAX_STOP_TOKEN_IDS + 1]), json!(vec![5; MAX_STOP_TOKEN_IDS])),
    ]
}

fn with_field(mut body: Value, field: &str, value: &Value) -> Value {
    body[field] = value.clone();
    body
}

#[tokio::test]
async fn http_refuses_each_oversized_field_by_name_and_accepts_the_limit() {
    let s = TestServer::default_start().await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let completion = json!({"prompt": "hi", "max_tokens": 2});
    for (path, body) in [("/v1/chat/completions", chat), ("/v1/completions", completion)] {
        for (field, over, at) in cases() {
            let (status, response) = s.post(path, with_field(body.clone(), field, &over)).await;
            assert_eq!(status, 400, "{path} {field}: {response}");
            assert_eq!(response["error"]["param"], field, "{path}: {response}");
            assert_eq!(response["error"]["type"], "invalid_request_error", "{response}");
            let message = response["error"]["message"].as_str().expect("message");
            assert!(message.contains("at most"), "{path} {field}: {message}");
            let (status, response) = s.post(path, with_field(body.clone(), field, &at)).await;
            assert_eq!(status, 200, "{path} {field} at the limit: {response}");
        }
    }
    let (status, response) =
        s.post("/v1/completions", json!({"prompt": vec!["hi"; MAX_PROMPTS + 1], "max_tokens": 1})).await;
    assert_eq!(status, 400, "{response}");
    assert_eq!(response["error"]["param"], "prompt", "{response}");
    let (status, response) =
        s.post("/v1/completions", json!({"prompt": vec![vec![5]; MAX_PROMPTS + 1], "max_tokens": 1})).await;
    assert_eq!((status, &response["error"]["param"]), (400, &json!("prompt")), "{response}");
    // Only the at-limit requests reached the engine: 2 endpoints × 4 cases.
    assert_eq!(s.engine.submitted().len(), 8);
    let submitted = s.engine.submitted();
    assert!(submitted.iter().all(|r| r.params.stop.len() <= MAX_STOP_STRINGS
        && r.params.logit_bias.len() <= MAX_LOGIT_BIAS
        && r.params.stop_token_ids.len() <= MAX_STOP_TOKEN_IDS));
}

#[tokio::test]
async fn grpc_refuses_each_oversized_field_by_name() {
    let engine = FakeEngine::new(common::codec_parts().0.vocab_size(), FakeConfig::default());
    let service = GrpcService::new(frontend(&engine)).into_server(None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .expect("serve")
    });
    let mut client = BatonClient::connect(format!("http://{addr}")).await.expect("connect");
    let request = |sampling: SamplingParams| GenerateRequest {
        request_id: String::new(),
        input: Some(Input::Text("hi".into())),
        sampling: Some(SamplingParams { max_tokens: Some(2), ..sampling }),
        add_special_tokens: None,
    };
    let over: Vec<(&str, SamplingParams)> = vec![
        ("stop", SamplingParams { stop: vec!["x".into(); MAX_STOP_STRINGS + 1], ..Default::default() }),
        ("stop", SamplingParams { stop: vec!["s".repeat(MAX_STOP_STRING_BYTES + 1)], ..Default::default() }),
        (
            "logit_bias",
            SamplingParams {
                logit_bias: (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect(),
                ..Default::default()
            },
        ),
        ("stop_token_ids", SamplingParams { stop_token_ids: vec![5; MAX_STOP_TOKEN_IDS + 1], ..Default::default() }),
    ];
    for (field, sampling) in over {
        let err = client.generate(request(sampling)).await.expect_err(field);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().contains(field) && err.message().contains("at most"), "{field}: {}", err.message());
    }
    assert!(engine.submitted().is_empty(), "nothing over a limit reached the engine");
    let at_limit = SamplingParams {
        stop: vec!["x".into(); MAX_STOP_STRINGS],
        logit_bias: (0..MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect(),
        stop_token_ids: vec![5; MAX_STOP_TOKEN_IDS],
        ..Default::default()
    };
    let mut stream = client.generate(request(at_limit)).await.expect("at the limits").into_inner();
    while stream.message().await.expect("message").is_some() {}
    assert_eq!(engine.submitted().len(), 1);
}
