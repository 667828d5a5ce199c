//! The request-field audit: every field of a generation request is either honoured or refused.
//!
//! OpenAI and vLLM ignore fields they do not know. For an agent that is worse than an error: a
//! `tools` or `response_format` that is dropped turns into a 200 with free text, which reads as
//! "the model declined". So Baton checks each body against the fields it honours, per endpoint,
//! before anything else, and answers any other field with a 400 that names it (`param` is the
//! field's path, e.g. `functions` or `messages[2].name`).
//!
//! Invariants:
//! - a field set to `null` is the same as an absent field (clients serialise unset options as
//!   `null`), so it is never refused;
//! - a field whose value asks for the behaviour Baton has anyway is accepted (`response_format:
//!   {"type": "text"}` or `tool_choice: "none"` on `/v1/completions`, an empty `tools` or
//!   `functions` list, `logprobs: false`), because honouring it takes nothing;
//! - every other field outside the lists below is refused, known to OpenAI or not.
//!
//! The lists name what the endpoint's handler reads ([`super::protocol`]); a field added there
//! must be added here, which `every_parsed_field_is_listed` checks.

use super::error::ApiError;
use serde_json::{Map, Value};

/// Fields both generation endpoints honour ([`super::protocol::SamplingFields`]), plus `user`:
/// OpenAI defines it as an end-user id for the provider's abuse monitoring, with no effect on
/// the output, so there is nothing in it for a self-hosted server to act on (vLLM accepts it
/// the same way); refusing it would break clients that always send it.
const SAMPLING_FIELDS: &[&str] = &[
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "stream",
    "stream_options",
    "model",
    "user",
    "prompt_logprobs",
];

/// Output constraints both endpoints honour ([`super::protocol::StructuredFields`]).
const STRUCTURED_FIELDS: &[&str] =
    &["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"];

/// Fields only `/v1/chat/completions` honours ([`super::protocol::ChatCompletionRequest`]).
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
];

/// Fields only `/v1/completions` honours ([`super::protocol::CompletionRequest`]); `best_of`
/// and `suffix` are read so that values other than the defaults get their own message.
const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo", "add_special_tokens", "best_of", "suffix"];

/// Fields of one chat message Baton honours.
const MESSAGE_FIELDS: &[&str] = &["role", "content", "tool_calls", "tool_call_id"];

/// Fields of one content part (the handler refuses parts that are not `text`).
const CONTENT_PART_FIELDS: &[&str] = &["type", "text"];

/// Fields of `stream_options`.
const STREAM_OPTION_FIELDS: &[&str] = &["include_usage"];

/// Which generation endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

fn unsupported(param: String, why: &str) -> ApiError {
    ApiError::bad_request(Some(param.clone()), format!("Unsupported parameter `{param}`: {why}"))
}

/// Why a field Baton does not honour is refused, for the fields clients are likely to send.
fn reason(field: &str) -> &'static str {
    match field {
        "functions" | "function_call" => {
            "the deprecated function-calling fields are not supported; use `tools` and `tool_choice`"
        }
        "tools" | "tool_choice" | "parallel_tool_calls" => "tool calling is a chat feature: use /v1/chat/completions",
        "guided_decoding_backend" => "the grammar engine is fixed (llguidance); send the request without it",
        "guided_whitespace_pattern" => {
            "whitespace in structured output follows the grammar; a custom pattern is not supported"
        }
        "chat_template" => "custom chat templates are not supported; `chat_template_kwargs` is",
        "reasoning_effort" => "this server has no reasoning-effort control",
        "name" => "participant names are not passed to the chat template",
        "continuous_usage_stats" => "usage is sent only in the final chunk",
        _ => "this server does not honour it",
    }
}

