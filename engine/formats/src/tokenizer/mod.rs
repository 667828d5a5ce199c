//! Baton's tokenizer: a cheap-to-clone handle on a `tokenizers::Tokenizer` plus the bos/eos
//! strings and the set of special ids the server needs. Built from `tokenizer.json` (+
//! `tokenizer_config.json`) or from GGUF metadata (`gguf_vocab`: byte-level BPE; `gguf_spm`:
//! SentencePiece). Streaming helpers live
//! in `detok` (incremental detokenization, by table for byte-level vocabularies: `byte_level`)
//! and `stop` (stop strings).

mod byte_level;
pub mod detok;
pub mod gguf_spm;
pub mod gguf_vocab;
mod json_doc;
pub mod stop;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::error::FormatError;

pub use detok::IncrementalDetokenizer;
pub use gguf_spm::SpmVocab;
pub use gguf_vocab::{ByteLevelBpe, PreTokenizerKind, tokenizer_from_gguf};
pub use stop::{StopMatcher, StopOutput};

/// A tokenizer; clones share the underlying vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    special_ids: Arc<HashSet<u32>>,
    /// Ids, added tokens included; computed once (`tokenizers` recounts the added tokens
    /// with a vocabulary lookup each per call, and decoding checks ids against it).
    vocab_size: usize,
    /// Per-token bytes when the decoder is plain byte-level (see `byte_level`).
    byte_table: Option<Arc<byte_level::ByteTable>>,
    bos: Option<String>,
    eos: Option<String>,
    context: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("source", &self.context).field("vocab_size", &self.vocab_size()).finish()
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> FormatError {
    FormatError::Tokenizer { context: context.to_string(), message: e.to_string() }
}

/// A token string from tokenizer_config.json: either `"<s>"` or `{"content": "<s>", ...}`.
fn config_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Wraps a built `tokenizers::Tokenizer`; `context` names its source in errors.
    pub fn from_inner(
        inner: tokenizers::Tokenizer,
        bos: Option<String>,
        eos: Option<String>,
        context: impl Into<String>,
    ) -> Self {
        let special_ids =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        let vocab_size = inner.get_vocab_size(true);
        let byte_table = byte_level::ByteTable::build(&inner, vocab_size).map(Arc::new);
        Self {
            inner: Arc::new(inner),
            special_ids: Arc::new(special_ids),
            vocab_size,
            byte_table,
            bos,
            eos,
            context: context.into(),
        }
    }

    /// Loads a `tokenizer.json` (bos/eos strings unset; see [`Tokenizer::from_hf_folder`]).
    pub fn from_file(path: &Path) -> Result<Self, FormatError> {
        let ctx = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| FormatError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tok_err(&ctx, e))?;
        Ok(Self::from_inner(inner, None, None, ctx))
    }

    /// Loads `tokenizer.json` and, when present, the bos/eos strings of `tokenizer_config.json`.
    pub fn from_hf_folder(dir: &Path) -> Result<Self, FormatError> {
        let mut tok = Self::from_file(&dir.join("tokenizer.json"))?;
        let cfg_path = dir.join("tokenizer_config.json");
        if cfg_path.is_file() {
            let cfg = crate::config::read_json(&cfg_path)?;
            tok.bos = config_token(cfg.get("bos_token"));
            tok.eos = config_token(cfg.get("eos_token"));
        }
        Ok(tok)
    }

    /// Sets the bos/eos strings.
    pub fn with_bos_eos(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos = bos;
        self.eos = eos;
        self
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, FormatError> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| tok_err(&self.context, e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, FormatError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(self.out_of_vocabulary(bad));
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| tok_err(&self.context, e))
    }

    fn out_of_vocabulary(&self, id: u32) -> FormatError {
        tok_err(&self.context, format!("token id {id} is outside the vocabulary (size {})", self.vocab_size))
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether streaming decoding goes by the byte table (a plain byte-level decoder) rather
    /// than by re-decoding windows of ids.
    pub fn decodes_by_bytes(&self) -> bool {
        self.byte_table.is_some()
    }

    /// The raw bytes token `id` stands for in generated text (what a grammar engine matches
    /// tokens against), or `None` when `id` is outside the vocabulary.
    ///
    /// Byte-level vocabularies answer from the byte table (exact, including tokens that are
    /// only part of a UTF-8 character). Others: `<0xNN>` byte-fallback tokens are their byte,
    /// SentencePiece's `▁` is a space, anything else its decoded text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id as usize >= self.vocab_size {
            return None;
        }
        if let Some(table) = &self.byte_table {
            return table.bytes(id).map(<[u8]>::to_vec);
        }
        let token = self.inner.id_to_token(id)?;
        if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
            && hex.len() == 2
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            return Some(vec![byte]);
        }
        if token.contains('\u{2581}') {
            return Some(token.replace('\u{2581}', " ").into_bytes());
        }
        Some(self.inner.decode(&[id], false).map(String::into_bytes).unwrap_or_else(|_| token.into_bytes()))
    }

    /// Display text of one token (as a logprobs entry shows it), or `None` if out of range.
    pub fn token_to_string(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)?;
        self.inner.decode(&[id], false).ok()
    }

    /// The raw vocabulary entry of `id` (e.g. `Ġhello` for byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The BOS token string, if known.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    /// The EOS token string, if known.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// Whether `id` is a special (control) token, skipped by `decode(.., true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
