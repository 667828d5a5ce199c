//! Byte-level BPE tokenizers described as data ([`ByteLevelBpe`]: tokens, merges, added
//! tokens, pre-tokenizer kind) and turned into a `tokenizers` tokenizer through its
//! `tokenizer.json` form. GGUF files carry exactly this data (`tokenizer.ggml.*`), so a GGUF
//! model gets the same ids its HF `tokenizer.json` gives; the pre-tokenizer regexes are the
//! ones the HF tokenizers of each family use (llama.cpp names them in `tokenizer.ggml.pre`).

use serde_json::{Value, json};

use super::Tokenizer;
use super::gguf_spm::SpmVocab;
use super::json_doc::{bos_post_processor, build_tokenizer};
use crate::error::FormatError;
use crate::gguf::{GgufFile, GgufValue};

/// GPT-2's split regex (also used after digit splitting by SmolLM/StarCoder).
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split regex.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (single digits).
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The o200k split regex (gpt-oss, GPT-4o; llama.cpp's `gpt-4o`): case-aware words with an
/// optional contraction, digits in groups of up to three, punctuation runs that keep a trailing
/// newline or slash.
const O200K_REGEX: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

/// Pre-tokenizer families (GGUF `tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2 byte-level regex (`gpt2`, `default`).
    Gpt2,
    /// Digits split one by one, then GPT-2's regex (`smollm`, `starcoder`, `refact`).
    Smollm,
    /// Llama 3 (`llama-bpe`, `llama3`): digits in groups of up to three, merges ignored for whole-vocab words.
    Llama3,
    /// Qwen2: NFC, single digits.
    Qwen2,
    /// o200k (`gpt-4o`: gpt-oss).
    Gpt4o,
}

impl PreTokenizerKind {
    /// The kind llama.cpp means by a `tokenizer.ggml.pre` value.
    pub fn from_gguf_pre(name: &str) -> Option<Self> {
        match name {
            "default" | "gpt2" | "gpt-2" => Some(Self::Gpt2),
            "smollm" | "starcoder" | "refact" => Some(Self::Smollm),
            "llama-bpe" | "llama3" | "llama-v3" => Some(Self::Llama3),
            "qwen2" => Some(Self::Qwen2),
            "gpt-4o" => Some(Self::Gpt4o),
            _ => None,
        }
    }

    /// The canonical `tokenizer.ggml.pre` value.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Smollm => "smollm",
            Self::Llama3 => "llama-bpe",
            Self::Qwen2 => "qwen2",
            Self::Gpt4o => "gpt-4o",
        }
    }

    fn pre_tokenizer_json(self) -> Value {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split =
            |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
        match self {
            Self::Gpt2 => byte_level(true),
            Self::Smollm => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            Self::Llama3 => json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]}),
            Self::Qwen2 => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
            Self::Gpt4o => json!({"type": "Sequence", "pretokenizers": [split(O200K_REGEX), byte_level(false)]}),
        }
    }

    /// The regex GPT-2 style tokenizers split on; exposed for documentation and tests.
    pub fn regex(self) -> &'static str {
        match self {
            Self::Gpt2 | Self::Smollm => GPT2_REGEX,
            Self::Llama3 => LLAMA3_REGEX,
            Self::Qwen2 => QWEN2_REGEX,
            Self::Gpt4o => O200K_REGEX,
        }
    }
}

/// An added (non-BPE) token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedTokenSpec {
    /// Its id.
    pub id: u32,
    /// Its text.
    pub content: String,
    /// Special (control) tokens are skipped by `decode(.., skip_special_tokens = true)`.
    pub special: bool,
}

/// A byte-level BPE tokenizer as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct ByteLevelBpe {
    /// Token strings in id order (byte-level alphabet, e.g. `Ġ` for space).
    pub tokens: Vec<String>,
    /// Merge rules, highest priority first.
    pub merges: Vec<(String, String)>,
    /// Tokens matched before pre-tokenization.
    pub added: Vec<AddedTokenSpec>,
    /// Pre-tokenizer family.
    pub pre: PreTokenizerKind,
    /// BOS id prepended when `add_bos` and special tokens are requested.
    pub bos: Option<u32>,
    /// Whether encoding with special tokens prepends `bos`.
    pub add_bos: bool,
}

impl ByteLevelBpe {
    /// The HF `tokenizer.json` document for this tokenizer.
    pub fn to_json(&self) -> Value {
        let vocab: serde_json::Map<String, Value> =
            self.tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        let merges: Vec<Value> = self.merges.iter().map(|(a, b)| json!([a, b])).collect();
        let added: Vec<Value> = self
            .added
            .iter()
            .map(|t| {
                json!({"id": t.id, "content": t.content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": !t.special, "special": t.special})
            })
            .collect();
        let post = bos_post_processor(&self.tokens, self.bos.filter(|_| self.add_bos)).unwrap_or_else(
            || json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
        );
        let normalizer = match self.pre {
            PreTokenizerKind::Qwen2 => json!({"type": "NFC"}),
            _ => Value::Null,
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": self.pre.pre_tokenizer_json(),
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": self.pre == PreTokenizerKind::Llama3,
                "vocab": vocab, "merges": merges
            }
        })
    }

