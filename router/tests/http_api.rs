//! The OpenAI-compatible HTTP API over a fake engine and the tiny test tokenizer: response
//! shapes (streaming and not), sampling options, logprobs, stop strings, the auxiliary
//! endpoints and metrics.

mod common;

use common::{FakeConfig, MODEL, TestServer, eventually, metric_value};
use serde_json::{Value, json};
use std::time::Duration;

fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn completion_body(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk json")).collect()
}

#[tokio::test]
async fn chat_completion_has_openai_shape_and_usage() {
    let s = TestServer::default_start().await;
    let (status, body) = s.post("/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(body["model"], MODEL);
    assert!(body["created"].as_u64().expect("created") > 1_600_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().expect("content").is_empty());
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    // The prompt is the templated conversation: /tokenize with the same messages agrees.
    let (_, tok) = s.post("/tokenize", json!({"messages": [{"role": "user", "content": "Hello there"}]})).await;
    let usage = &body["usage"];
    assert_eq!(usage["prompt_tokens"], tok["count"], "{usage} vs {tok}");
    assert_eq!(usage["completion_tokens"], 8);
    assert_eq!(usage["total_tokens"], tok["count"].as_u64().expect("count") + 8);
    // Content parts are accepted as well as strings, and max_completion_tokens is an alias.
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}], "max_tokens": null, "max_completion_tokens": 8});
    let (status, body2) = s.post("/v1/chat/completions", chat_body(parts)).await;
    assert_eq!(status, 200, "{body2}");
    assert_eq!(body2["choices"][0]["message"], choice["message"]);
}

#[tokio::test]
async fn chat_stream_sends_role_first_then_content_then_finish_and_done() {
    let s = TestServer::default_start().await;
    let (_, full) = s.post("/v1/chat/completions", chat_body(json!({}))).await;
    let data = s.stream("/v1/chat/completions", chat_body(json!({"stream": true}))).await;
    let chunks = chunks(&data);
    assert!(chunks.len() >= 3, "{chunks:?}");
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id, "one id per response");
        assert!(c.get("usage").is_none(), "no usage field without include_usage: {c}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().expect("content"));
    let last = chunks.last().expect("last");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[tokio::test]
async fn include_usage_adds_a_final_usage_chunk_with_no_choices() {
    let s = TestServer::default_start().await;
    let body = chat_body(
        json!({"stream": true, "stream_options": {"include_usage": true}, "n": 2, "seed": 3, "temperature": 1.0}),
    );
    let chunks = chunks(&s.stream("/v1/chat/completions", body).await);
    let (last, rest) = chunks.split_last().expect("chunks");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 16, "two choices of 8 tokens: {last}");
    let prompt = last["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert_eq!(last["usage"]["total_tokens"], prompt + 16);
    assert!(rest.iter().all(|c| c["usage"].is_null() && c.get("usage").is_some()), "usage: null on the others");
    let finished: Vec<u64> = rest
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .map(|c| c["choices"][0]["index"].as_u64().expect("index"))
        .collect();
    assert_eq!(finished.len(), 2);
    assert!(finished.contains(&0) && finished.contains(&1));
}

#[tokio::test]
async fn n_fans_out_with_shared_prefix_and_distinct_seeds() {
    let s = TestServer::default_start().await;
    let (status, body) =
        s.post("/v1/chat/completions", chat_body(json!({"n": 3, "seed": 11, "temperature": 0.8}))).await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().expect("choices");
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().expect("i")).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_ne!(choices[0]["message"]["content"], choices[1]["message"]["content"], "seeds differ per child");
    assert_eq!(body["usage"]["completion_tokens"], 24);
    let submitted = s.engine.submitted();
    assert_eq!(submitted.len(), 3);
    assert_eq!(submitted[0].share_prefix_with, None);
    assert!(submitted[1].share_prefix_with.is_some());
    assert_eq!(submitted[1].share_prefix_with, submitted[2].share_prefix_with);
    assert_eq!(submitted.iter().map(|r| r.params.seed).collect::<Vec<_>>(), vec![Some(11), Some(12), Some(13)]);
    // Same seed, same output.
    let (_, again) = s.post("/v1/chat/completions", chat_body(json!({"n": 3, "seed": 11, "temperature": 0.8}))).await;
    assert_eq!(again["choices"], body["choices"]);
}

