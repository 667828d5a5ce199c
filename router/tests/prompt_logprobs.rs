//! Prompt logprobs over HTTP, against the fake engine (whose prompt logprobs are
//! `common::fake_prompt_logprobs`): `/v1/completions` `echo` + `logprobs` in OpenAI's legacy
//! shape (what lm-evaluation-harness parses), streamed and not, and vLLM's `prompt_logprobs` on
//! both endpoints.

mod common;

use common::{MODEL, TestServer, fake_prompt_logprobs};
use serde_json::{Value, json};

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0});
    body.as_object_mut().expect("obj").extend(extra.as_object().expect("obj").clone());
    body
}

/// The prompt token ids of the last request the engine received, and the `k` it asked for.
fn last_prompt(s: &TestServer) -> (Vec<u32>, Option<usize>) {
    let req = s.engine.submitted().pop().expect("a submitted request");
    (req.prompt_token_ids, req.params.prompt_logprobs)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk json")).collect()
}

#[tokio::test]
async fn echo_with_logprobs_lists_the_prompt_tokens_first() {
    let s = TestServer::default_start().await;
    let (_, plain) = s.post("/v1/completions", completion(json!({"logprobs": 2}))).await;
    let (status, body) = s.post("/v1/completions", completion(json!({"logprobs": 2, "echo": true}))).await;
    assert_eq!(status, 200, "{body}");
    let (prompt, asked) = last_prompt(&s);
    assert_eq!(asked, Some(2), "echo with logprobs asks the engine for the prompt's");
    let vocab = common::codec_parts().0.vocab_size();
    let want = fake_prompt_logprobs(&prompt, 2, vocab);
    let choice = &body["choices"][0];
    let generated = plain["choices"][0]["text"].as_str().expect("text");
    assert_eq!(choice["text"], format!("Once upon a time{generated}"));
    assert!(choice.get("prompt_logprobs").is_none(), "vLLM's field only when asked for");
    let lp = &choice["logprobs"];
    let n = prompt.len();
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), n + 3, "{lp}");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    for i in 1..n {
        let entry = want[i].as_ref().expect("fake entry");
        assert!((f(&lp["token_logprobs"][i]) - entry.logprob as f64).abs() < 1e-6, "entry {i}: {lp}");
        assert_eq!(lp["top_logprobs"][i].as_object().expect("top").len(), 2, "entry {i}");
    }
    // Then the generated tokens, as without echo; offsets run over every token's text.
    for key in ["tokens", "token_logprobs", "top_logprobs"] {
        assert_eq!(
            lp[key].as_array().expect(key)[n..],
            plain["choices"][0]["logprobs"][key].as_array().expect(key)[..]
        );
    }
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset, "offset {i}");
        offset += t.as_str().expect("token").chars().count();
    }

    // Streaming: the echo and the prompt's logprobs come with the first token, and the chunks
    // add up to the same text and logprobs.
    let data = s.stream("/v1/completions", completion(json!({"logprobs": 2, "echo": true, "stream": true}))).await;
    let chunks = chunks(&data);
    let first = &chunks[0]["choices"][0];
    assert!(first["text"].as_str().expect("text").starts_with("Once upon a time"), "{first}");
    assert_eq!(first["logprobs"]["tokens"].as_array().expect("tokens").len(), n + 1, "{first}");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, choice["text"].as_str().expect("text"));
    let mut streamed = Vec::new();
    for c in &chunks {
        if let Some(l) = c["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed.extend(l.iter().cloned());
        }
    }
    assert_eq!(&streamed, lp["token_logprobs"].as_array().expect("token_logprobs"));
}

