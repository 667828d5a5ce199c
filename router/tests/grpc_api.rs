//! The public gRPC API over a fake engine: streaming generation, cancel and `Abort` freeing
//! blocks, validation statuses, and the info endpoints.

mod common;

use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::{
    AbortRequest, ChatInput, ChatMessage, GenerateRequest, HealthRequest, LoadsRequest, ModelInfoRequest,
    SamplingParams, TokenIds, generate_request::Input, generate_response::Response as Msg,
};
use baton_router::GrpcService;
use common::{FakeConfig, FakeEngine, MODEL, eventually, frontend};
use std::time::Duration;
use tonic::transport::Channel;

async fn start(config: FakeConfig) -> (FakeEngine, BatonClient<Channel>) {
    start_with_key(config, None).await
}

async fn start_with_key(config: FakeConfig, key: Option<&str>) -> (FakeEngine, BatonClient<Channel>) {
    let engine = FakeEngine::new(common::codec_parts().0.vocab_size(), config);
    let service = GrpcService::new(frontend(&engine)).into_server(key.map(baton_router::ApiKey::new));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .expect("serve")
    });
    let client = BatonClient::connect(format!("http://{addr}")).await.expect("connect");
    (engine, client)
}

fn text_request(id: &str, text: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        input: Some(Input::Text(text.into())),
        sampling: Some(SamplingParams { temperature: Some(0.0), max_tokens: Some(max_tokens), ..Default::default() }),
        add_special_tokens: None,
    }
}

#[tokio::test]
async fn generate_streams_chunks_then_complete() {
    let (_engine, mut client) = start(FakeConfig::default()).await;
    let mut stream = client.generate(text_request("r1", "Once upon a time", 5)).await.expect("generate").into_inner();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut completes = Vec::new();
    while let Some(m) = stream.message().await.expect("message") {
        assert_eq!(m.request_id, "r1");
        match m.response.expect("response") {
            Msg::Chunk(c) => {
                tokens.extend(c.token_ids);
                text.push_str(&c.text);
            }
            Msg::Complete(c) => completes.push(c),
            Msg::Error(e) => panic!("error {e:?}"),
        }
    }
    assert_eq!(tokens.len(), 5);
    assert_eq!(completes.len(), 1);
    assert_eq!(completes[0].finish_reason, "length");
    assert_eq!(completes[0].completion_tokens, 5);
    assert!(completes[0].prompt_tokens > 0);
    let (tokenizer, _) = common::codec_parts();
    assert_eq!(text, tokenizer.decode(&tokens, true).expect("decode"));

    // Token ids and chat inputs work too; n = 2 completes twice with logprobs.
    let ids = tokenizer.encode("Once upon a time", true).expect("encode");
    let mut req = text_request("", "", 5);
    req.input = Some(Input::TokenIds(TokenIds { ids }));
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut by_ids = String::new();
    while let Some(m) = stream.message().await.expect("message") {
        assert!(!m.request_id.is_empty(), "the server assigns an id");
        if let Some(Msg::Chunk(c)) = m.response {
            by_ids.push_str(&c.text);
        }
    }
    assert_eq!(by_ids, text);
    let mut req = text_request("chat", "", 3);
    req.input = Some(Input::Chat(ChatInput {
        messages: vec![ChatMessage { role: "user".into(), content: "hi".into() }],
        add_generation_prompt: true,
    }));
    req.sampling = Some(SamplingParams {
        n: Some(2),
        max_tokens: Some(3),
        logprobs: Some(2),
        seed: Some(1),
        ..Default::default()
    });
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut completes = Vec::new();
    let mut logprobs = 0;
    while let Some(m) = stream.message().await.expect("message") {
        match m.response.expect("response") {
            Msg::Chunk(c) => {
                logprobs += c.logprobs.len();
                assert!(c.logprobs.iter().all(|l| l.top.len() == 2));
            }
            Msg::Complete(c) => completes.push(c.index),
            Msg::Error(e) => panic!("error {e:?}"),
        }
    }
    completes.sort_unstable();
    assert_eq!(completes, vec![0, 1]);
    assert_eq!(logprobs, 6);
}

