//! One constrained sequence's grammar state: feed it the sequence's tokens, ask it which
//! tokens may come next.
//!
//! Invariants: a [`SequenceGrammar`] has consumed exactly the sequence's output tokens so
//! far (the engine feeds it the existing output when it is created, then each sampled
//! token); its masks cover `model_vocab` ids, never allow an id the tokenizer does not
//! know, and allow the EOS ids exactly when the output so far is a complete match.

use baton_core::structured::TokenMask;
use llguidance::Matcher;

use crate::GrammarError;

/// One sequence's grammar state (a deep clone of a [`crate::CompiledGrammar`]).
pub struct SequenceGrammar {
    matcher: Matcher,
    tokenizer_vocab: usize,
    model_vocab: usize,
    eos_token_ids: Vec<u32>,
}

impl std::fmt::Debug for SequenceGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceGrammar")
            .field("finished", &self.is_finished())
            .field("error", &self.matcher.get_error())
            .finish()
    }
}

impl SequenceGrammar {
    pub(crate) fn new(matcher: Matcher, tokenizer_vocab: usize, model_vocab: usize, eos_token_ids: Vec<u32>) -> Self {
        Self { matcher, tokenizer_vocab, model_vocab, eos_token_ids }
    }

    /// Advances by one sampled token; a token the grammar does not allow is an error (and
    /// leaves the matcher failed: every later call errs too). An EOS id once the grammar
    /// is complete is accepted and changes nothing.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos_token_ids.contains(&token) && self.matcher.is_stopped() && !self.matcher.is_error() {
            return Ok(());
        }
        if token as usize >= self.tokenizer_vocab {
            return Err(GrammarError::Rejected {
                token,
                message: format!("id past the tokenizer's vocabulary ({})", self.tokenizer_vocab),
            });
        }
        self.matcher.consume_token(token).map_err(|e| GrammarError::Rejected { token, message: e.to_string() })
    }

    /// Feeds several tokens in order (the output a sequence already has when its matcher
    /// is created).
    pub fn consume_all(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        tokens.iter().try_for_each(|&t| self.consume(t))
    }

    /// The tokens allowed next: `model_vocab` ids long; the EOS ids are allowed iff the
    /// output so far is a complete match (only they are, once the grammar is finished).
    pub fn mask(&mut self) -> Result<TokenMask, GrammarError> {
        if let Some(message) = self.matcher.get_error() {
            return Err(GrammarError::Matcher(message));
        }
        if self.matcher.is_stopped() {
            return Ok(TokenMask::allowing(self.model_vocab, self.eos_token_ids.iter().copied()));
        }
        let vob = self.matcher.compute_mask().map_err(|e| GrammarError::Matcher(e.to_string()))?;
        let mut words = vob.as_slice().to_vec();
        clear_from(&mut words, self.tokenizer_vocab);
        Ok(TokenMask::from_words(words, self.model_vocab))
    }

    /// The grammar can take nothing more (the output is a complete match with no possible
    /// continuation): the sequence should stop as if it sampled EOS.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// The matcher failed earlier (a rejected token or a mask error), with why.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }
}

/// Clears every bit at or past `from` (ids the tokenizer does not know).
fn clear_from(words: &mut [u32], from: usize) {
    let first_word = from / 32;
    if let Some(w) = words.get_mut(first_word)
        && !from.is_multiple_of(32)
    {
        *w &= (1u32 << (from % 32)) - 1;
    }
    let start = first_word + usize::from(!from.is_multiple_of(32));
    if let Some(rest) = words.get_mut(start..) {
        rest.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::clear_from;

    #[test]
    fn clearing_keeps_exactly_the_ids_below_the_bound() {
        for from in [0, 1, 31, 32, 33, 64, 70, 96] {
            let mut words = vec![u32::MAX; 3];
            clear_from(&mut words, from);
            let set: Vec<usize> = (0..96).filter(|&i| words[i / 32] >> (i % 32) & 1 == 1).collect();
            assert_eq!(set, (0..from.min(96)).collect::<Vec<_>>(), "from {from}");
        }
    }
}
