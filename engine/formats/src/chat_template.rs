//! Hugging Face chat templates rendered with minijinja, configured the way `transformers`
//! configures Jinja2 (trim_blocks, lstrip_blocks, loop controls) and with the helpers HF
//! templates call: `raise_exception`, a Python-compatible `tojson`, `strftime_now`,
//! `bos_token`/`eos_token`, and Python string/dict methods (minijinja-contrib pycompat).
//! A template is compiled once at construction, so a syntax error surfaces at load time.

use std::path::Path;
use std::sync::Arc;

use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::error::FormatError;
use crate::gguf::{GgufFile, GgufValue};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

const NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn template_error(e: &Error) -> FormatError {
    let mut message = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        message.push_str(": ");
        message.push_str(&s.to_string());
        src = s.source();
    }
    FormatError::Template { message }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are exposed to the template.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, FormatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&e))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<String, Error> {
            use std::fmt::Write;
            let mut out = String::new();
            write!(out, "{}", chrono::Local::now().format(&fmt))
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("bad strftime format {fmt:?}")))?;
            Ok(out)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME.to_string(), source.to_string()).map_err(|e| template_error(&e))?;
        Ok(Self {
            env: Arc::new(env),
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, FormatError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Value::Null)
    }

    /// Like [`ChatTemplate::render`], with extra template variables (e.g. `tools`,
    /// `documents`, or any `chat_template_kwargs`) from the JSON object `extra`; the
    /// standard variables take precedence.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, FormatError> {
        let messages = serde_json::to_value(messages).map_err(|e| FormatError::Template { message: e.to_string() })?;
        self.render_json(&messages, add_generation_prompt, extra)
    }

    /// Like [`ChatTemplate::render_with`], with the messages as JSON (a list of objects), so
    /// that they may carry what HF templates read beyond role and content: an assistant's
    /// `tool_calls` (arguments as objects), a tool message's `tool_call_id`.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, FormatError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| template_error(&e))?;
        let extra = match extra {
            serde_json::Value::Object(_) => Value::from(minijinja::value::Serde(extra)),
            _ => context! {},
        };
        tmpl.render(context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..extra
        })
        .map_err(|e| template_error(&e))
    }

    /// The template of a HF folder's `tokenizer_config.json` (`chat_template` as a string, or
    /// a list of `{name, template}` with a `default` entry), or `None` when it has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, FormatError> {
        let cfg = crate::config::read_json(path)?;
        let tok = |k: &str| match cfg.get(k) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Object(o)) => {
                o.get("content").and_then(serde_json::Value::as_str).unwrap_or_default().to_string()
            }
            _ => String::new(),
        };
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|e| e.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                .and_then(|e| e.get("template"))
                .and_then(serde_json::Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        // Newer HF folders keep the template in a separate chat_template.jinja.
        let source = match source {
            Some(s) => Some(s),
            None => {
                let jinja = path.with_file_name("chat_template.jinja");
                match jinja.is_file() {
                    true => Some(std::fs::read_to_string(&jinja).map_err(|e| FormatError::io(&jinja, e))?),
                    false => None,
                }
            }
        };
        source.map(|s| Self::new(&s, &tok("bos_token"), &tok("eos_token"))).transpose()
    }

    /// The template in a GGUF file's `tokenizer.chat_template`, or `None`.
    pub fn from_gguf(g: &GgufFile) -> Result<Option<Self>, FormatError> {
        let Some(source) = g.get("tokenizer.chat_template").and_then(GgufValue::as_str) else {
            return Ok(None);
        };
        let tokens = g.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array);
        let tok = |key: &str| -> String {
            g.get(key)
                .and_then(GgufValue::as_u64)
                .and_then(|id| tokens.and_then(|t| t.get(id as usize)))
                .and_then(GgufValue::as_str)
                .unwrap_or_default()
                .to_string()
        };
        Self::new(source, &tok("tokenizer.ggml.bos_token_id"), &tok("tokenizer.ggml.eos_token_id")).map(Some)
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` as HF's `tojson` filter
/// does it (`", "` / `": "` separators; not HTML-escaped, unlike minijinja's builtin).
fn tojson(value: Value, indent: Option<usize>, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    let indent = indent.or(kwargs.get::<Option<usize>>("indent")?);
    // Accepted for compatibility; Python's defaults for them match what is written here
    // except sort_keys: keys are always written sorted (`write_py_json`).
    for ignored in ["sort_keys", "ensure_ascii", "separators"] {
        let _: Option<Value> = kwargs.get(ignored)?;
    }
    kwargs.assert_all_used()?;
    let v =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&v, indent, 0, &mut out);
    Ok(out)
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(o) if !o.is_empty() => {
            out.push('{');
            // Sorted explicitly: serde_json's map order depends on whether some crate in the
            // build turns on its `preserve_order` feature (llguidance does).
            let mut entries: Vec<_> = o.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}