#[tokio::test]
async fn cancel_and_abort_free_blocks() {
    let config = FakeConfig { token_delay: Duration::from_millis(20), ..Default::default() };
    let (engine, mut client) = start(config).await;
    // Cancel: drop the stream after the first chunk.
    let mut stream = client.generate(text_request("c1", "a long one", 200)).await.expect("generate").into_inner();
    let first = stream.message().await.expect("message").expect("some");
    assert!(matches!(first.response, Some(Msg::Chunk(_))));
    assert_eq!(engine.live(), 1);
    drop(stream);
    assert!(eventually(Duration::from_secs(2), || async { engine.live() == 0 }).await, "cancel freed blocks");
    assert_eq!(engine.aborted().len(), 1);

    // Abort by id from another call: the stream completes with finish_reason "abort".
    let mut stream = client.generate(text_request("a1", "another long one", 200)).await.expect("generate").into_inner();
    let _ = stream.message().await.expect("message").expect("some");
    let found = client.abort(AbortRequest { request_id: "a1".into() }).await.expect("abort").into_inner();
    assert!(found.found);
    let mut reason = String::new();
    while let Some(m) = stream.message().await.expect("message") {
        if let Some(Msg::Complete(c)) = m.response {
            reason = c.finish_reason;
        }
    }
    assert_eq!(reason, "abort");
    assert!(eventually(Duration::from_secs(2), || async { engine.live() == 0 }).await, "abort freed blocks");
    let loads = client.loads(LoadsRequest {}).await.expect("loads").into_inner();
    assert_eq!(loads.num_used_blocks, 0);
    let missing = client.abort(AbortRequest { request_id: "a1".into() }).await.expect("abort").into_inner();
    assert!(!missing.found, "finished requests are forgotten");
}

#[tokio::test]
async fn bad_requests_get_statuses_and_info_endpoints_answer() {
    let (engine, mut client) = start(FakeConfig::default()).await;
    let mut no_input = text_request("x", "", 3);
    no_input.input = None;
    let err = client.generate(no_input).await.expect_err("no input");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let mut bad = text_request("x", "hi", 3);
    bad.sampling = Some(SamplingParams { temperature: Some(-1.0), ..Default::default() });
    let err = client.generate(bad).await.expect_err("bad temperature");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("temperature"), "{}", err.message());
    let err = client.generate(text_request("x", "hi", 100_000)).await.expect_err("too long");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let info = client.model_info(ModelInfoRequest {}).await.expect("info").into_inner();
    assert_eq!(info.model, MODEL);
    assert_eq!(info.max_model_len as usize, common::MAX_MODEL_LEN);
    assert_eq!(info.block_size as usize, common::BLOCK_SIZE);
    assert_eq!(info.device, "fake");
    let health = client.health(HealthRequest {}).await.expect("health").into_inner();
    assert!(health.healthy);
    engine.set_healthy(false);
    let health = client.health(HealthRequest {}).await.expect("health").into_inner();
    assert!(!health.healthy);
    let err = client.generate(text_request("x", "hi", 3)).await.expect_err("down");
    assert_eq!(err.code(), tonic::Code::Unavailable);
}

fn with_auth<T>(message: T, value: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", value.parse().expect("ascii"));
    r
}

#[tokio::test]
async fn an_api_key_guards_every_grpc_method() {
    let (_engine, mut client) = start_with_key(FakeConfig::default(), Some("sekret")).await;
    let unauthenticated = |r: Result<_, tonic::Status>| match r {
        Err(s) => s.code() == tonic::Code::Unauthenticated,
        Ok(_) => false,
    };
    assert!(unauthenticated(client.generate(text_request("a", "hi", 2)).await.map(|_| ())), "no metadata");
    assert!(unauthenticated(client.generate(with_auth(text_request("b", "hi", 2), "Bearer nope")).await.map(|_| ())));
    assert!(unauthenticated(client.health(HealthRequest {}).await.map(|_| ())));
    assert!(unauthenticated(client.model_info(with_auth(ModelInfoRequest {}, "Bearer sekre")).await.map(|_| ())));
    assert!(unauthenticated(client.abort(AbortRequest { request_id: "x".into() }).await.map(|_| ())));
    // The right key, with the scheme in any case, works.
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let mut stream = client
            .generate(with_auth(text_request(&format!("ok-{scheme}"), "hi", 3), &format!("{scheme} sekret")))
            .await
            .expect("authenticated generate")
            .into_inner();
        let mut tokens = 0;
        while let Some(m) = stream.message().await.expect("message") {
            if let Some(Msg::Chunk(c)) = m.response {
                tokens += c.token_ids.len();
            }
        }
        assert_eq!(tokens, 3, "{scheme}");
    }
    let info = client.model_info(with_auth(ModelInfoRequest {}, "Bearer sekret")).await.expect("info").into_inner();
    assert_eq!(info.model, MODEL);
}
