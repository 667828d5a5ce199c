//! Bad input, authentication, overload and disconnects: every failure has the OpenAI error
//! shape and the right status, nothing leaks in the engine, and the server keeps serving.

mod common;

use baton_router::HttpConfig;
use common::{FakeConfig, MODEL, TestServer, eventually};
use serde_json::{Value, json};
use std::time::Duration;

fn assert_error_shape(body: &Value) {
    let err = body["error"].as_object().unwrap_or_else(|| panic!("no error object in {body}"));
    for key in ["message", "type", "param", "code"] {
        assert!(err.contains_key(key), "{key} missing in {body}");
    }
    assert!(!err["message"].as_str().expect("message").is_empty());
}

async fn expect_error(s: &TestServer, path: &str, body: Value, status: u16, param: Option<&str>) -> Value {
    let (got, response) = s.post(path, body.clone()).await;
    assert_eq!(got, status, "{body} -> {response}");
    assert_error_shape(&response);
    if let Some(p) = param {
        assert_eq!(response["error"]["param"], p, "{body} -> {response}");
    }
    response
}

async fn still_serving(s: &TestServer) {
    let body = json!({"prompt": "still alive?", "max_tokens": 2});
    let (status, response) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{response}");
    assert!(eventually(Duration::from_secs(2), || async { s.engine.live() == 0 }).await, "nothing leaked");
}

#[tokio::test]
async fn malformed_json_wrong_types_and_missing_fields_are_400() {
    let s = TestServer::default_start().await;
    for (path, raw) in [
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "hi"}"#),
        ("/v1/completions", "not json at all"),
        ("/v1/completions", ""),
    ] {
        let r = s.post_raw(path, raw).await;
        assert_eq!(r.status().as_u16(), 400, "{raw}");
        let body: Value = r.json().await.expect("json");
        assert_error_shape(&body);
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    let chat = "/v1/chat/completions";
    expect_error(&s, chat, json!({"model": MODEL}), 400, Some("messages")).await;
    expect_error(&s, chat, json!({"messages": []}), 400, Some("messages")).await;
    expect_error(&s, chat, json!({"messages": "hello"}), 400, Some("messages")).await;
    expect_error(
        &s,
        chat,
        json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
        400,
        Some("temperature"),
    )
    .await;
    expect_error(&s, chat, json!({"messages": [{"role": 1, "content": "hi"}]}), 400, Some("messages[0].role")).await;
    expect_error(
        &s,
        chat,
        json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        400,
        Some("messages[0].content[0]"),
    )
    .await;
    expect_error(&s, "/v1/completions", json!({"max_tokens": 3}), 400, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": []}), 400, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": ""}), 400, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": [1, -2]}), 400, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": [5, 1_000_000]}), 400, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": "x", "stream": "yes"}), 400, Some("stream")).await;
    still_serving(&s).await;
}

