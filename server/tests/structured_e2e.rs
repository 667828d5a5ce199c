//! Structured outputs end to end over the public gRPC API (`structured_outputs` oneof): the
//! real `baton serve`, and a real 1P1D cluster (`baton router` + prefill and decode
//! `baton worker`s, TCP KV hand-off) on a tiny random model. A constrained request gives
//! the same tokens through 1P1D as through `serve` (the prefill worker's first token is
//! constrained too, and the decode worker's matcher starts from it), its output matches
//! the grammar, and a grammar that does not compile is INVALID_ARGUMENT naming it, from
//! `serve` and from the router alike.

mod common;

use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::generate_request::Input;
use baton_proto::v1::generate_response::Response as Msg;
use baton_proto::v1::sampling_params::StructuredOutputs;
use baton_proto::v1::{Choices, GenerateRequest, SamplingParams, TokenIds};
use common::*;
use serde_json::Value;

/// What a client sees of one generation: tokens, text, finish reason.
type Seen = (Vec<u32>, String, String);

async fn generate(
    url: &str,
    prompt: &[u32],
    structured: StructuredOutputs,
    seed: Option<u64>,
) -> Result<Seen, tonic::Status> {
    let mut client = BatonClient::connect(url.to_owned()).await.expect("connect gRPC");
    let request = GenerateRequest {
        request_id: String::new(),
        input: Some(Input::TokenIds(TokenIds { ids: prompt.to_vec() })),
        sampling: Some(SamplingParams {
            temperature: Some(if seed.is_some() { 1.0 } else { 0.0 }),
            seed,
            max_tokens: Some(200),
            structured_outputs: Some(structured),
            ..Default::default()
        }),
        add_special_tokens: None,
    };
    let mut stream = client.generate(request).await?.into_inner();
    let (mut tokens, mut text, mut finish) = (Vec::new(), String::new(), String::new());
    while let Some(m) = stream.message().await? {
        match m.response.expect("a response") {
            Msg::Chunk(c) => {
                tokens.extend(c.token_ids);
                text.push_str(&c.text);
            }
            Msg::Complete(c) => finish = c.finish_reason,
            Msg::Error(e) => panic!("in-stream error: {e:?}"),
        }
    }
    Ok((tokens, text, finish))
}

fn person_schema() -> String {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "none"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    })
    .to_string()
}

fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text:?}");
    assert!(v["age"].as_u64().is_some_and(|a| a <= 120), "{text:?}");
    assert!(["cat", "dog", "none"].contains(&v["pet"].as_str().unwrap_or("")), "{text:?}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_constrained_outputs_match_serve_over_grpc() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, vocab) = tiny(dir.path());
    let serve_grpc = free_port();
    let mut args: Vec<String> = vec!["serve".into(), "--grpc-port".into(), serve_grpc.to_string()];
    args.extend(model_args(&model));
    let mut serve = Proc::spawn(dir.path(), "serve", &args);
    let router_grpc = free_port().to_string();
    let c = Cluster::start(dir.path(), &model, "1p1d.toml", &["--grpc-port", &router_grpc], &[vec![]], &[vec![]]).await;
    serve.wait_healthy(&c.http).await;
    let (serve_url, router_url) = (format!("http://127.0.0.1:{serve_grpc}"), format!("http://127.0.0.1:{router_grpc}"));

    let choices = vec!["left".to_string(), "right".into(), "up \"high\"".into()];
    let cases: Vec<(StructuredOutputs, &str)> = vec![
        (StructuredOutputs::JsonSchema(person_schema()), "person"),
        (StructuredOutputs::Regex("[a-c]{2,4}-[0-9]{2}".into()), "regex"),
        (StructuredOutputs::Choice(Choices { choices: choices.clone() }), "choice"),
    ];
    for (i, (spec, what)) in cases.into_iter().enumerate() {
        for seed in [None, Some(11)] {
            // 17 and 40 tokens: a partial block and several, both handed off.
            for len in [17usize, 40] {
                let prompt: Vec<u32> = (0..len).map(|j| ((i * 7919 + j * 104_729 + 3) as u32) % vocab).collect();
                let want = generate(&serve_url, &prompt, spec.clone(), seed).await.expect("serve");
                let got = generate(&router_url, &prompt, spec.clone(), seed).await.expect("1P1D");
                let label = format!("{what}, seed {seed:?}, prompt of {len}");
                assert_eq!(got, want, "{label}: 1P1D differs from serve");
                assert_eq!(got.2, "stop", "{label}: {got:?}");
                match what {
                    "person" => assert_person(&got.1),
                    "regex" => {
                        let (head, tail) = got.1.split_once('-').unwrap_or_else(|| panic!("{label}: {got:?}"));
                        assert!((2..=4).contains(&head.len()) && head.chars().all(|c| ('a'..='c').contains(&c)));
                        assert!(tail.len() == 2 && tail.chars().all(|c| c.is_ascii_digit()), "{label}: {got:?}");
                    }
                    _ => assert!(choices.contains(&got.1), "{label}: {got:?}"),
                }
            }
        }
    }

    // A grammar that does not compile: INVALID_ARGUMENT naming structured_outputs and the kind.
    let bad = generate(&serve_url, &[1, 2, 3], StructuredOutputs::JsonSchema(r#"{"type": 7}"#.into()), None).await;
    let status = bad.expect_err("a bad schema is refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("structured_outputs json_schema"), "{status:?}");
    // Through 1P1D the decode worker refuses it when reserving; the router still answers
    // INVALID_ARGUMENT (not a worker failure).
    let bad = generate(&router_url, &[1, 2, 3], StructuredOutputs::Regex("(unclosed".into()), None).await;
    let status = bad.expect_err("a bad regex is refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("structured_outputs regex"), "{status:?}");
    let bad = generate(&serve_url, &[1, 2, 3], StructuredOutputs::JsonObject(false), None).await;
    assert_eq!(bad.expect_err("json_object: false").code(), tonic::Code::InvalidArgument);

    // The prefill worker handed KV off; nothing is left in use anywhere.
    let p = &c.prefill[0];
    let bytes = p.metric(&c.http, &format!("baton_kv_transfer_bytes_total{{model_name=\"{MODEL}\"}}")).await;
    assert!(bytes > 0.0, "the prefill worker moved no KV:\n{}", p.log_text());
    for w in c.all_workers() {
        w.assert_idle(&c.http).await;
    }
}
