//! SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model` "llama": Llama 2, Mistral,
//! Mixtral, Gemma): pieces, scores and types → a `tokenizers` BPE with byte fallback.
//!
//! SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is a piece
//! with the highest score. A BPE whose merge list holds every split of every piece into two
//! pieces, ranked by the merged piece's score (highest first; a piece's splits in vocabulary-id
//! order), applies the same merges in the same order. transformers' `LlamaConverter` builds
//! its tokenizers this way from the same models. Text a piece does not cover falls back to the
//! `<0xXX>` byte pieces. Spaces become `▁`, and one is prepended to every text fragment (the
//! text's start, and after each special token) when `tokenizer.ggml.add_space_prefix` is true
//! (the default; Gemma's files say false), as llama.cpp does. Control (and unknown) pieces are special tokens, user-defined ones added
//! tokens. Checked against the `sentencepiece` library on a model it trained
//! (`engine/formats/tests/fixtures/spm`, `scripts/golden/make_spm.py`).

use std::collections::HashMap;

use serde_json::{Value, json};

use super::json_doc::{bos_post_processor, build_tokenizer};
use crate::error::FormatError;
use crate::gguf::{GgufFile, GgufValue};

/// GGUF `tokenizer.ggml.token_type` values.
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// A SentencePiece vocabulary as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct SpmVocab {
    /// Pieces in id order (`▁` for a space, `<0xXX>` for byte pieces).
    pub pieces: Vec<String>,
    /// Each piece's score (merge priority: higher first).
    pub scores: Vec<f32>,
    /// Each piece's llama.cpp token type (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte).
    pub types: Vec<i64>,
    /// BOS id prepended when `add_bos` and special tokens are requested.
    pub bos: Option<u32>,
    /// Whether encoding with special tokens prepends `bos`.
    pub add_bos: bool,
    /// Whether a `▁` is prepended to the text.
    pub add_space_prefix: bool,
}

