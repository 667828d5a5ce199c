//! The grammar crate's one error type. [`GrammarError::Invalid`] is the client's fault (a
//! 400 naming the spec kind); the others are the server's (tokenizer unusable for grammars,
//! a matcher that rejected a sampled token or could not compute a mask).

/// What went wrong compiling a grammar or stepping a matcher.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The request's grammar cannot be compiled (bad JSON schema, regex or Lark grammar,
    /// an empty choice list, or one past llguidance's limits). `kind` is
    /// [`baton_core::structured::GrammarSpec::kind`]; `message` is llguidance's own.
    #[error("invalid {kind} grammar: {message}")]
    Invalid {
        /// The spec kind (`json_object`, `json_schema`, `regex`, `choice`, `grammar`).
        kind: &'static str,
        /// Why, in llguidance's words.
        message: String,
    },
    /// The tokenizer cannot back a grammar engine (e.g. no EOS id, a vocabulary larger
    /// than the model's).
    #[error("tokenizer unusable for structured outputs: {0}")]
    Tokenizer(String),
    /// A token the grammar does not allow was fed to a matcher (the sampler ignored the
    /// mask, or the grammar had already finished).
    #[error("token {token} is not allowed by the grammar: {message}")]
    Rejected {
        /// The rejected token id.
        token: u32,
        /// llguidance's reason.
        message: String,
    },
    /// The matcher failed computing a mask (a step past llguidance's per-step limits, or a
    /// grammar with no way to continue).
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
}

impl GrammarError {
    /// True when the request is at fault (render as 400 / INVALID_ARGUMENT).
    pub fn is_invalid_request(&self) -> bool {
        matches!(self, Self::Invalid { .. })
    }
}
