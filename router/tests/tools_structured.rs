//! Structured outputs and tool calling over HTTP against the fake engine: each constraint
//! field reaches the engine as its grammar, bad grammars and tool fields are 400s naming the
//! field (with nothing submitted), and model output in a tool-call format comes back as
//! `tool_calls` (non-streaming and as OpenAI's deltas) with `finish_reason: "tool_calls"`.

mod common;

use baton_core::structured::GrammarSpec;
use baton_router::HttpConfig;
use baton_router::openai::tools::choice::ToolConfig;
use baton_router::openai::tools::{ReasoningParser, ToolCallParser};
use common::{FakeConfig, TestServer, codec_parts};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn msgs() -> Value {
    json!([{"role": "user", "content": "weather in Paris?"}])
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    ])
}

/// A server whose model writes `text` and then stops.
async fn scripted(text: &str, tools: ToolConfig) -> TestServer {
    let script = codec_parts().0.encode(text, false).expect("encode");
    TestServer::start(
        FakeConfig { script: Some(script), ..FakeConfig::default() },
        HttpConfig { tools, ..HttpConfig::default() },
    )
    .await
}

#[tokio::test]
async fn constraint_fields_reach_the_engine_as_grammars() {
    let s = TestServer::default_start().await;
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
    let cases = [
        (
            CHAT,
            json!({"messages": msgs(), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
            GrammarSpec::JsonSchema(schema.to_string()),
        ),
        (CHAT, json!({"messages": msgs(), "response_format": {"type": "json_object"}}), GrammarSpec::JsonObject),
        (
            CHAT,
            json!({"messages": msgs(), "structured_outputs": {"regex": "[ab]+"}}),
            GrammarSpec::Regex("[ab]+".into()),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_choice": ["yes", "no"]}),
            GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
        ),
        ("/v1/completions", json!({"prompt": "x", "guided_json": schema}), GrammarSpec::JsonSchema(schema.to_string())),
    ];
    for (path, mut body, spec) in cases {
        body["max_tokens"] = json!(2);
        let (status, response) = s.post(path, body.clone()).await;
        assert_eq!(status, 200, "{body} -> {response}");
        let submitted = s.engine.submitted();
        assert_eq!(submitted.last().expect("submitted").params.structured, Some(spec), "{body}");
    }
    // Forced calls: a list of {name, parameters} for `required`, the parameters for a name.
    let body = json!({"messages": msgs(), "tools": weather_tools(), "tool_choice": "required",
        "parallel_tool_calls": false, "max_tokens": 2});
    let (status, response) = s.post(CHAT, body).await;
    assert_eq!(status, 200, "{response}");
    let params = s.engine.submitted().last().expect("submitted").params.clone();
    let Some(GrammarSpec::JsonSchema(schema)) = params.structured else { panic!("{:?}", params.structured) };
    let schema: Value = serde_json::from_str(&schema).expect("json");
    assert_eq!(schema["maxItems"], 1);
    assert_eq!(schema["items"]["anyOf"][1]["properties"]["name"]["enum"], json!(["get_weather"]));
    assert!(!params.skip_special_tokens, "tool markers are special tokens in most families");
    let body = json!({"messages": msgs(), "tools": weather_tools(), "max_tokens": 2,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    assert_eq!(s.post(CHAT, body).await.0, 200);
    let spec = s.engine.submitted().last().expect("submitted").params.structured.clone();
    assert_eq!(spec, Some(GrammarSpec::JsonSchema(weather_tools()[1]["function"]["parameters"].to_string())));
}

#[tokio::test]
async fn bad_grammars_and_tool_fields_are_400s_naming_the_field() {
    let s = TestServer::default_start().await;
    let bad_schema = json!({"type": "object", "properties": {"a": {"type": "frobnicate"}}});
    let mut broken_tools = weather_tools();
    broken_tools[1]["function"]["parameters"] = bad_schema.clone();
    let cases = [
        (
            CHAT,
            json!({"messages": msgs(), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}}),
            "response_format",
        ),
        (CHAT, json!({"messages": msgs(), "guided_regex": "(unclosed"}), "guided_regex"),
        (
            CHAT,
            json!({"messages": msgs(), "structured_outputs": {"grammar": "start: ???"}}),
            "structured_outputs.grammar",
        ),
        ("/v1/completions", json!({"prompt": "x", "guided_json": bad_schema}), "guided_json"),
        (
            CHAT,
            json!({"messages": msgs(), "tools": broken_tools, "tool_choice": "required"}),
            "tools[1].function.parameters",
        ),
        (
            CHAT,
            json!({"messages": msgs(), "tools": broken_tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            "tools[1].function.parameters",
        ),
        (
            CHAT,
            json!({"messages": msgs(), "tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}),
            "tool_choice",
        ),
        (CHAT, json!({"messages": msgs(), "tools": weather_tools(), "tool_choice": "auto"}), "tool_choice"),
        (
            CHAT,
            json!({"messages": msgs(), "response_format": {"type": "json_object"}, "guided_choice": ["a"]}),
            "guided_choice",
        ),
        (
            CHAT,
            json!({"messages": msgs(), "tools": weather_tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            CHAT,
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ];
    for (path, body, param) in cases {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let (status, response) = s.post(path, body.clone()).await;
            assert_eq!(status, 400, "{body} -> {response}");
            assert_eq!(response["error"]["param"], param, "{body} -> {response}");
            assert!(
                response["error"]["message"]
                    .as_str()
                    .expect("message")
                    .contains(param.split('.').next().expect("head"))
            );
        }
    }
    assert!(s.engine.submitted().is_empty(), "nothing reached the engine");
}

#[tokio::test]
async fn tool_calls_come_back_whole_and_as_deltas() {
    let hermes = ToolConfig {
        enable_auto_tool_choice: true,
        tool_call_parser: Some(ToolCallParser::Hermes),
        reasoning_parser: None,
    };
    let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let s = scripted(text, hermes).await;
    // The conversation may carry earlier calls and their results.
    let history = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    ]);
    let body = json!({"messages": history, "tools": weather_tools(), "max_tokens": 200});
    let (status, response) = s.post(CHAT, body.clone()).await;
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{response}");
    assert_eq!(choice["message"]["content"], "Checking.");
    let calls = choice["message"]["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().expect("id").starts_with("call_"));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("text")).expect("json");
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(calls[1]["function"]["name"], "get_time");

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = s.stream(CHAT, streamed).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut content, mut names, mut arguments, mut ids) =
        (String::new(), Vec::new(), Vec::<String>::new(), Vec::new());
    for chunk in &chunks {
        let delta = &chunk["choices"][0]["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().expect("index") as usize;
            if let Some(name) = call["function"]["name"].as_str() {
                assert_eq!(index, names.len(), "a call's first delta carries its name, in order");
                assert_eq!(call["type"], "function");
                ids.push(call["id"].as_str().expect("id on the first delta").to_owned());
                names.push(name.to_owned());
                arguments.push(String::new());
            } else {
                assert!(call.get("id").is_none() && call.get("type").is_none(), "{call}");
            }
            arguments[index].push_str(call["function"]["arguments"].as_str().expect("arguments"));
        }
    }
    assert_eq!(content, "Checking.");
    assert_eq!(names, ["get_weather", "get_time"]);
    assert_eq!(serde_json::from_str::<Value>(&arguments[0]).expect("json"), json!({"city": "Paris"}));
    assert_eq!(arguments[1], "{}");
    assert!(ids.iter().all(|id| id.starts_with("call_")));
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert!(!s.engine.submitted()[0].params.skip_special_tokens);
}

#[tokio::test]
async fn reasoning_is_split_from_the_answer() {
    let qwen3 = ToolConfig { reasoning_parser: Some(ReasoningParser::Qwen3), ..ToolConfig::default() };
    let s = scripted("<think>\nTwo and two.\n</think>\n\nFour.", qwen3).await;
    let body = json!({"messages": msgs(), "max_tokens": 100});
    let (status, response) = s.post(CHAT, body.clone()).await;
    assert_eq!(status, 200, "{response}");
    let message = &response["choices"][0]["message"];
    assert_eq!(
        (message["reasoning_content"].as_str(), message["content"].as_str()),
        (Some("Two and two.\n"), Some("Four."))
    );
    assert_eq!(response["choices"][0]["finish_reason"], "stop");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream(CHAT, streamed).await;
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).expect("chunk");
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("Two and two.\n", "Four."));
    // `enable_thinking: false` turns the parser off (the template gets the flag too).
    let mut off = body;
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (_, response) = s.post(CHAT, off).await;
    assert!(response["choices"][0]["message"].get("reasoning_content").is_none(), "{response}");
    assert!(response["choices"][0]["message"]["content"].as_str().expect("content").starts_with("<think>"));
}