impl SpmVocab {
    /// Reads the `tokenizer.ggml.*` metadata of a GGUF file whose model is "llama".
    pub fn from_gguf(g: &GgufFile) -> Result<Self, FormatError> {
        let path = &g.path;
        let array = |key: &str| {
            g.get(key).and_then(GgufValue::as_array).ok_or_else(|| FormatError::gguf(path, format!("missing {key}")))
        };
        let pieces = array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| FormatError::gguf(path, "tokenizer.ggml.tokens must be an array of strings"))?;
        let scores = array("tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.as_f64().map(|s| s as f32))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| FormatError::gguf(path, "tokenizer.ggml.scores must be an array of numbers"))?;
        let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; pieces.len()],
        };
        if scores.len() != pieces.len() || types.len() != pieces.len() {
            return Err(FormatError::gguf(
                path,
                format!(
                    "tokenizer.ggml: {} tokens, {} scores, {} token types",
                    pieces.len(),
                    scores.len(),
                    types.len()
                ),
            ));
        }
        let flag = |key: &str, default: bool| g.get(key).and_then(GgufValue::as_bool).unwrap_or(default);
        Ok(Self {
            pieces,
            scores,
            types,
            bos: g.get("tokenizer.ggml.bos_token_id").and_then(GgufValue::as_u64).map(|v| v as u32),
            add_bos: flag("tokenizer.ggml.add_bos_token", true),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true),
        })
    }

    /// Every split of every piece into two pieces, highest-scoring merged piece first (see the
    /// module doc).
    pub fn merges(&self) -> Vec<(String, String)> {
        let ids: HashMap<&str, usize> = self.pieces.iter().enumerate().map(|(i, p)| (p.as_str(), i)).collect();
        let mut ranked: Vec<(f32, usize, usize, usize)> = Vec::new();
        for (merged, piece) in self.pieces.iter().enumerate() {
            let mut local: Vec<(usize, usize)> = piece
                .char_indices()
                .skip(1)
                .filter_map(|(at, _)| Some((*ids.get(&piece[..at])?, *ids.get(&piece[at..])?)))
                .collect();
            local.sort_unstable();
            ranked.extend(local.into_iter().map(|(l, r)| (self.scores[merged], merged, l, r)));
        }
        // Stable: equal scores keep the id order of their merged pieces.
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        ranked.into_iter().map(|(_, _, l, r)| (self.pieces[l].clone(), self.pieces[r].clone())).collect()
    }

    /// The HF `tokenizer.json` document for this vocabulary.
    pub fn to_json(&self) -> Value {
        self.document(true)
    }

    /// The document, with the model's vocabulary and merges only when `with_model`.
    fn document(&self, with_model: bool) -> Value {
        let (vocab, merges): (serde_json::Map<String, Value>, Vec<Value>) = if with_model {
            (
                self.pieces.iter().enumerate().map(|(i, p)| (p.clone(), json!(i))).collect(),
                self.merges().into_iter().map(|(a, b)| json!([a, b])).collect(),
            )
        } else {
            Default::default()
        };
        let added: Vec<Value> = self
            .added()
            .map(|(i, special)| {
                json!({"id": i, "content": self.pieces[i], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": !special, "special": special})
            })
            .collect();
        let unk = self.unk_piece();
        let post = bos_post_processor(&self.pieces, self.bos.filter(|_| self.add_bos)).unwrap_or(Value::Null);
        // A `▁` before every text fragment (llama.cpp prefixes each fragment that starts the
        // text or follows a special token; the normalizer runs on each such fragment), even one
        // that already starts with a space, as sentencepiece's dummy prefix does.
        let mut normalizers = Vec::new();
        if self.add_space_prefix {
            normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
        }
        normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if self.add_space_prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": null,
            "post_processor": post,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges
            }
        })
    }

    /// Builds the `tokenizers` tokenizer; `context` names the source in errors. The same
    /// tokenizer as [`SpmVocab::to_json`] describes, with the BPE model built directly rather
    /// than through the document: a Gemma-size vocabulary (256k pieces, about a million
    /// merges) then takes 0.9 s instead of 3.1 (`bench_spm_vocab`, session 20).
    pub fn build(&self, context: &str) -> Result<tokenizers::Tokenizer, FormatError> {
        use tokenizers::models::bpe::BPE;
        use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper};
        let fail = |message: String| FormatError::Tokenizer { context: context.to_string(), message };
        let doc = self.document(false);
        let part = |key: &str| doc.get(key).cloned().unwrap_or(Value::Null);
        let vocab: tokenizers::models::bpe::Vocab =
            self.pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
        let mut bpe = BPE::builder().vocab_and_merges(vocab, self.merges()).byte_fallback(true).fuse_unk(true);
        if let Some(unk) = self.unk_piece() {
            bpe = bpe.unk_token(unk);
        }
        let model = bpe.build().map_err(|e| fail(e.to_string()))?;
        let mut tok = tokenizers::Tokenizer::new(model);
        let normalizer: NormalizerWrapper =
            serde_json::from_value(part("normalizer")).map_err(|e| fail(e.to_string()))?;
        let decoder: DecoderWrapper = serde_json::from_value(part("decoder")).map_err(|e| fail(e.to_string()))?;
        let post: Option<PostProcessorWrapper> =
            serde_json::from_value(part("post_processor")).map_err(|e| fail(e.to_string()))?;
        tok.with_normalizer(Some(normalizer)).map_err(|e| fail(e.to_string()))?;
        tok.with_decoder(Some(decoder)).with_post_processor(post);
        // Added after the normalizer, as a document's are: normalized ones are matched on
        // normalized text. Every piece is in the model, so each keeps its id.
        let (special, user): (Vec<_>, Vec<_>) = self
            .added()
            .map(|(i, special)| AddedToken::from(self.pieces[i].clone(), special).normalized(!special))
            .partition(|t| t.special);
        tok.add_special_tokens(special).map_err(|e| fail(e.to_string()))?;
        tok.add_tokens(user).map_err(|e| fail(e.to_string()))?;
        Ok(tok)
    }

    /// The ids of the pieces the tokenizer adds as tokens, and whether each is special (control
    /// and unknown pieces are; user-defined ones are not).
    fn added(&self) -> impl Iterator<Item = (usize, bool)> + '_ {
        self.types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(**t, TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED))
            .map(|(i, t)| (i, *t != TYPE_USER_DEFINED))
    }

    /// The unknown piece, if the vocabulary has one.
    fn unk_piece(&self) -> Option<String> {
        self.types.iter().position(|&t| t == TYPE_UNKNOWN).map(|i| self.pieces[i].clone())
    }

    /// Builds the tokenizer through its `tokenizer.json` document ([`SpmVocab::to_json`]),
    /// for comparisons with [`SpmVocab::build`].
    pub fn build_from_json(&self, context: &str) -> Result<tokenizers::Tokenizer, FormatError> {
        build_tokenizer(&self.to_json(), context)
    }

    /// The GGUF metadata entries describing this vocabulary, as llama.cpp's converter writes
    /// them (the inverse of [`SpmVocab::from_gguf`]).
    pub fn to_gguf_metadata(&self, eos: Option<u32>) -> Vec<(String, GgufValue)> {
        let mut out = vec![
            ("tokenizer.ggml.model".to_string(), GgufValue::String("llama".into())),
            (
                "tokenizer.ggml.tokens".to_string(),
                GgufValue::Array(self.pieces.iter().cloned().map(GgufValue::String).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                GgufValue::Array(self.scores.iter().map(|&s| GgufValue::F32(s)).collect()),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                GgufValue::Array(self.types.iter().map(|&t| GgufValue::I32(t as i32)).collect()),
            ),
            ("tokenizer.ggml.add_bos_token".to_string(), GgufValue::Bool(self.add_bos)),
            ("tokenizer.ggml.add_space_prefix".to_string(), GgufValue::Bool(self.add_space_prefix)),
        ];
        if let Some(b) = self.bos {
            out.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(b)));
        }
        if let Some(e) = eos {
            out.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e)));
        }
        out
    }
}