#[tokio::test]
async fn sampling_fields_reach_the_engine() {
    let s = TestServer::default_start().await;
    let extra = json!({
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 5, "stop_token_ids": [7],
        "min_tokens": 2, "ignore_eos": true, "logit_bias": {"20": 3.5}, "skip_special_tokens": false,
        "include_stop_str_in_output": true, "stop": ["zzz", "yyy"]
    });
    let (status, body) = s.post("/v1/completions", completion_body(extra)).await;
    assert_eq!(status, 200, "{body}");
    let p = &s.engine.submitted()[0].params;
    assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (0.7, 0.9, 20, 0.05));
    assert_eq!((p.repetition_penalty, p.presence_penalty, p.frequency_penalty), (1.1, 0.5, 0.25));
    assert_eq!((p.seed, p.min_tokens, p.max_tokens), (Some(5), 2, Some(6)));
    assert_eq!(p.stop_token_ids, vec![7]);
    assert_eq!(p.logit_bias, vec![(20, 3.5)]);
    assert!(p.ignore_eos && p.include_stop_str_in_output && !p.skip_special_tokens);
    assert_eq!(p.stop, vec!["zzz".to_owned(), "yyy".to_owned()]);
}

#[tokio::test]
async fn completions_accept_every_prompt_form() {
    let s = TestServer::default_start().await;
    let (_, tok) = s.post("/tokenize", json!({"prompt": "Once upon a time"})).await;
    let ids = tok["tokens"].clone();
    let (status, text) = s.post("/v1/completions", completion_body(json!({}))).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["object"], "text_completion");
    assert!(text["id"].as_str().expect("id").starts_with("cmpl-"));
    assert_eq!(text["usage"]["prompt_tokens"], tok["count"]);
    assert_eq!(text["choices"][0]["finish_reason"], "length");
    let (_, by_ids) = s.post("/v1/completions", completion_body(json!({"prompt": ids}))).await;
    assert_eq!(by_ids["choices"][0]["text"], text["choices"][0]["text"], "token-id prompt = text prompt");

    let (status, batch) =
        s.post("/v1/completions", completion_body(json!({"prompt": ["Once upon a time", "The end"], "n": 2}))).await;
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().expect("i")).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(choices[0]["text"], text["choices"][0]["text"], "index 0 is prompt 0, sample 0");
    assert_eq!(batch["usage"]["completion_tokens"], 24);

    let (status, lists) = s.post("/v1/completions", completion_body(json!({"prompt": [ids, [20, 21, 22]]}))).await;
    assert_eq!(status, 200, "{lists}");
    assert_eq!(lists["choices"].as_array().expect("choices").len(), 2);
    assert_eq!(lists["choices"][0]["text"], text["choices"][0]["text"]);
}