#[tokio::test]
async fn fields_the_server_does_not_honour_are_400s_naming_them() {
    // An agent that sends tools or a response format must never get a 200 of free text.
    let s = TestServer::default_start().await;
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let tool = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    for (body, param, words) in [
        // Tools with `auto` (the default) need a tool-call parser, which this server lacks.
        (json!({"messages": msgs, "tools": tool}), "tool_choice", "--enable-auto-tool-choice"),
        (json!({"messages": msgs, "tool_choice": "required"}), "tool_choice", "non-empty `tools`"),
        (
            json!({"messages": msgs, "tools": tool, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
            "not in `tools`",
        ),
        (json!({"messages": msgs, "functions": [{"name": "f"}]}), "functions", "use `tools`"),
        (
            json!({"messages": msgs, "guided_regex": "a", "guided_decoding_backend": "x"}),
            "guided_decoding_backend",
            "llguidance",
        ),
        (json!({"messages": msgs, "max_tokens": 3, "mystery_knob": 7}), "mystery_knob", "mystery_knob"),
        (json!({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}), "messages[0].name", "name"),
    ] {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let response = expect_error(&s, chat, body, 400, Some(param)).await;
            let message = response["error"]["message"].as_str().expect("message");
            assert!(message.contains(param) && message.contains(words), "{message}");
        }
    }
    expect_error(&s, "/v1/completions", json!({"prompt": "a", "tool_choice": "auto"}), 400, Some("tool_choice")).await;
    // Prompt logprobs are served, but not as a chat stream (as vLLM), and within the top-k cap.
    let body = json!({"messages": msgs, "prompt_logprobs": 1, "stream": true});
    expect_error(&s, chat, body, 400, Some("prompt_logprobs")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": "a", "prompt_logprobs": 21}), 400, Some("prompt_logprobs"))
        .await;
    // Values that ask for what the server does anyway, and nulls, are served.
    let body = json!({"messages": msgs, "max_tokens": 2, "tools": null, "tool_choice": "none",
        "response_format": {"type": "text"}, "user": "u-1"});
    let (status, response) = s.post(chat, body).await;
    assert_eq!(status, 200, "{response}");
    still_serving(&s).await;
}

#[tokio::test]
async fn out_of_range_sampling_values_name_their_param() {
    let s = TestServer::default_start().await;
    let cases = [
        (json!({"temperature": -0.5}), "temperature"),
        (json!({"temperature": 1e9}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"max_tokens": -1}), "max_tokens"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"n": 0}), "n"),
        (json!({"n": 100000}), "n"),
        (json!({"presence_penalty": 5}), "presence_penalty"),
        (json!({"top_k": -7}), "top_k"),
        (json!({"min_p": 2}), "min_p"),
        (json!({"logprobs": 50}), "logprobs"),
        (json!({"logit_bias": {"not-a-token": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 1000}}), "logit_bias"),
        (json!({"stop": ["ok", ""]}), "stop"),
        (json!({"stop_token_ids": [99999999]}), "stop_token_ids"),
        (json!({"prompt_logprobs": -1}), "prompt_logprobs"),
        (json!({"echo": true, "logprobs": 21}), "logprobs"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"prompt": "hi", "max_tokens": 4});
        body.as_object_mut().expect("obj").extend(extra.as_object().expect("obj").clone());
        expect_error(&s, "/v1/completions", body, 400, Some(param)).await;
    }
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().expect("obj").extend(extra.as_object().expect("obj").clone());
        body
    };
    expect_error(&s, "/v1/chat/completions", chat(json!({"top_logprobs": 3})), 400, Some("top_logprobs")).await;
    expect_error(
        &s,
        "/v1/chat/completions",
        chat(json!({"logprobs": true, "top_logprobs": 21})),
        400,
        Some("top_logprobs"),
    )
    .await;
    expect_error(
        &s,
        "/v1/chat/completions",
        chat(json!({"max_completion_tokens": -3})),
        400,
        Some("max_completion_tokens"),
    )
    .await;
    assert!(s.engine.submitted().is_empty(), "no bad request reached the engine");
    still_serving(&s).await;
}

#[tokio::test]
async fn prompt_plus_max_tokens_over_the_context_names_both_lengths() {
    let s = TestServer::default_start().await;
    let (_, tok) = s.post("/tokenize", json!({"prompt": "a rather long prompt"})).await;
    let prompt_len = tok["count"].as_u64().expect("count");
    let max_tokens = common::MAX_MODEL_LEN as u64;
    let body = json!({"prompt": "a rather long prompt", "max_tokens": max_tokens});
    let err = expect_error(&s, "/v1/completions", body, 400, Some("max_tokens")).await;
    let message = err["error"]["message"].as_str().expect("message");
    assert!(message.contains(&prompt_len.to_string()), "{message}");
    assert!(message.contains(&max_tokens.to_string()), "{message}");
    assert!(message.contains(&common::MAX_MODEL_LEN.to_string()), "{message}");
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    // A prompt that alone fills the context, with no max_tokens.
    let long: Vec<u32> = (0..common::MAX_MODEL_LEN as u32).map(|i| 20 + i % 50).collect();
    expect_error(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "abc def ghi ".repeat(300)}]}),
        400,
        Some("max_tokens"),
    )
    .await;
    expect_error(&s, "/v1/completions", json!({"prompt": long}), 400, Some("max_tokens")).await;
    still_serving(&s).await;
}

