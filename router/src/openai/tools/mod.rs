//! Tool calling and reasoning at the OpenAI edge: the request's `tools`/`tool_choice`
//! ([`choice`]) and the parsing of what the model wrote into reasoning, content and tool calls
//! ([`OutputParser`], one file per format, streamed by [`stream`]).
//!
//! How a request's output is read:
//! - no tools, or `tool_choice: "none"`: as content (after the reasoning parser, if any);
//! - `auto`: with the `--tool-call-parser` format ([`ToolCallParser`]);
//! - `required` and a named function: the grammar forces the shape, [`forced`] reads it.
//!
//! Every format parser is a pure function of the text so far with the prefix contract of
//! [`output`], which is what makes streamed deltas add up to the non-streaming result.

pub mod choice;
pub mod forced;
pub mod harmony;
pub mod hermes;
pub mod json_scan;
pub mod llama3_json;
pub mod mistral;
pub mod output;
pub mod pythonic;
pub mod reasoning;
pub mod stream;

pub use output::{ParsedCall, ParsedOutput};
pub use reasoning::ReasoningParser;
pub use stream::{CallDelta, OutputDelta, StreamingParser};

/// A `--tool-call-parser` choice: the format a model family writes its calls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `hermes`: `<tool_call>{json}</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// `llama3_json`: `{"name", "parameters"}` objects (Llama 3.1–3.3).
    Llama3Json,
    /// `mistral`: `[TOOL_CALLS]` (Mistral, Mixtral).
    Mistral,
    /// `pythonic`: `[f(a=1), g()]` (Llama 3.2/4 and others).
    Pythonic,
    /// `openai`: gpt-oss's harmony messages.
    Openai,
}

impl ToolCallParser {
    /// Every choice, by its flag name.
    pub const ALL: &[(&str, ToolCallParser)] = &[
        ("hermes", Self::Hermes),
        ("llama3_json", Self::Llama3Json),
        ("mistral", Self::Mistral),
        ("pythonic", Self::Pythonic),
        ("openai", Self::Openai),
    ];

    /// The flag name.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, p)| *p == self).map_or("", |(n, _)| n)
    }
}

impl std::str::FromStr for ToolCallParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.iter().find(|(name, _)| *name == s).map(|(_, p)| *p).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
            format!("unknown tool-call parser `{s}`; the choices are: {}", names.join(", "))
        })
    }
}

impl std::fmt::Display for ToolCallParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one request's tool calls are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolFormat {
    /// `auto`: the model's own format.
    Auto(ToolCallParser),
    /// `required`: a JSON list of `{"name", "parameters"}`.
    Required,
    /// A named function: the output is its arguments.
    Named(String),
}

/// How one choice's output text is read: reasoning first, then tool calls on the rest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputParser {
    /// Splits off `<think>` reasoning.
    pub reasoning: Option<ReasoningParser>,
    /// Reads tool calls; `None`: the rest is content.
    pub tools: Option<ToolFormat>,
    /// Keep at most this many calls (`parallel_tool_calls: false` is 1).
    pub max_calls: Option<usize>,
}

impl OutputParser {
    /// Whether the output is plain content (nothing to parse).
    pub fn is_plain(&self) -> bool {
        self.reasoning.is_none() && self.tools.is_none()
    }

    /// Parses `text`; `done` says no more text will come (see [`output`] for the contract).
    pub fn parse(&self, text: &str, done: bool) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        let rest = match self.reasoning {
            Some(r) => {
                let (reasoning, rest) = r.split(text, done);
                out.reasoning.push_str(reasoning);
                rest
            }
            None => text,
        };
        match &self.tools {
            None => out.content.push_str(rest),
            Some(ToolFormat::Auto(ToolCallParser::Hermes)) => hermes::parse(rest, done, &mut out),
            Some(ToolFormat::Auto(ToolCallParser::Llama3Json)) => llama3_json::parse(rest, done, &mut out),
            Some(ToolFormat::Auto(ToolCallParser::Mistral)) => mistral::parse(rest, done, &mut out),
            Some(ToolFormat::Auto(ToolCallParser::Pythonic)) => pythonic::parse(rest, done, &mut out),
            Some(ToolFormat::Auto(ToolCallParser::Openai)) => harmony::parse(rest, done, &mut out),
            Some(ToolFormat::Required) => forced::parse_required(rest, &mut out),
            Some(ToolFormat::Named(name)) => forced::parse_named(name, rest, &mut out),
        }
        if let Some(max) = self.max_calls {
            out.calls.truncate(max);
        }
        out
    }
}

#[cfg(test)]
mod tests;

/// From its flag name (config files); an unknown name lists the choices.
impl<'de> serde::Deserialize<'de> for ToolCallParser {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
