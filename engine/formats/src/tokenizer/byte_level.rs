//! Byte-level (GPT-2 style) decoding by table, for tokenizers whose decoder is exactly
//! `ByteLevel` (SmolLM2, Llama 3, Qwen2, GPT-2 and the GGUF byte-level BPEs Baton builds).
//!
//! For such a tokenizer, `decode(ids)` is by construction the lossy UTF-8 reading of the
//! concatenated bytes of the ids' tokens (each token's characters mapped back through GPT-2's
//! byte↔unicode table, or its raw UTF-8 when a character is outside that table; special
//! tokens dropped when skipping them). [`ByteTable`] precomputes those bytes once per
//! vocabulary, so a streaming decoder appends a token's bytes in O(token length) instead of
//! re-decoding a window of ids through `tokenizers` twice per token.
//!
//! Invariant: for every id in the vocabulary, `bytes(id)` are exactly what `tokenizers`'
//! `ByteLevel` decoder turns that token into (checked against it in the tests).

use std::collections::HashMap;
use tokenizers::DecoderWrapper;

/// GPT-2's `bytes_to_unicode`, inverted: the printable character that stands for each byte.
fn char_to_byte() -> HashMap<char, u8> {
    let mut bytes: Vec<u8> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
    let mut n = 0;
    for b in 0..=255u8 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    bytes.into_iter().zip(chars).filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b))).collect()
}

/// The decoded bytes of every token of a byte-level vocabulary.
#[derive(Debug)]
pub(crate) struct ByteTable {
    /// All tokens' bytes, back to back.
    bytes: Vec<u8>,
    /// `bytes[offsets[id]..offsets[id + 1]]` are token `id`'s bytes; `vocab_size + 1` entries.
    offsets: Vec<u32>,
    /// Whether `id` is dropped by `decode(.., skip_special_tokens = true)`.
    special: Vec<bool>,
}

impl ByteTable {
    /// The table of `inner`'s first `vocab_size` ids, or `None` when its decoder is not
    /// plain `ByteLevel` (then decoding must go through `tokenizers`).
    pub(crate) fn build(inner: &tokenizers::Tokenizer, vocab_size: usize) -> Option<Self> {
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let map = char_to_byte();
        let added = inner.get_added_vocabulary();
        let mut bytes = Vec::with_capacity(vocab_size * 8);
        let mut offsets = Vec::with_capacity(vocab_size + 1);
        let mut special = Vec::with_capacity(vocab_size);
        offsets.push(0);
        for id in 0..vocab_size {
            // `decode` resolves an id exactly this way (added tokens first).
            let token = u32::try_from(id).ok().and_then(|id| inner.id_to_token(id));
            if let Some(token) = &token {
                let start = bytes.len();
                for c in token.chars() {
                    match map.get(&c) {
                        Some(&b) => bytes.push(b),
                        None => {
                            // As `ByteLevel::decode_chain`: a character outside the table
                            // makes the whole token its raw UTF-8.
                            bytes.truncate(start);
                            bytes.extend_from_slice(token.as_bytes());
                            break;
                        }
                    }
                }
            }
            offsets.push(u32::try_from(bytes.len()).ok()?);
            special.push(token.as_deref().is_some_and(|t| added.is_special_token(t)));
        }
        Some(Self { bytes, offsets, special })
    }

    /// Token `id`'s bytes (empty for an id with no token), or `None` outside the vocabulary.
    pub(crate) fn bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        self.bytes.get(start as usize..end as usize)
    }

    /// Whether `id` is a special token (dropped when skipping special tokens).
    pub(crate) fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }
}

/// Length of the longest suffix of `bytes` that is an incomplete but still possibly valid
/// UTF-8 sequence (0 to 3 bytes): what a streaming decoder must hold back.
pub(crate) fn incomplete_utf8_suffix(bytes: &[u8]) -> usize {
    (1..=bytes.len().min(3))
        .find(|&k| match std::str::from_utf8(&bytes[bytes.len() - k..]) {
            Err(e) => e.valid_up_to() == 0 && e.error_len().is_none(),
            Ok(_) => false,
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let map = char_to_byte();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'a'], b'a');
        assert_eq!(map[&'ÿ'], 0xFF);
    }

    #[test]
    fn incomplete_suffixes() {
        assert_eq!(incomplete_utf8_suffix(b""), 0);
        assert_eq!(incomplete_utf8_suffix(b"abc"), 0);
        assert_eq!(incomplete_utf8_suffix("a中".as_bytes()), 0);
        assert_eq!(incomplete_utf8_suffix(&[b'a', 0xE4]), 1);
        assert_eq!(incomplete_utf8_suffix(&[b'a', 0xE4, 0xB8]), 2);
        assert_eq!(incomplete_utf8_suffix(&[0xF0, 0x9F, 0x98]), 3);
        // A lone continuation byte or an invalid lead can never become valid: not held.
        assert_eq!(incomplete_utf8_suffix(&[b'a', 0xB8]), 0);
        assert_eq!(incomplete_utf8_suffix(&[b'a', 0xFF]), 0);
    }
}