    /// Builds the `tokenizers` tokenizer; `context` names the source in errors.
    pub fn build(&self, context: &str) -> Result<tokenizers::Tokenizer, FormatError> {
        build_tokenizer(&self.to_json(), context)
    }
}

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Reads the `tokenizer.ggml.*` metadata of a GGUF file as a [`ByteLevelBpe`].
pub fn bpe_from_gguf(g: &GgufFile) -> Result<ByteLevelBpe, FormatError> {
    let path = &g.path;
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| FormatError::gguf(path, "missing tokenizer.ggml.model (no tokenizer in this file)"))?;
    if model != "gpt2" {
        return Err(FormatError::unsupported(
            path,
            format!("tokenizer.ggml.model {model:?} (supported: byte-level BPE \"gpt2\", SentencePiece \"llama\")"),
        ));
    }
    let strings = |key: &str| -> Result<Vec<String>, FormatError> {
        let arr = g
            .get(key)
            .and_then(GgufValue::as_array)
            .ok_or_else(|| FormatError::gguf(path, format!("missing {key}")))?;
        arr.iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| FormatError::gguf(path, format!("{key} must be an array of strings")))
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| FormatError::gguf(path, format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => Vec::new(),
    };
    let added = types
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == TOKEN_CONTROL || **t == TOKEN_USER_DEFINED)
        .filter_map(|(i, t)| {
            tokens.get(i).map(|c| AddedTokenSpec { id: i as u32, content: c.clone(), special: *t == TOKEN_CONTROL })
        })
        .collect();
    let pre = match g.get("tokenizer.ggml.pre").and_then(GgufValue::as_str) {
        None => PreTokenizerKind::Gpt2,
        Some(name) => PreTokenizerKind::from_gguf_pre(name).ok_or_else(|| {
            FormatError::unsupported(
                path,
                format!("tokenizer.ggml.pre {name:?} (supported: gpt2, smollm, llama-bpe, qwen2)"),
            )
        })?,
    };
    let bos = g.get("tokenizer.ggml.bos_token_id").and_then(GgufValue::as_u64).map(|v| v as u32);
    let add_bos =
        g.get("tokenizer.ggml.add_bos_token").and_then(GgufValue::as_bool).unwrap_or(pre == PreTokenizerKind::Llama3);
    Ok(ByteLevelBpe { tokens, merges, added, pre, bos, add_bos })
}

/// Builds the tokenizer a GGUF file describes: byte-level BPE (`gpt2`) or SentencePiece
/// (`llama`, [`SpmVocab`]).
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer, FormatError> {
    let ctx = g.path.display().to_string();
    let (inner, tokens) = if g.get("tokenizer.ggml.model").and_then(GgufValue::as_str) == Some("llama") {
        let spm = SpmVocab::from_gguf(g)?;
        (spm.build(&ctx)?, spm.pieces)
    } else {
        let bpe = bpe_from_gguf(g)?;
        (bpe.build(&ctx)?, bpe.tokens)
    };
    let name = |key: &str| g.get(key).and_then(GgufValue::as_u64).and_then(|id| tokens.get(id as usize).cloned());
    Ok(Tokenizer::from_inner(inner, name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id"), ctx))
}

/// The GGUF metadata entries describing `bpe` (the inverse of [`bpe_from_gguf`]).
pub fn bpe_to_gguf_metadata(bpe: &ByteLevelBpe, eos: Option<u32>) -> Vec<(String, GgufValue)> {
    let mut types = vec![1i32; bpe.tokens.len()];
    for a in &bpe.added {
        if let Some(t) = types.get_mut(a.id as usize) {
            *t = if a.special { TOKEN_CONTROL as i32 } else { TOKEN_USER_DEFINED as i32 };
        }
    }
    let mut out = vec![
        ("tokenizer.ggml.model".to_string(), GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), GgufValue::String(bpe.pre.gguf_name().into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            GgufValue::Array(bpe.tokens.iter().cloned().map(GgufValue::String).collect()),
        ),
        ("tokenizer.ggml.token_type".to_string(), GgufValue::Array(types.into_iter().map(GgufValue::I32).collect())),
        (
            "tokenizer.ggml.merges".to_string(),
            GgufValue::Array(bpe.merges.iter().map(|(a, b)| GgufValue::String(format!("{a} {b}"))).collect()),
        ),
        ("tokenizer.ggml.add_bos_token".to_string(), GgufValue::Bool(bpe.add_bos)),
    ];
    if let Some(b) = bpe.bos {
        out.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(b)));
    }
    if let Some(e) = eos {
        out.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e)));
    }
    out
}
