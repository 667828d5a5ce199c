//! Streaming detokenization, in one of two ways chosen by the tokenizer's decoder:
//!
//! - **By bytes** (plain byte-level decoders: SmolLM2, Llama 3, Qwen2): each id appends its
//!   token's precomputed bytes (`byte_level`), and everything but a trailing incomplete UTF-8
//!   sequence is emitted. O(token length) per id, no `tokenizers` call. The concatenated
//!   output is exactly `decode(all ids)`.
//! - **By windows** (every other decoder, e.g. SentencePiece's Metaspace): each new id is
//!   decoded together with a short window of the ids before it, and only the text beyond the
//!   window's own decoding is emitted (the TGI/vLLM scheme). That keeps decoders that strip a
//!   leading space from eating real spaces mid-stream, and text is held back while it ends in
//!   U+FFFD, i.e. while a multi-byte UTF-8 character is still split across tokens.

use super::Tokenizer;
use super::byte_level::{ByteTable, incomplete_utf8_suffix};
use crate::error::FormatError;
use std::sync::Arc;

/// Prompt ids kept as context for the first generated token (window mode).
const PROMPT_CONTEXT: usize = 5;

#[derive(Debug, Clone)]
enum State {
    Bytes {
        table: Arc<ByteTable>,
        /// Bytes not emitted yet: an incomplete UTF-8 sequence (at most 3 bytes).
        pending: Vec<u8>,
    },
    Window {
        ids: Vec<u32>,
        /// Start of the decode window.
        prefix_offset: usize,
        /// End of the text already emitted (as an index into `ids`).
        read_offset: usize,
    },
}

/// Turns a stream of token ids into text deltas.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    state: State,
    skip_special_tokens: bool,
    pushed: usize,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose output continues `prompt_ids` (only their last few ids are kept
    /// as context; none of their text is emitted).
    pub fn new(tokenizer: Tokenizer, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let state = match &tokenizer.byte_table {
            // Byte-level text needs no context: a token's bytes do not depend on its
            // neighbours.
            Some(table) => State::Bytes { table: table.clone(), pending: Vec::new() },
            None => {
                let ids = prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
                let n = ids.len();
                State::Window { ids, prefix_offset: 0, read_offset: n }
            }
        };
        Self { tokenizer, state, skip_special_tokens, pushed: 0 }
    }

    /// Adds one generated id and returns the text that became final (possibly empty).
    /// An id outside the vocabulary is an error and leaves the state unchanged.
    pub fn push(&mut self, id: u32) -> Result<String, FormatError> {
        let tokenizer = &self.tokenizer;
        let skip = self.skip_special_tokens;
        let text = match &mut self.state {
            State::Bytes { table, pending } => {
                let bytes = table.bytes(id).ok_or_else(|| tokenizer.out_of_vocabulary(id))?;
                if !(skip && table.is_special(id)) {
                    pending.extend_from_slice(bytes);
                }
                let cut = pending.len() - incomplete_utf8_suffix(pending);
                let text = match std::str::from_utf8(&pending[..cut]) {
                    Ok(s) => s.to_owned(),
                    Err(_) => String::from_utf8_lossy(&pending[..cut]).into_owned(),
                };
                pending.drain(..cut);
                text
            }
            State::Window { ids, prefix_offset, read_offset } => {
                ids.push(id);
                let prefix = decode(tokenizer, ids, *prefix_offset, *read_offset, skip)?;
                let full = match decode(tokenizer, ids, *prefix_offset, ids.len(), skip) {
                    Ok(t) => t,
                    Err(e) => {
                        ids.pop();
                        return Err(e);
                    }
                };
                if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
                    *prefix_offset = *read_offset;
                    *read_offset = ids.len();
                    full[prefix.len()..].to_string()
                } else {
                    String::new()
                }
            }
        };
        self.pushed += 1;
        Ok(text)
    }

    /// Returns whatever is still held back (e.g. an incomplete UTF-8 sequence at the end of
    /// generation, rendered with U+FFFD) and marks it emitted.
    pub fn flush(&mut self) -> Result<String, FormatError> {
        let skip = self.skip_special_tokens;
        match &mut self.state {
            State::Bytes { pending, .. } => {
                let text = String::from_utf8_lossy(pending).into_owned();
                pending.clear();
                Ok(text)
            }
            State::Window { ids, prefix_offset, read_offset } => {
                let prefix = decode(&self.tokenizer, ids, *prefix_offset, *read_offset, skip)?;
                let full = decode(&self.tokenizer, ids, *prefix_offset, ids.len(), skip)?;
                *prefix_offset = *read_offset;
                *read_offset = ids.len();
                Ok(match full.strip_prefix(&prefix) {
                    Some(rest) => rest.to_string(),
                    None => String::new(),
                })
            }
        }
    }

    /// Ids pushed so far (not counting the prompt context).
    pub fn generated_len(&self) -> usize {
        self.pushed
    }
}

fn decode(tokenizer: &Tokenizer, ids: &[u32], from: usize, to: usize, skip: bool) -> Result<String, FormatError> {
    if from >= to {
        return Ok(String::new());
    }
    tokenizer.decode(&ids[from..to], skip)
}