#[tokio::test]
async fn echo_prepends_the_prompt() {
    let s = TestServer::default_start().await;
    let (_, plain) = s.post("/v1/completions", completion_body(json!({}))).await;
    let (status, echoed) = s.post("/v1/completions", completion_body(json!({"echo": true}))).await;
    assert_eq!(status, 200, "{echoed}");
    let expected = format!("Once upon a time{}", plain["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(echoed["choices"][0]["text"], expected);
    let data = s.stream("/v1/completions", completion_body(json!({"echo": true, "stream": true}))).await;
    let streamed: String =
        chunks(&data).iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(streamed, expected);
}

#[tokio::test]
async fn completions_stream_matches_non_streaming() {
    let s = TestServer::default_start().await;
    let (_, full) = s.post("/v1/completions", completion_body(json!({}))).await;
    let body = completion_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let chunks = chunks(&s.stream("/v1/completions", body).await);
    let (last, rest) = chunks.split_last().expect("chunks");
    assert!(rest.iter().all(|c| c["object"] == "text_completion"));
    let text: String = rest.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, full["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(rest.last().expect("finish")["choices"][0]["finish_reason"], "length");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], full["usage"]);
}

#[tokio::test]
async fn chat_logprobs_have_token_bytes_and_top_alternatives() {
    let s = TestServer::default_start().await;
    let (status, body) = s.post("/v1/chat/completions", chat_body(json!({"logprobs": true, "top_logprobs": 3}))).await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), 8);
    let mut joined = String::new();
    for entry in content {
        let token = entry["token"].as_str().expect("token");
        joined.push_str(token);
        let bytes: Vec<u8> =
            entry["bytes"].as_array().expect("bytes").iter().map(|b| b.as_u64().expect("b") as u8).collect();
        assert_eq!(bytes, token.as_bytes());
        assert!(entry["logprob"].as_f64().expect("lp") < 0.0);
        let top = entry["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], entry["token"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    assert_eq!(joined, body["choices"][0]["message"]["content"].as_str().expect("content"));
    // Streaming carries the same logprobs, chunk by chunk.
    let data =
        s.stream("/v1/chat/completions", chat_body(json!({"logprobs": true, "top_logprobs": 3, "stream": true}))).await;
    let streamed: Vec<Value> = chunks(&data)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);
}

#[tokio::test]
async fn completion_logprobs_use_the_legacy_format() {
    let s = TestServer::default_start().await;
    let (status, body) = s.post("/v1/completions", completion_body(json!({"logprobs": 2}))).await;
    assert_eq!(status, 200, "{body}");
    let lp = &body["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), 6);
    assert_eq!(lp["token_logprobs"].as_array().expect("lps").len(), 6);
    let offsets: Vec<u64> =
        lp["text_offset"].as_array().expect("offsets").iter().map(|o| o.as_u64().expect("o")).collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    for (i, top) in lp["top_logprobs"].as_array().expect("top").iter().enumerate() {
        let map = top.as_object().expect("map");
        assert!(!map.is_empty() && map.len() <= 2);
        assert!(map.contains_key(tokens[i].as_str().expect("token")));
    }
    let joined: String = tokens.iter().filter_map(Value::as_str).collect::<Vec<_>>().concat();
    assert_eq!(joined, body["choices"][0]["text"].as_str().expect("text"));
}

#[tokio::test]
async fn stop_strings_truncate_and_abort_the_sequence() {
    let s = TestServer::default_start().await;
    let (_, full) = s.post("/v1/completions", completion_body(json!({"max_tokens": 30}))).await;
    let text = full["choices"][0]["text"].as_str().expect("text").to_owned();
    // A stop string from the middle of the greedy output.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    let start = chars.len() / 2;
    let stop: String = chars[start..start + 3].iter().collect();
    let before: String = text[..text.find(&stop).expect("stop in text")].to_owned();
    let (status, stopped) = s.post("/v1/completions", completion_body(json!({"max_tokens": 30, "stop": stop}))).await;
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(stopped["choices"][0]["text"], before.as_str());
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["stop_reason"], stop.as_str());
    assert!(stopped["usage"]["completion_tokens"].as_u64().expect("n") < 30);
    assert_eq!(s.engine.aborted().len(), 1, "the engine sequence was aborted at the stop string");
    // include_stop_str_in_output keeps it; streaming gives the same text.
    let (_, kept) = s
        .post(
            "/v1/completions",
            completion_body(json!({"max_tokens": 30, "stop": [stop], "include_stop_str_in_output": true})),
        )
        .await;
    assert_eq!(kept["choices"][0]["text"], format!("{before}{stop}"));
    let data =
        s.stream("/v1/completions", completion_body(json!({"max_tokens": 30, "stop": stop, "stream": true}))).await;
    let streamed: String =
        chunks(&data).iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(streamed, before);
    assert!(eventually(Duration::from_secs(2), || async { s.engine.live() == 0 }).await, "blocks freed");
}

#[tokio::test]
async fn eos_and_stop_tokens_finish_with_stop() {
    let s = TestServer::start(FakeConfig { eos_at: Some(3), ..Default::default() }, Default::default()).await;
    let (_, body) = s.post("/v1/completions", completion_body(json!({"max_tokens": 10}))).await;
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["choices"][0]["stop_reason"].is_null(), "EOS is not a stop_reason: {body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "EOS counts as a generated token");
    let (_, ignored) = s.post("/v1/completions", completion_body(json!({"max_tokens": 10, "ignore_eos": true}))).await;
    assert_eq!(ignored["choices"][0]["finish_reason"], "length");
    assert_eq!(ignored["usage"]["completion_tokens"], 10);
}

#[tokio::test]
async fn engine_failure_mid_request_is_a_500_or_an_error_event() {
    let s = TestServer::start(FakeConfig { fail_at: Some(2), ..Default::default() }, Default::default()).await;
    let (status, body) = s.post("/v1/completions", completion_body(json!({}))).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["type"], "server_error");
    let data = s.stream("/v1/chat/completions", chat_body(json!({"stream": true}))).await;
    let errors: Vec<Value> = chunks(&data).into_iter().filter(|c| c.get("error").is_some()).collect();
    assert_eq!(errors.len(), 1, "{data:?}");
    assert!(errors[0]["error"]["message"].as_str().expect("message").contains("fake failure"));
}

#[tokio::test]
async fn models_tokenize_detokenize_health() {
    let s = TestServer::default_start().await;
    let models: Value = s.get("/v1/models").await.json().await.expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["owned_by"], "baton");
    assert_eq!(models["data"][0]["max_model_len"], common::MAX_MODEL_LEN);

    let (status, tok) =
        s.post("/tokenize", json!({"model": MODEL, "prompt": "hello world", "return_token_strs": true})).await;
    assert_eq!(status, 200, "{tok}");
    let ids = tok["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tok["count"], ids.len());
    assert_eq!(tok["max_model_len"], common::MAX_MODEL_LEN);
    assert_eq!(tok["token_strs"].as_array().expect("strs").len(), ids.len());
    let (status, detok) = s.post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(status, 200, "{detok}");
    assert_eq!(detok["prompt"], "hello world");
    let (status, err) = s.post("/detokenize", json!({"tokens": [1_000_000]})).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("tokens")));
    let (status, err) = s.post("/tokenize", json!({})).await;
    assert_eq!(status, 400, "{err}");

    assert_eq!(s.get("/health").await.status().as_u16(), 200);
    s.engine.set_healthy(false);
    let r = s.get("/health").await;
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.expect("json");
    assert!(body["error"]["message"].is_string());
}

