//! Text in and out of the model for the frontend: prompt encoding, chat templating, token
//! display strings, and the per-choice output text (incremental detokenization followed by
//! stop-string matching).
//!
//! This is the only module that talks to `baton_formats`' tokenizer types, so the rest of the
//! router sees one small, stable surface. Tokenizer failures on client input become
//! [`FrontendError::InvalidRequest`]; failures on server data (a broken template) are internal.

use crate::error::FrontendError;
use baton_core::params::SamplingParams;
use baton_formats::{ChatTemplate, IncrementalDetokenizer, StopMatcher, Tokenizer};
use baton_grammar::{GrammarCompiler, GrammarError};

/// One chat message, protocol-neutral.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant's calls, in HF's shape (`[{id, type, function: {name, arguments: {...}}}]`).
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

impl ChatTurn {
    /// A plain text message.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None }
    }
}

/// The served model's tokenizer and chat template.
pub struct TextCodec {
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec").field("has_chat_template", &self.chat_template.is_some()).finish()
    }
}

impl TextCodec {
    /// A codec over a tokenizer and, when the model has one, its chat template.
    pub fn new(tokenizer: Tokenizer, chat_template: Option<ChatTemplate>) -> Self {
        Self { tokenizer, chat_template }
    }

    /// Whether chat requests can be served.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Tokenizes `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, FrontendError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| FrontendError::invalid("prompt", format!("cannot tokenize the prompt: {e}")))
    }

    /// A grammar compiler for this tokenizer (builds a trie over the vocabulary: once per
    /// model, on the text pool).
    pub fn grammar_compiler(&self, eos_token_ids: &[u32], model_vocab: usize) -> Result<GrammarCompiler, GrammarError> {
        GrammarCompiler::new(&self.tokenizer, eos_token_ids, model_vocab)
    }

    /// Decodes `ids` to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, FrontendError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| FrontendError::invalid("tokens", format!("cannot decode the tokens: {e}")))
    }

    /// The text of one token as OpenAI's logprobs show it (the token decoded on its own).
    pub fn token_text(&self, id: u32) -> String {
        match self.tokenizer.decode(&[id], false) {
            Ok(s) => s,
            Err(_) => self.tokenizer.token_to_string(id).unwrap_or_default(),
        }
    }

    /// The vocabulary entry of one token (e.g. `Ġhello`), for `/tokenize`'s `token_strs`.
    pub fn vocab_string(&self, id: u32) -> String {
        self.tokenizer.token_to_string(id).unwrap_or_default()
    }

    /// Renders a conversation through the chat template; `vars` are extra template variables
    /// (`tools`, `chat_template_kwargs`).
    pub fn render_chat(
        &self,
        turns: &[ChatTurn],
        add_generation_prompt: bool,
        vars: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, FrontendError> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            FrontendError::invalid(
                "messages",
                "this model has no chat template; use /v1/completions with a text prompt instead",
            )
        })?;
        let messages: Vec<serde_json::Value> = turns
            .iter()
            .map(|t| {
                let mut m = serde_json::json!({"role": t.role, "content": t.content});
                if let Some(calls) = &t.tool_calls {
                    m["tool_calls"] = calls.clone();
                }
                if let Some(id) = &t.tool_call_id {
                    m["tool_call_id"] = serde_json::Value::String(id.clone());
                }
                m
            })
            .collect();
        template
            .render_json(
                &serde_json::Value::Array(messages),
                add_generation_prompt,
                &serde_json::Value::Object(vars.clone()),
            )
            .map_err(|e| FrontendError::invalid("messages", format!("cannot apply the chat template: {e}")))
    }
}

/// Text produced by pushing one token.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PushedText {
    /// Text that is now final.
    pub text: String,
    /// The stop string that matched, ending the choice.
    pub stopped_by: Option<String>,
}

/// The output text of one choice: detokenizes token by token (UTF-8 safe) and applies stop
/// strings, holding back text that could still turn out to be the start of a stop string.
pub struct ChoiceText {
    detok: IncrementalDetokenizer,
    stop: Option<(StopMatcher, Vec<String>)>,
    include_stop_str: bool,
}

