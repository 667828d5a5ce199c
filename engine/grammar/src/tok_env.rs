//! Baton's tokenizer as a toktrie [`TokenizerEnv`]: what llguidance needs to know about a
//! vocabulary (each token's bytes, which are special, which mean "end") and how to tokenize
//! bytes canonically (forced tokens).
//!
//! Invariants: the trie covers exactly `model_vocab` ids. Ids the tokenizer does not know
//! (`tokenizer.vocab_size()..model_vocab`, padding rows of the model's embedding) are
//! special tokens with unique names, so no grammar text can ever match them (a Lark
//! `<[id]>` could name one; [`crate::SequenceGrammar::mask`] clears them anyway). Special
//! tokens carry toktrie's `0xFF` marker before their name, as toktrie expects. A tokenizer
//! larger than the model (Llama 3.2 Vision's tokenizer beside a 128,256-row text model has
//! `<|image|>` at 128,256) loses its ids past `model_vocab`: the model can never produce
//! them, and canonical tokenizations that use them fall back to the trie's greedy one.

use baton_formats::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::GrammarError;

/// A [`TokenizerEnv`] over a Baton [`Tokenizer`].
pub(crate) struct BatonTokEnv {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl BatonTokEnv {
    /// The trie of `tokenizer`'s tokens padded to `model_vocab` ids; `eos_token_ids` (not
    /// empty) end a sequence.
    pub(crate) fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32], model_vocab: usize) -> Result<Self, GrammarError> {
        let tok_vocab = tokenizer.vocab_size();
        let vocab_u32 = u32::try_from(model_vocab)
            .map_err(|_| GrammarError::Tokenizer(format!("vocabulary of {model_vocab} ids is too large")))?;
        let Some(&first_eos) = eos_token_ids.first() else {
            return Err(GrammarError::Tokenizer("no end-of-sequence token id".into()));
        };
        if let Some(bad) = eos_token_ids.iter().find(|&&id| id >= vocab_u32) {
            return Err(GrammarError::Tokenizer(format!("EOS id {bad} is outside the vocabulary ({model_vocab})")));
        }
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(model_vocab);
        for id in 0..vocab_u32 {
            let special_name = if id as usize >= tok_vocab {
                Some(format!("<[pad {id}]>"))
            } else if tokenizer.is_special(id) || eos_token_ids.contains(&id) {
                Some(tokenizer.id_to_token(id).unwrap_or_else(|| format!("<[{id}]>")))
            } else {
                None
            };
            let bytes = match special_name {
                Some(name) => {
                    let mut b = Vec::with_capacity(name.len() + 1);
                    b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    b.extend_from_slice(name.as_bytes());
                    b
                }
                None => tokenizer.token_bytes(id).unwrap_or_default(),
            };
            words.push(bytes);
        }
        let info = TokRxInfo::new(vocab_u32, first_eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos_token_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_token_ids);
        }
        Ok(Self { tokenizer: tokenizer.clone(), trie })
    }
}

impl TokenizerEnv for BatonTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Our tokenizer's own (canonical) tokenization of the valid UTF-8 runs, the trie's
    /// greedy one for invalid bytes; a tokenizer error falls back to greedy too (this trait
    /// cannot fail, and a non-canonical tokenization only costs a forced-token shortcut).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let vocab = self.trie.vocab_size();
        self.trie.tokenize_with_greedy_fallback(s, |text| match self.tokenizer.encode(text, false) {
            // Ids past the model's rows (a tokenizer larger than the model) are not tokens here.
            Ok(ids) if ids.iter().all(|&id| (id as usize) < vocab) => ids,
            _ => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}