#[tokio::test]
async fn metrics_use_vllm_names_and_follow_requests() {
    let s = TestServer::default_start().await;
    let (status, _) = s.post("/v1/completions", completion_body(json!({}))).await;
    assert_eq!(status, 200);
    let r = s.get("/metrics").await;
    assert!(r.headers()["content-type"].to_str().expect("ct").starts_with("text/plain"));
    let text = r.text().await.expect("text");
    let l = format!("{{model_name=\"{MODEL}\"}}");
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "baton_kv_blocks_used",
        "baton_kv_blocks_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ] {
        assert!(metric_value(&text, &format!("{name}{l}")).is_some(), "{name} missing:\n{text}");
    }
    assert_eq!(metric_value(&text, &format!("vllm:generation_tokens_total{l}")), Some(6.0));
    assert_eq!(metric_value(&text, &format!("vllm:time_to_first_token_seconds_count{l}")), Some(1.0));
    assert_eq!(metric_value(&text, &format!("vllm:inter_token_latency_seconds_count{l}")), Some(5.0));
    assert_eq!(metric_value(&text, &format!("baton_kv_blocks_total{l}")), Some(1024.0));
    assert!(metric_value(&text, &format!("vllm:prompt_tokens_total{l}")).expect("prompt tokens") > 0.0);
}

/// Every token step makes a chunk, also when its text is empty for now (held back while it
/// may still begin a stop string): clients see each token arrive, as from vLLM. Steps that
/// queued up while the server was behind may share one chunk; none is lost.
#[tokio::test]
async fn streaming_sends_a_chunk_per_token_step_even_with_held_back_text() {
    // Steps far apart, so that the reader keeps up and chunks are steps.
    let config = FakeConfig { token_delay: Duration::from_millis(20), ..FakeConfig::default() };
    let s = TestServer::start(config, Default::default()).await;
    let (_, full) = s.post("/v1/completions", completion_body(json!({}))).await;
    let text = full["choices"][0]["text"].as_str().expect("text").to_owned();
    let (first, _) = text.split_at(text.char_indices().nth(1).map_or(text.len(), |(i, _)| i));
    // A stop string that begins with the whole output but never completes: every token's
    // text is held back until the end.
    let stop = format!("{text}\u{1}never");
    assert!(stop.starts_with(first));
    let body = completion_body(
        json!({"stream": true, "stop": [stop], "logprobs": 1, "stream_options": {"include_usage": true}}),
    );
    let chunks = chunks(&s.stream("/v1/completions", body).await);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    let completion_tokens = usage["completion_tokens"].as_u64().expect("count") as usize;
    let tokens_of = |c: &Value| c["choices"][0]["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
    let steps: Vec<&Value> =
        chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_null() && c["choices"][0].is_object()).collect();
    assert!(!steps.is_empty() && steps.len() <= completion_tokens, "{chunks:?}");
    assert!(steps.iter().all(|c| tokens_of(c) >= 1), "a chunk without a token step: {chunks:?}");
    assert_eq!(chunks.iter().map(tokens_of).sum::<usize>(), completion_tokens, "{chunks:?}");
    assert!(steps.iter().any(|c| c["choices"][0]["text"] == ""), "some token's text was held back");
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, text);
}
