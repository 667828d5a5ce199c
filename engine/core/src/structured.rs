//! Structured outputs as plain data: what a request asks its output to match
//! ([`GrammarSpec`]) and the per-step set of tokens a grammar allows ([`TokenMask`]).
//!
//! This module knows no grammar engine. The front end maps `response_format`,
//! `guided_*`, `structured_outputs` and forced tool calls onto a [`GrammarSpec`]; the
//! engine compiles it (with llguidance) and, before each sampling step of a
//! constrained sequence, computes a [`TokenMask`] that the sampler applies
//! ([`crate::sampling`] step 5b). A spec is small plain data so it can cross the
//! worker wire and key a compile cache.
//!
//! Invariants: a [`TokenMask`] covers ids `0..len` and allows nothing at or past
//! `len`; cloning one is cheap (the words are shared).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Largest grammar source (schema, regex, grammar text or all choices together) a
/// request may carry, in bytes. Compilation work grows with it; 256 KiB is far
/// beyond any real schema or tool list.
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// Most alternatives in a [`GrammarSpec::Choice`].
pub const MAX_CHOICES: usize = 1024;

/// What a constrained sequence's output must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against a JSON Schema, given as its JSON text
    /// (`response_format: json_schema`, `guided_json`, forced tool calls).
    JsonSchema(String),
    /// Text matching a regular expression (`guided_regex`), whole output anchored.
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark dialect (`guided_grammar`).
    Lark(String),
}

impl GrammarSpec {
    /// The request field family this spec came from, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Lark(_) => "grammar",
        }
    }

    /// Bytes of grammar source this spec carries (checked against [`MAX_GRAMMAR_BYTES`]).
    pub fn source_bytes(&self) -> usize {
        match self {
            Self::JsonObject => 0,
            Self::JsonSchema(s) | Self::Regex(s) | Self::Lark(s) => s.len(),
            Self::Choice(c) => c.iter().map(String::len).sum(),
        }
    }
}

/// The tokens a grammar allows at one step: bit `id % 32` of word `id / 32`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Arc<[u32]>,
    len: usize,
}

impl TokenMask {
    /// A mask over ids `0..len` from its words; bits at or past `len` are cleared, and
    /// missing words allow nothing.
    pub fn from_words(mut words: Vec<u32>, len: usize) -> Self {
        words.resize(len.div_ceil(32), 0);
        if !len.is_multiple_of(32)
            && let Some(last) = words.last_mut()
        {
            *last &= (1u32 << (len % 32)) - 1;
        }
        Self { words: words.into(), len }
    }

    /// A mask over `0..len` allowing exactly `ids` (ids at or past `len` are dropped).
    pub fn allowing(len: usize, ids: impl IntoIterator<Item = u32>) -> Self {
        let mut words = vec![0u32; len.div_ceil(32)];
        for id in ids.into_iter().filter(|&id| (id as usize) < len) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
        Self { words: words.into(), len }
    }

    /// Whether `id` is allowed.
    pub fn allows(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1)
    }

    /// The ids the mask covers (`0..len`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the mask covers no ids.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed words, `len.div_ceil(32)` of them (what a device sampler uploads).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// How many ids are allowed.
    pub fn count_allowed(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_allow_exactly_their_ids_and_nothing_past_len() {
        let m = TokenMask::allowing(70, [0, 31, 32, 69, 70, 5000]);
        let allowed: Vec<u32> = (0..200).filter(|&i| m.allows(i)).collect();
        assert_eq!(allowed, vec![0, 31, 32, 69]);
        assert_eq!(m.count_allowed(), 4);
        assert_eq!(m.words().len(), 3);
        let full = TokenMask::from_words(vec![u32::MAX; 5], 40);
        assert_eq!(full.words().len(), 2);
        assert_eq!(full.count_allowed(), 40);
        assert!(!full.allows(40));
        let short = TokenMask::from_words(vec![1], 100);
        assert_eq!((short.count_allowed(), short.allows(0), short.allows(64)), (1, true, false));
    }

    #[test]
    fn spec_sizes_count_every_source_byte() {
        assert_eq!(GrammarSpec::JsonObject.source_bytes(), 0);
        assert_eq!(GrammarSpec::Choice(vec!["ab".into(), "c".into()]).source_bytes(), 3);
        assert_eq!(GrammarSpec::Regex("a+".into()).kind(), "regex");
    }
}