/// Whether `value` asks for what Baton does anyway (see the module's invariants).
fn is_default(field: &str, value: &Value) -> bool {
    match (field, value) {
        (_, Value::Null) => true,
        ("response_format", Value::Object(o)) => o.len() == 1 && o.get("type") == Some(&Value::from("text")),
        ("tool_choice", Value::String(s)) => s == "none",
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        ("logprobs" | "echo", Value::Bool(b)) => !b,
        _ => false,
    }
}

fn check_object(obj: &Map<String, Value>, allowed: &[&str], prefix: &str) -> Result<(), ApiError> {
    for (key, value) in obj {
        if allowed.contains(&key.as_str()) || is_default(key, value) {
            continue;
        }
        return Err(unsupported(format!("{prefix}{key}"), reason(key)));
    }
    Ok(())
}

/// Refuses any field of `body` that `endpoint` does not honour, naming it. Bodies that are not
/// JSON objects pass through: the typed parse that follows reports them.
pub fn check_fields(body: &Value, endpoint: Endpoint) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else { return Ok(()) };
    let own = match endpoint {
        Endpoint::Chat => CHAT_FIELDS,
        Endpoint::Completions => COMPLETION_FIELDS,
    };
    let allowed: Vec<&str> = SAMPLING_FIELDS.iter().chain(STRUCTURED_FIELDS).chain(own).copied().collect();
    check_object(obj, &allowed, "")?;
    if let Some(Value::Object(options)) = obj.get("stream_options") {
        check_object(options, STREAM_OPTION_FIELDS, "stream_options.")?;
    }
    if endpoint == Endpoint::Chat
        && let Some(Value::Array(messages)) = obj.get("messages")
    {
        for (i, message) in messages.iter().enumerate() {
            let Some(message) = message.as_object() else { continue };
            check_object(message, MESSAGE_FIELDS, &format!("messages[{i}]."))?;
            if let Some(Value::Array(parts)) = message.get("content") {
                for (j, part) in parts.iter().enumerate() {
                    if let Some(part) = part.as_object() {
                        check_object(part, CONTENT_PART_FIELDS, &format!("messages[{i}].content[{j}]."))?;
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(body: Value, endpoint: Endpoint) -> ApiError {
        match check_fields(&body, endpoint) {
            Err(e) => e,
            Ok(()) => panic!("accepted {body}"),
        }
    }

    #[test]
    fn unhonoured_fields_are_400s_naming_them() {
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().expect("object") {
                body[k] = v.clone();
            }
            body
        };
        let cases = [
            (chat(json!({"functions": [{"name": "f"}]})), "functions", "use `tools`"),
            (chat(json!({"function_call": "auto"})), "function_call", "use `tools`"),
            (
                chat(json!({"guided_regex": "a", "guided_decoding_backend": "xgrammar"})),
                "guided_decoding_backend",
                "llguidance",
            ),
            (chat(json!({"guided_whitespace_pattern": " "})), "guided_whitespace_pattern", "whitespace"),
            (chat(json!({"chat_template": "{{ x }}"})), "chat_template", "chat_template_kwargs"),
            (chat(json!({"reasoning_effort": "low"})), "reasoning_effort", "reasoning"),
            (chat(json!({"frobnicate": 1})), "frobnicate", "does not honour"),
            (
                chat(json!({"stream_options": {"continuous_usage_stats": true}})),
                "stream_options.continuous_usage_stats",
                "usage",
            ),
        ];
        for (body, param, words) in cases {
            let e = refused(body, Endpoint::Chat);
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
            assert!(e.message.contains(param) && e.message.contains(words), "{}", e.message);
        }
        let e = refused(json!({"messages": [{"role": "user", "content": "a", "name": "bob"}]}), Endpoint::Chat);
        assert_eq!(e.param.as_deref(), Some("messages[0].name"));
        let e = refused(
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]}),
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].cache_control"));
        // A chat-only field on the completions endpoint, and the other way round.
        let e = refused(json!({"prompt": "a", "messages": []}), Endpoint::Completions);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = refused(json!({"messages": [], "echo": true}), Endpoint::Chat);
        assert_eq!(e.param.as_deref(), Some("echo"));
        let e = refused(
            json!({"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            Endpoint::Completions,
        );
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = refused(json!({"prompt": "a", "tool_choice": "auto"}), Endpoint::Completions);
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn honoured_fields_nulls_and_defaults_pass() {
        let body = json!({
            "model": "m", "messages": [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "t"}]}],
            "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
            "presence_penalty": 0.1, "frequency_penalty": 0.1, "seed": 1, "stop": ["x"], "stop_token_ids": [2],
            "max_tokens": 5, "max_completion_tokens": 5, "min_tokens": 1, "ignore_eos": false,
            "logit_bias": {"5": 1.0}, "include_stop_str_in_output": false, "skip_special_tokens": true,
            "stream": true, "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2,
            "add_generation_prompt": true, "user": "u",
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}, "guided_json": null, "structured_outputs": {"regex": "a"},
            "parallel_tool_calls": false, "functions": [], "prompt_logprobs": null,
            "chat_template_kwargs": {"enable_thinking": false}
        });
        check_fields(&body, Endpoint::Chat).expect("chat body");
        let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}]});
        check_fields(&body, Endpoint::Chat).expect("chat body");
        let body = json!({"model": "m", "prompt": ["a", "b"], "echo": false, "logprobs": 2,
            "add_special_tokens": true, "best_of": 1, "suffix": null, "max_tokens": 3, "user": null,
            "guided_choice": ["x"], "response_format": {"type": "json_object"}});
        check_fields(&body, Endpoint::Completions).expect("completions body");
        // Not an object: left to the typed parse.
        check_fields(&json!([1, 2]), Endpoint::Chat).expect("array");
    }

    /// The field names serde's derive gives a struct: its `Deserialize` hands them to the
    /// deserializer, which here records them and stops.
    fn fields_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
        use serde::de::{Error, Visitor, value};
        struct Names<'a>(&'a mut &'static [&'static str]);
        impl<'de> serde::Deserializer<'de> for Names<'_> {
            type Error = value::Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, value::Error> {
                Err(value::Error::custom("not a struct"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, value::Error> {
                *self.0 = fields;
                Err(value::Error::custom("names recorded"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
                option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
                ignored_any
            }
        }
        let mut names: &'static [&'static str] = &[];
        let _ = T::deserialize(Names(&mut names));
        names
    }

    #[test]
    fn every_parsed_field_is_listed() {
        // serde ignores a body field its struct lacks, so each field a handler's struct reads
        // must be listed, or the audit would refuse a field that is honoured.
        use super::super::protocol::{ChatCompletionRequest, CompletionRequest, SamplingFields};
        let sampling = fields_of::<SamplingFields>();
        assert!(sampling.len() >= 20, "{sampling:?}");
        for name in sampling {
            assert!(SAMPLING_FIELDS.contains(name), "SamplingFields::{name} is not listed");
        }
        for name in fields_of::<ChatCompletionRequest>() {
            assert!(CHAT_FIELDS.contains(name), "ChatCompletionRequest::{name} is not listed");
        }
        for name in fields_of::<CompletionRequest>() {
            assert!(COMPLETION_FIELDS.contains(name), "CompletionRequest::{name} is not listed");
        }
        for name in fields_of::<super::super::protocol::ChatMessageIn>() {
            assert!(MESSAGE_FIELDS.contains(name), "ChatMessageIn::{name} is not listed");
        }
        for name in fields_of::<super::super::protocol::ContentPart>() {
            assert!(CONTENT_PART_FIELDS.contains(name), "ContentPart::{name} is not listed");
        }
        for name in fields_of::<super::super::protocol::StructuredFields>() {
            assert!(STRUCTURED_FIELDS.contains(name), "StructuredFields::{name} is not listed");
        }
        for name in fields_of::<super::super::protocol::StreamOptions>() {
            assert!(STREAM_OPTION_FIELDS.contains(name), "StreamOptions::{name} is not listed");
        }
    }
}