/// lm-evaluation-harness's `local-completions` loglikelihood: context + continuation as token
/// ids, `echo`, `logprobs: 1`, `max_tokens: 1`; the continuation's logprob is the sum of
/// `token_logprobs[ctxlen:-1]` and it is greedy when each equals the best of its
/// `top_logprobs` (`lm_eval/models/openai_completions.py`, `parse_logprobs`).
#[tokio::test]
async fn lm_eval_loglikelihood_parsing_reads_the_continuation() {
    let s = TestServer::default_start().await;
    let context: Vec<u32> = vec![30, 31, 32, 33];
    let continuation: Vec<u32> = vec![40, 41, 42];
    let ids: Vec<u32> = context.iter().chain(&continuation).copied().collect();
    let body = json!({"model": MODEL, "prompt": [ids], "max_tokens": 1, "temperature": 0, "echo": true, "logprobs": 1, "seed": 1234});
    let (status, out) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{out}");
    let choice = &out["choices"][0];
    let ctxlen = context.len();
    let token_logprobs = choice["logprobs"]["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(token_logprobs.len(), ids.len() + 1, "the prompt's tokens then the generated one");
    let continuation_lps = &token_logprobs[ctxlen..token_logprobs.len() - 1];
    let sum: f64 = continuation_lps.iter().map(f).sum();
    let vocab = common::codec_parts().0.vocab_size();
    let want: f64 =
        fake_prompt_logprobs(&ids, 1, vocab)[ctxlen..].iter().map(|e| e.as_ref().expect("entry").logprob as f64).sum();
    assert!((sum - want).abs() < 1e-5, "{sum} vs {want}");
    let tops = &choice["logprobs"]["top_logprobs"].as_array().expect("top_logprobs")[ctxlen..token_logprobs.len() - 1];
    let is_greedy = continuation_lps.iter().zip(tops).all(|(tok, top)| {
        let best = top.as_object().expect("top").values().map(f).fold(f64::NEG_INFINITY, f64::max);
        f(tok) == best
    });
    // The fake engine's prompt tokens are each their position's best alternative.
    assert!(is_greedy, "{choice}");
}

#[tokio::test]
async fn vllm_prompt_logprobs_on_both_endpoints() {
    let s = TestServer::default_start().await;
    let vocab = common::codec_parts().0.vocab_size();
    // Completions, with echo + logprobs at a smaller count: each view keeps its own.
    let (status, body) =
        s.post("/v1/completions", completion(json!({"prompt_logprobs": 3, "echo": true, "logprobs": 1, "n": 2}))).await;
    assert_eq!(status, 200, "{body}");
    let (prompt, asked) = last_prompt(&s);
    assert_eq!(asked, Some(3), "the engine computes the larger count");
    let want = fake_prompt_logprobs(&prompt, 3, vocab);
    for choice in body["choices"].as_array().expect("choices") {
        let pl = choice["prompt_logprobs"].as_array().expect("prompt_logprobs");
        assert_eq!(pl.len(), prompt.len());
        assert!(pl[0].is_null());
        for (i, entry) in pl.iter().enumerate().skip(1) {
            let w = want[i].as_ref().expect("entry");
            let map = entry.as_object().expect("map");
            // The prompt token is one of the fake's alternatives (its first), so three keys.
            assert_eq!(map.len(), 3, "{entry}");
            let own = &map[&w.token_id.to_string()];
            assert!((f(&own["logprob"]) - w.logprob as f64).abs() < 1e-6);
            assert_eq!(own["rank"], w.rank);
            assert!(own["decoded_token"].is_string());
            let second = &map[&w.top[1].0.to_string()];
            assert_eq!(second["rank"], 2);
        }
        assert_eq!(choice["logprobs"]["top_logprobs"][1].as_object().expect("top").len(), 1);
    }
    // Streaming completions: in the first chunk of each choice only.
    let data = s.stream("/v1/completions", completion(json!({"prompt_logprobs": 0, "stream": true}))).await;
    let chunks = chunks(&data);
    let with: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0].get("prompt_logprobs").is_some()).collect();
    assert_eq!(with.len(), 1, "{chunks:?}");
    assert_eq!(with[0]["choices"][0]["prompt_logprobs"].as_array().expect("list").len(), prompt.len());

    // Chat: one list at the top of the response.
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1});
    let (status, body) = s.post("/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{body}");
    let pl = body["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(pl.len() as u64, body["usage"]["prompt_tokens"].as_u64().expect("usage"));
    assert!(pl[0].is_null() && pl[1].is_object(), "{body}");
    assert!(body["choices"][0].get("prompt_logprobs").is_none());
}
