//! Constrained decoding for Baton: a request's [`GrammarSpec`] compiled with
//! [llguidance](https://github.com/guidance-ai/llguidance) against the model's tokenizer,
//! and per-sequence matchers that give the sampler a [`TokenMask`] each step.
//!
//! Life of a constrained request: the handle compiles the spec on a blocking thread with
//! [`GrammarCompiler::compile`] (cached by spec; a bad spec is [`GrammarError::Invalid`],
//! a 400); the engine thread starts a [`SequenceGrammar`] from the [`CompiledGrammar`],
//! feeds it the output tokens the request already has, and then, each step, asks
//! [`SequenceGrammar::mask`] before sampling and [`SequenceGrammar::consume`]s the token
//! sampled. [`SequenceGrammar::is_finished`] means the output is complete: the request
//! stops like on EOS. Why llguidance rather than outlines-core:
//! `bench/notes/structured-outputs.md`.
//!
//! Modules: `tok_env` (the tokenizer as toktrie sees it), `compiler` (spec → grammar,
//! limits, cache), `sequence` (one sequence's matcher and masks), `error`.
//!
//! [`GrammarSpec`]: baton_core::structured::GrammarSpec
//! [`TokenMask`]: baton_core::structured::TokenMask

mod compiler;
mod error;
mod sequence;
mod tok_env;

pub use compiler::{CompiledGrammar, GRAMMAR_CACHE_ENTRIES, GrammarCompiler, json_options, parser_limits};
pub use error::GrammarError;
pub use sequence::SequenceGrammar;
