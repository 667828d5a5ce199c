//! Compiling a [`GrammarSpec`] into llguidance's parser, once per distinct spec.
//!
//! [`GrammarCompiler`] owns the tokenizer environment and llguidance's `ParserFactory`
//! (built once per model) and a bounded LRU cache of compiled grammars keyed by the spec.
//! A [`CompiledGrammar`] is a started matcher that was never fed a token; each sequence
//! deep-clones it ([`CompiledGrammar::matcher`]), so compiling happens once per spec and a
//! clone costs microseconds.
//!
//! Mapping (the whole of it): `JsonObject` = the schema `{"type": "object"}`; `JsonSchema`
//! = llguidance's JSON-schema compiler; `Regex` = a Lark `start: /rx/` (anchored);
//! `Choice` = a Lark alternation of JSON-quoted literals; `Lark` = llguidance's Lark
//! dialect. JSON is compact ([`JSON_OPTIONS`]: `,` and `:` separators, no free
//! whitespace) unless the schema carries its own `x-guidance` options.
//!
//! Invariants: compiling may take milliseconds and is never done on the engine thread or
//! an async runtime thread (callers use a blocking pool); llguidance's limits
//! ([`parser_limits`]) make a pathological grammar fail with [`GrammarError::Invalid`]
//! instead of running long. A failed compile is not cached (it is cheap to fail again, and
//! caching errors would let bad requests evict good grammars).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use baton_core::structured::GrammarSpec;
use baton_formats::Tokenizer;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::TokEnv;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use lru::LruCache;

use crate::tok_env::BatonTokEnv;
use crate::{GrammarError, SequenceGrammar};

/// Compiled grammars kept per model: far more distinct schemas than a server sees at once
/// (a compiled grammar is tens of KiB to a few MiB for large schemas).
pub const GRAMMAR_CACHE_ENTRIES: usize = 256;

/// JSON compile options: compact separators, no whitespace between tokens. vLLM's default
/// lets the model put any whitespace there; a small model then can loop on newlines until
/// `max_tokens`, so Baton pins the compact form (what `json.dumps(separators=(",", ":"))`
/// prints). A schema may still override this with llguidance's `x-guidance` key.
pub fn json_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ",".into(),
        key_separator: ":".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// llguidance's limits for every grammar Baton compiles. These are llguidance's defaults
/// (what vLLM and SGLang run with), spelled out so a change upstream does not silently
/// loosen them; `verbose_errors` is off so a 400 names the problem without echoing the
/// whole grammar back.
pub fn parser_limits() -> ParserLimits {
    ParserLimits {
        // Earley items per row: the grammar's branching factor (~0.1 ms per 2k).
        max_items_in_row: 2_000,
        // Lexer construction fuel (~50k/ms): about 20 ms of regex work at most.
        initial_lexer_fuel: 1_000_000,
        // Per-mask lexer fuel (~14k/ms) and Earley items (~20k/ms): ~15 ms per step at most.
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        // Lexer DFA states (~1-2 KiB each): memory, not time.
        max_lexer_states: 250_000,
        // Grammar symbols: a few MiB of JSON schema.
        max_grammar_size: 500_000,
        precompute_large_lexemes: true,
        verbose_errors: false,
    }
}

/// Compiles grammar specs for one model's tokenizer; clones share the tokenizer
/// environment and the cache.
#[derive(Clone)]
pub struct GrammarCompiler {
    inner: Arc<CompilerInner>,
}

struct CompilerInner {
    factory: ParserFactory,
    tokenizer_vocab: usize,
    model_vocab: usize,
    eos_token_ids: Vec<u32>,
    cache: Mutex<LruCache<GrammarSpec, CompiledGrammar>>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("tokenizer_vocab", &self.inner.tokenizer_vocab)
            .field("model_vocab", &self.inner.model_vocab)
            .field("eos_token_ids", &self.inner.eos_token_ids)
            .finish()
    }
}

