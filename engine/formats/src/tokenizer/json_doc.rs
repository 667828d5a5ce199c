//! The pieces of a `tokenizer.json` document that the GGUF-built tokenizers share
//! (`gguf_vocab`, `gguf_spm`): building a `tokenizers` tokenizer from the document, and the
//! post-processor that prepends BOS.

use serde_json::{Value, json};

use crate::error::FormatError;

/// A `tokenizers` tokenizer from its `tokenizer.json` document; `context` names the source in
/// errors.
pub(crate) fn build_tokenizer(doc: &Value, context: &str) -> Result<tokenizers::Tokenizer, FormatError> {
    let bytes = serde_json::to_vec(doc)
        .map_err(|e| FormatError::Tokenizer { context: context.to_string(), message: e.to_string() })?;
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| FormatError::Tokenizer { context: context.to_string(), message: e.to_string() })
}

/// The post-processor that prepends token `bos` (an id into `tokens`) when special tokens are
/// requested; None without one.
pub(crate) fn bos_post_processor(tokens: &[String], bos: Option<u32>) -> Option<Value> {
    let (id, s) = bos.and_then(|b| tokens.get(b as usize).map(|s| (b, s)))?;
    Some(json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": s, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {s.as_str(): {"id": s, "ids": [id], "tokens": [s]}}
    }))
}