#[tokio::test]
async fn unknown_model_is_404_model_not_found() {
    let s = TestServer::default_start().await;
    for (path, body) in [
        ("/v1/chat/completions", json!({"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]})),
        ("/v1/completions", json!({"model": "gpt-17", "prompt": "x"})),
    ] {
        let err = expect_error(&s, path, body, 404, Some("model")).await;
        assert_eq!(err["error"]["code"], "model_not_found");
        assert!(err["error"]["message"].as_str().expect("m").contains("gpt-17"));
    }
    let r = s.get("/v1/nope").await;
    assert_eq!(r.status().as_u16(), 404);
    assert_error_shape(&r.json().await.expect("json"));
    let r = s.get("/v1/completions").await;
    assert_eq!(r.status().as_u16(), 405);
    assert_error_shape(&r.json().await.expect("json"));
    still_serving(&s).await;
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let s = TestServer::start(FakeConfig::default(), HttpConfig { max_body_bytes: 1024, ..Default::default() }).await;
    let big = json!({"prompt": "y".repeat(4096), "max_tokens": 1}).to_string();
    let r = s.post_raw("/v1/completions", big).await;
    assert_eq!(r.status().as_u16(), 413);
    let body: Value = r.json().await.expect("json");
    assert_error_shape(&body);
    assert_eq!(body["error"]["code"], "request_too_large");
    still_serving(&s).await;
}

#[tokio::test]
async fn full_queue_is_429_with_retry_after() {
    let config = FakeConfig { capacity: 1, token_delay: Duration::from_millis(30), ..Default::default() };
    let s = TestServer::start(config, Default::default()).await;
    // Occupy the only slot with a slow streaming request.
    let busy = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"prompt": "busy", "max_tokens": 200, "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(busy.status().as_u16(), 200);
    let r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"prompt": "x", "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let body: Value = r.json().await.expect("json");
    assert_error_shape(&body);
    // n=2 where the second child is refused: the first is aborted, nothing leaks.
    drop(busy);
    assert!(eventually(Duration::from_secs(2), || async { s.engine.live() == 0 }).await);
    let (status, _) = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 2, "n": 2})).await;
    assert_eq!(status, 429);
    assert!(eventually(Duration::from_secs(2), || async { s.engine.live() == 0 }).await, "first child aborted");
    still_serving(&s).await;
}

#[tokio::test]
async fn api_key_guards_v1_tokenize_and_detokenize_but_not_health_or_metrics() {
    let config = HttpConfig { api_key: Some("sekret".into()), ..Default::default() };
    let s = TestServer::start(FakeConfig::default(), config).await;
    let body = json!({"prompt": "x", "max_tokens": 2});
    let url = format!("{}/v1/completions", s.url);
    let r = s.client.post(&url).json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let err: Value = r.json().await.expect("json");
    assert_error_shape(&err);
    assert_eq!(err["error"]["code"], "invalid_api_key");
    let r = s.client.post(&url).bearer_auth("wrong").json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let r = s.client.post(&url).bearer_auth("sekret").json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    // The scheme is case-insensitive.
    let r = s.client.post(&url).header("authorization", "bearer sekret").json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let r = s.client.post(&url).header("authorization", "BEARER sekret").json(&body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let r = s.client.get(format!("{}/v1/models", s.url)).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 401);
    for (path, body) in [("/tokenize", json!({"prompt": "hello"})), ("/detokenize", json!({"tokens": [20, 21]}))] {
        let r = s.client.post(format!("{}{path}", s.url)).json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{path} without the key");
        let err: Value = r.json().await.expect("json");
        assert_error_shape(&err);
        let r = s.client.post(format!("{}{path}", s.url)).bearer_auth("nope").json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{path} with a wrong key");
        let r = s.client.post(format!("{}{path}", s.url)).bearer_auth("sekret").json(&body).send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200, "{path} with the key");
    }
    assert_eq!(s.get("/health").await.status().as_u16(), 200);
    assert_eq!(s.get("/metrics").await.status().as_u16(), 200);
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_and_frees_blocks() {
    let config = FakeConfig { token_delay: Duration::from_millis(20), ..Default::default() };
    let s = TestServer::start(config, Default::default()).await;
    let used = r#"baton_kv_blocks_used{model_name="tiny-test"}"#;
    let mut r = s
        .client
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&json!({"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 200, "stream": true, "n": 2}))
        .send()
        .await
        .expect("send");
    // Read until real content arrived, so the request is surely running.
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 4 {
        let chunk = r.chunk().await.expect("read").expect("more data");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(s.metric(used).await.expect("blocks used") > 0.0);
    drop(r);
    assert!(
        eventually(Duration::from_secs(2), || async { s.metric(used).await == Some(0.0) }).await,
        "blocks freed after disconnect"
    );
    assert_eq!(s.engine.aborted().len(), 2, "both choices aborted");
    // A non-streaming request whose client gives up is aborted too.
    let slow = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .timeout(Duration::from_millis(200))
        .json(&json!({"prompt": "x", "max_tokens": 200}))
        .send()
        .await;
    assert!(slow.is_err(), "timed out");
    assert!(eventually(Duration::from_secs(2), || async { s.metric(used).await == Some(0.0) }).await);
    assert_eq!(s.engine.aborted().len(), 3);
    still_serving(&s).await;
}