fn internal(e: impl std::fmt::Display) -> FrontendError {
    FrontendError::Internal(format!("detokenization failed: {e}"))
}

impl ChoiceText {
    /// State for a new choice of a request with `params` (whose stop strings were validated).
    pub fn new(codec: &TextCodec, params: &SamplingParams, prompt: &[u32]) -> Result<Self, FrontendError> {
        let detok = IncrementalDetokenizer::new(codec.tokenizer.clone(), prompt, params.skip_special_tokens);
        let stop = if params.stop.is_empty() {
            None
        } else {
            let matcher = StopMatcher::new(&params.stop, params.include_stop_str_in_output)
                .map_err(|e| FrontendError::invalid("stop", e.to_string()))?;
            Some((matcher, params.stop.clone()))
        };
        Ok(Self { detok, stop, include_stop_str: params.include_stop_str_in_output })
    }

    /// Whether matched stop strings (and stop tokens) stay in the output.
    pub fn include_stop_str(&self) -> bool {
        self.include_stop_str
    }

    /// Feeds one generated token.
    pub fn push(&mut self, token: u32) -> Result<PushedText, FrontendError> {
        let delta = self.detok.push(token).map_err(internal)?;
        Ok(match &mut self.stop {
            None => PushedText { text: delta, stopped_by: None },
            Some((matcher, stops)) => {
                let out = matcher.push(&delta);
                let stopped_by = match (out.stopped, out.matched) {
                    (true, Some(i)) => stops.get(i).cloned(),
                    (true, None) => Some(String::new()),
                    (false, _) => None,
                };
                PushedText { text: out.text, stopped_by }
            }
        })
    }

    /// The text still held back once the choice ends without a stop-string match.
    pub fn finish(&mut self) -> Result<String, FrontendError> {
        let mut rest = self.detok.flush().map_err(internal)?;
        if let Some((matcher, _)) = &mut self.stop {
            let out = matcher.push(&rest);
            rest = out.text;
            if !out.stopped {
                rest.push_str(&matcher.flush());
            }
        }
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_formats::LoadFormat;
    use baton_formats::testing::{TinySpec, write_hf_folder};

    /// A template that prints what HF tool-calling templates read: `tools`, an assistant's
    /// `tool_calls` (arguments as an object), a tool message's `tool_call_id`, and a kwarg.
    const TOOLS_TEMPLATE: &str = "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}\
        {% for m in messages %}{{ m.role }}:{{ m.content }}\
        {% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endif %}\
        {% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}\n{% endfor %}\
        {% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}";

    #[test]
    fn the_template_sees_tools_tool_turns_and_kwargs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_hf_folder(&dir.path().join("tiny"), &TinySpec::llama()).expect("tiny model");
        let model = baton_formats::load_model(&path, LoadFormat::Auto).expect("loads");
        let template = ChatTemplate::new(TOOLS_TEMPLATE, "<s>", "</s>").expect("template");
        let codec = TextCodec::new(model.tokenizer.expect("tokenizer"), Some(template));
        let mut call = ChatTurn::text("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]));
        let mut result = ChatTurn::text("tool", "sunny");
        result.tool_call_id = Some("c1".into());
        let turns = [ChatTurn::text("user", "weather?"), call, result];
        let mut vars = serde_json::Map::new();
        vars.insert("tools".into(), serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]));
        vars.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        let text = codec.render_chat(&turns, false, &vars).expect("renders");
        assert_eq!(
            text,
            // (trim_blocks, as transformers configures Jinja, eats the newline after a tag)
            "TOOLS:get_weather;user:weather?assistant:<call get_weather {\"city\": \"Paris\"}>tool:sunny<for c1>NOTHINK"
        );
        // Without extras the template renders as before.
        let plain = codec.render_chat(&turns[..1], false, &serde_json::Map::new()).expect("renders");
        assert_eq!(plain, "user:weather?");
    }
}
