//! Streaming detokenization. Each new id is decoded together with a short window of the
//! ids before it, and only the text beyond the window's own decoding is emitted (the
//! TGI/vLLM scheme). That keeps decoders that strip a leading space from eating real
//! spaces mid-stream, and text is held back while it ends in U+FFFD, i.e. while a
//! multi-byte UTF-8 character is still split across tokens.

use super::Tokenizer;
use crate::error::FormatError;

/// Prompt ids kept as context for the first generated token.
const PROMPT_CONTEXT: usize = 5;

/// Turns a stream of token ids into text deltas.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// End of the text already emitted (as an index into `ids`).
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose output continues `prompt_ids` (only their last few ids are kept
    /// as context; none of their text is emitted).
    pub fn new(tokenizer: Tokenizer, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let ids = prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let n = ids.len();
        Self { tokenizer, ids, prefix_offset: 0, read_offset: n, skip_special_tokens }
    }

    /// Adds one generated id and returns the text that became final (possibly empty).
    /// An id outside the vocabulary is an error and leaves the state unchanged.
    pub fn push(&mut self, id: u32) -> Result<String, FormatError> {
        self.ids.push(id);
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = match self.decode(self.prefix_offset, self.ids.len()) {
            Ok(t) => t,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Returns whatever is still held back (e.g. an incomplete UTF-8 sequence at the end of
    /// generation, rendered with U+FFFD) and marks it emitted.
    pub fn flush(&mut self) -> Result<String, FormatError> {
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = self.decode(self.prefix_offset, self.ids.len())?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(match full.strip_prefix(&prefix) {
            Some(rest) => rest.to_string(),
            None => String::new(),
        })
    }

    /// Ids pushed so far (after the prompt context).
    pub fn generated_len(&self) -> usize {
        self.ids.len()
    }

    fn decode(&self, from: usize, to: usize) -> Result<String, FormatError> {
        if from >= to {
            return Ok(String::new());
        }
        self.tokenizer.decode(&self.ids[from..to], self.skip_special_tokens)
    }
}