impl GrammarCompiler {
    /// The tokenizer's token bytes -> a toktrie `TokEnv`; `model_vocab` >= tokenizer vocab
    /// (ids past the tokenizer's are never allowed); `eos_token_ids` are what "end" means.
    /// Builds a trie over the whole vocabulary (tens of milliseconds): once per model.
    pub fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32], model_vocab: usize) -> Result<Self, GrammarError> {
        let env: TokEnv = Arc::new(BatonTokEnv::new(tokenizer, eos_token_ids, model_vocab)?);
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = parser_limits();
        let capacity = NonZeroUsize::new(GRAMMAR_CACHE_ENTRIES).unwrap_or(NonZeroUsize::MIN);
        Ok(Self {
            inner: Arc::new(CompilerInner {
                factory,
                tokenizer_vocab: tokenizer.vocab_size(),
                model_vocab,
                eos_token_ids: eos_token_ids.to_vec(),
                cache: Mutex::new(LruCache::new(capacity)),
            }),
        })
    }

    /// Compiles (or takes from the bounded cache keyed by the spec) a grammar; may take
    /// milliseconds: never call it on an async runtime thread or the engine thread.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        if let Some(hit) = self.lock_cache().get(spec) {
            return Ok(hit.clone());
        }
        // Compile outside the lock: two threads compiling the same new spec at once both
        // do the work (rare, and harmless) rather than one blocking every other compile.
        let compiled = self.compile_uncached(spec)?;
        self.lock_cache().put(spec.clone(), compiled.clone());
        Ok(compiled)
    }

    /// How many compiled grammars the cache holds.
    pub fn cached_grammars(&self) -> usize {
        self.lock_cache().len()
    }

    /// Ids the model can sample (the mask length).
    pub fn model_vocab(&self) -> usize {
        self.inner.model_vocab
    }

    /// The ids that end a sequence.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, LruCache<GrammarSpec, CompiledGrammar>> {
        // A panic while holding the lock leaves a consistent cache (puts and gets are
        // single calls), so a poisoned lock is still usable.
        self.inner.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let kind = spec.kind();
        let invalid = |message: String| GrammarError::Invalid { kind, message };
        let grammar = top_level_grammar(spec).map_err(invalid)?;
        let parser = self.inner.factory.create_parser(grammar).map_err(|e| invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(invalid(message));
        }
        Ok(CompiledGrammar {
            inner: Arc::new(CompiledInner {
                matcher,
                kind,
                tokenizer_vocab: self.inner.tokenizer_vocab,
                model_vocab: self.inner.model_vocab,
                eos_token_ids: self.inner.eos_token_ids.clone(),
            }),
        })
    }
}

/// The llguidance grammar a spec stands for (see the module doc for the mapping).
fn top_level_grammar(spec: &GrammarSpec) -> Result<TopLevelGrammar, String> {
    Ok(match spec {
        GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(serde_json::json!({
            "type": "object"
        }))),
        GrammarSpec::JsonSchema(text) => {
            let schema: serde_json::Value =
                serde_json::from_str(text).map_err(|e| format!("the schema is not valid JSON: {e}"))?;
            let schema = match schema {
                // `true` accepts any JSON; `false` nothing (llguidance reports it).
                serde_json::Value::Bool(true) => serde_json::json!({}),
                serde_json::Value::Object(_) | serde_json::Value::Bool(false) => schema,
                other => return Err(format!("a JSON schema must be an object or a boolean, not {other}")),
            };
            TopLevelGrammar::from_json_schema(with_json_options(schema))
        }
        GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GrammarSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err("at least one choice is needed".into());
            }
            let alternatives: Vec<String> =
                choices.iter().map(|c| serde_json::Value::from(c.as_str()).to_string()).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
        }
        GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

/// `schema` with Baton's JSON options unless it names its own (`x-guidance`).
fn with_json_options(mut schema: serde_json::Value) -> serde_json::Value {
    if let serde_json::Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
        && let Ok(options) = serde_json::to_value(json_options())
    {
        map.insert("x-guidance".into(), options);
    }
    schema
}

/// A compiled grammar: cheap to clone (shared); [`CompiledGrammar::matcher`] starts a
/// sequence on it.
#[derive(Clone)]
pub struct CompiledGrammar {
    inner: Arc<CompiledInner>,
}

struct CompiledInner {
    /// Started, never fed: the template every sequence's matcher is cloned from.
    matcher: Matcher,
    kind: &'static str,
    tokenizer_vocab: usize,
    model_vocab: usize,
    eos_token_ids: Vec<u32>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar").field("kind", &self.inner.kind).finish()
    }
}

impl CompiledGrammar {
    /// A fresh matcher for one sequence (a deep clone of the compiled state: the lexer
    /// caches are per sequence so sequences never contend).
    pub fn matcher(&self) -> SequenceGrammar {
        SequenceGrammar::new(
            self.inner.matcher.deep_clone(),
            self.inner.tokenizer_vocab,
            self.inner.model_vocab,
            self.inner.eos_token_ids.clone(),
        )
    }

    /// The spec kind it was compiled from (for errors and metrics).
    pub fn kind(&self) -> &'static str {
        self.inner.kind
    }
}
