//! Reasoning parsers (`--reasoning-parser`): split a thinking model's `<think>…</think>`
//! from its answer, as vLLM does.
//!
//! - `qwen3`: reasoning only when the output opens with `<think>`; otherwise it is all
//!   content (Qwen3 with `enable_thinking: false` gets an empty think block in the prompt).
//! - `deepseek_r1`: everything is reasoning until `</think>`, whether or not the output opens
//!   with `<think>` (DeepSeek-R1's template puts `<think>` in the prompt).
//!
//! Whitespace right after `<think>` and after `</think>` is dropped. Same streaming contract
//! as the tool parsers ([`super::output`]): a partial marker is held back until it is known.

use super::output::without_partial;

const THINK: &str = "<think>";
const END: &str = "</think>";

/// A `--reasoning-parser` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// `qwen3`.
    Qwen3,
    /// `deepseek_r1`.
    DeepseekR1,
}

impl ReasoningParser {
    /// Every choice, by its flag name.
    pub const ALL: &[(&str, ReasoningParser)] = &[("qwen3", Self::Qwen3), ("deepseek_r1", Self::DeepseekR1)];

    /// The flag name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::DeepseekR1 => "deepseek_r1",
        }
    }

    /// `(reasoning, rest)` of `text`; `rest` goes on to the tool parser (or is the content).
    pub fn split(self, text: &str, done: bool) -> (&str, &str) {
        let trimmed = text.trim_start();
        if !done && THINK.starts_with(trimmed) {
            // Nothing yet, or the start of `<think>`.
            return ("", "");
        }
        let inner = match (self, trimmed.strip_prefix(THINK)) {
            (_, Some(inner)) => inner,
            (Self::Qwen3, None) => return ("", text),
            (Self::DeepseekR1, None) => text,
        };
        match inner.find(END) {
            Some(e) => (inner[..e].trim_start(), inner[e + END.len()..].trim_start()),
            None => (without_partial(inner, done, &[END]).trim_start(), ""),
        }
    }
}

impl std::str::FromStr for ReasoningParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.iter().find(|(name, _)| *name == s).map(|(_, p)| *p).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
            format!("unknown reasoning parser `{s}`; the choices are: {}", names.join(", "))
        })
    }
}

impl std::fmt::Display for ReasoningParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// From its flag name (config files); an unknown name lists the choices.
impl<'de> serde::Deserialize<'de> for ReasoningParser {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
