//! baton-grammar on real tokenizers: the default model's (SmolLM2 GGUF, 49,152 ids) and a
//! tiny learned byte-level BPE as a HF `tokenizer.json` would give it.

use baton_core::structured::GrammarSpec;
use baton_formats::testing::{EOS_ID, TinySpec, default_model_path};
use baton_formats::{LoadFormat, Tokenizer, load_model_info};
use baton_grammar::{GrammarCompiler, GrammarError, SequenceGrammar};

/// The default model's tokenizer, its EOS ids and its vocabulary size.
fn default_tokenizer() -> (Tokenizer, Vec<u32>, usize) {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    let info = load_model_info(&path, LoadFormat::Auto).expect("default model header");
    let tok = info.tokenizer.expect("GGUF tokenizer");
    (tok, info.generation.eos_token_ids.clone(), info.config.vocab_size)
}

/// The tiny test models' tokenizer (learned byte-level BPE) wrapped as a HF tokenizer.
fn tiny_tokenizer() -> Tokenizer {
    let bpe = TinySpec::llama().tokenizer_spec().expect("learn tiny BPE");
    Tokenizer::from_inner(bpe.build("tiny").expect("build tiny tokenizer"), None, None, "tiny")
}

fn default_compiler() -> (GrammarCompiler, Tokenizer, Vec<u32>) {
    let (tok, eos, vocab) = default_tokenizer();
    (GrammarCompiler::new(&tok, &eos, vocab).expect("compiler"), tok, eos)
}

/// Feeds `text` (tokenized canonically) to a fresh matcher of `spec`, checking each token
/// was allowed by the mask before it.
fn walk(
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    spec: &GrammarSpec,
    text: &str,
) -> Result<SequenceGrammar, GrammarError> {
    let mut m = compiler.compile(spec)?.matcher();
    for id in tok.encode(text, false).expect("encode") {
        assert!(m.mask()?.allows(id), "{spec:?}: mask refuses token {id} ({:?}) of {text:?}", tok.id_to_token(id));
        m.consume(id)?;
    }
    Ok(m)
}

fn schema() -> GrammarSpec {
    GrammarSpec::JsonSchema(
        serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        })
        .to_string(),
    )
}

#[test]
fn every_spec_kind_accepts_a_matching_output_on_the_default_tokenizer() {
    let (c, tok, eos) = default_compiler();
    let cases = [
        (GrammarSpec::JsonObject, r#"{"a":[1,2,{"b":null}],"c":"d"}"#),
        (schema(), r#"{"name":"Ada Lovelace","age":36,"tags":["a","b"]}"#),
        (GrammarSpec::Regex(r"\d{3}-[a-z]+".into()), "123-abc"),
        (GrammarSpec::Choice(vec!["yes".into(), "no".into(), "say \"maybe\"".into()]), "say \"maybe\""),
        (GrammarSpec::Lark("start: \"(\" item (\",\" item)* \")\"\nitem: /[0-9]+/".into()), "(1,22,333)"),
    ];
    for (spec, text) in cases {
        let mut m = walk(&c, &tok, &spec, text).unwrap_or_else(|e| panic!("{spec:?} on {text:?}: {e}"));
        let mask = m.mask().expect("final mask");
        for &e in &eos {
            assert!(mask.allows(e), "{spec:?}: EOS refused after a complete {text:?}");
        }
    }
}

#[test]
fn every_spec_kind_works_on_a_hf_byte_level_tokenizer() {
    let tok = tiny_tokenizer();
    let c = GrammarCompiler::new(&tok, &[EOS_ID], tok.vocab_size()).expect("compiler");
    let cases = [
        (GrammarSpec::JsonObject, r#"{"the":"cat"}"#),
        (schema(), r#"{"name":"sat on","age":7}"#),
        (GrammarSpec::Regex("(the|a) [a-z]+".into()), "the mat"),
        (GrammarSpec::Choice(vec!["cat".into(), "dog".into()]), "dog"),
        (GrammarSpec::Lark("start: word+\nword: /[a-z]+ /".into()), "the cat "),
    ];
    for (spec, text) in cases {
        let mut m = walk(&c, &tok, &spec, text).unwrap_or_else(|e| panic!("{spec:?} on {text:?}: {e}"));
        assert!(m.mask().expect("mask").allows(EOS_ID), "{spec:?}: EOS refused after {text:?}");
    }
}

#[test]
fn invalid_grammars_are_invalid_with_llguidance_s_message() {
    let (c, _, _) = default_compiler();
    let cases = [
        (GrammarSpec::JsonSchema("{not json".into()), "json_schema", "not valid JSON"),
        (GrammarSpec::JsonSchema(r#"{"type": "frobnicate"}"#.into()), "json_schema", "frobnicate"),
        (GrammarSpec::JsonSchema("42".into()), "json_schema", "object or a boolean"),
        (GrammarSpec::Regex("a(b".into()), "regex", ""),
        (GrammarSpec::Lark("start: undefined_rule".into()), "grammar", "undefined_rule"),
        (GrammarSpec::Choice(vec![]), "choice", "at least one"),
    ];
    for (spec, kind, needle) in cases {
        match c.compile(&spec) {
            Err(GrammarError::Invalid { kind: k, message }) => {
                assert_eq!(k, kind, "{spec:?}");
                assert!(!message.is_empty() && message.contains(needle), "{spec:?}: message {message:?}");
                assert!(GrammarError::Invalid { kind: k, message }.is_invalid_request());
            }
            other => panic!("{spec:?}: expected Invalid, got {other:?}"),
        }
    }
    assert_eq!(c.cached_grammars(), 0, "failed compiles are not cached");
}

#[test]
fn a_token_the_grammar_refuses_is_rejected_and_the_matcher_stays_failed() {
    let (c, tok, _) = default_compiler();
    let mut m = c.compile(&schema()).expect("compile").matcher();
    let open = tok.encode("{", false).expect("encode");
    m.consume_all(&open).expect("{ starts an object");
    let bad = tok.encode("]", false).expect("encode")[0];
    assert!(!m.mask().expect("mask").allows(bad));
    let err = m.consume(bad).expect_err("] cannot follow {");
    assert!(matches!(err, GrammarError::Rejected { token, .. } if token == bad), "{err:?}");
    assert!(!err.is_invalid_request());
    assert!(m.error().is_some());
    assert!(matches!(m.mask(), Err(GrammarError::Matcher(_))));
}

#[test]
fn eos_is_allowed_only_when_the_output_is_a_complete_match() {
    let (c, tok, eos) = default_compiler();
    let mut m = c.compile(&GrammarSpec::Regex("ab+".into())).expect("compile").matcher();
    let id = |s: &str| tok.encode(s, false).expect("encode")[0];
    let eos_allowed = |m: &mut SequenceGrammar| {
        let mask = m.mask().expect("mask");
        eos.iter().all(|&e| mask.allows(e))
    };
    assert!(!eos_allowed(&mut m), "empty output does not match ab+");
    m.consume(id("a")).expect("a");
    assert!(!eos_allowed(&mut m), "'a' does not match ab+");
    assert!(!m.is_finished());
    m.consume(id("b")).expect("b");
    assert!(eos_allowed(&mut m), "'ab' matches ab+");
    assert!(m.mask().expect("mask").allows(id("b")), "and may go on");
    assert!(!m.is_finished());

    // A grammar with one possible output finishes as soon as it is complete, then allows
    // only EOS, and takes EOS without complaint.
    let mut m = c.compile(&GrammarSpec::Choice(vec!["yes".into()])).expect("compile").matcher();
    m.consume_all(&tok.encode("yes", false).expect("encode")).expect("yes");
    assert!(m.is_finished());
    let mask = m.mask().expect("mask");
    assert_eq!(mask.count_allowed(), eos.len());
    m.consume(eos[0]).expect("EOS after a finished grammar");
}

#[test]
fn ids_past_the_tokenizer_vocabulary_are_never_allowed() {
    let (tok, eos, vocab) = default_tokenizer();
    let model_vocab = vocab + 77;
    let c = GrammarCompiler::new(&tok, &eos, model_vocab).expect("compiler");
    let pad = vocab + 5;
    // `<[id]>` names a token by id in llguidance's Lark: even a grammar that asks for a
    // padding id gets a mask without it.
    for spec in [
        GrammarSpec::Regex("(.|\n)*".into()),
        GrammarSpec::JsonObject,
        GrammarSpec::Lark(format!("start: <[{pad}]> | \"x\"")),
    ] {
        let mut m = c.compile(&spec).unwrap_or_else(|e| panic!("{spec:?}: {e}")).matcher();
        let mask = m.mask().expect("mask");
        assert_eq!(mask.len(), model_vocab);
        assert!((vocab..model_vocab).all(|id| !mask.allows(id as u32)), "{spec:?} allows a padding id");
        assert!(mask.count_allowed() > 0);
        assert!(m.consume(pad as u32).is_err(), "{spec:?}: a padding id is rejected");
    }
    assert!(matches!(GrammarCompiler::new(&tok, &[], vocab), Err(GrammarError::Tokenizer(_))));
}

/// A tokenizer larger than the model (Llama 3.2 Vision's beside a text model): the ids past
/// the model's rows drop out of the vocabulary, and grammars work on the rest.
#[test]
fn a_tokenizer_larger_than_the_model_loses_only_the_ids_past_the_model() {
    let (tok, eos, vocab) = default_tokenizer();
    let model_vocab = vocab - 100;
    let c = GrammarCompiler::new(&tok, &eos, model_vocab).expect("compiler");
    let text = r#"{"name":"Ada","age":36}"#;
    assert!(tok.encode(text, false).expect("encode").iter().all(|&id| (id as usize) < model_vocab));
    let mut m = walk(&c, &tok, &schema(), text).expect("a valid document walks");
    let mask = m.mask().expect("mask");
    assert_eq!(mask.len(), model_vocab);
    assert!(mask.allows(eos[0]), "complete document: EOS allowed");
}

#[test]
fn compiled_grammars_are_cached_by_spec_and_matchers_are_independent() {
    let (c, tok, _) = default_compiler();
    let g1 = c.compile(&schema()).expect("compile");
    let clone = c.clone();
    std::thread::spawn(move || clone.compile(&schema()).expect("compile on another thread")).join().expect("join");
    assert_eq!(c.cached_grammars(), 1);
    c.compile(&GrammarSpec::JsonObject).expect("compile");
    assert_eq!(c.cached_grammars(), 2);
    assert_eq!(g1.kind(), "json_schema");

    let mut a = g1.matcher();
    let mut b = g1.matcher();
    a.consume_all(&tok.encode("{\"name\":", false).expect("encode")).expect("prefix");
    let fresh = g1.matcher().mask().expect("mask");
    assert_eq!(b.mask().expect("mask"), fresh, "b did not see a's tokens");
    assert_ne!(a.mask().expect("mask"), fresh);
}

#[test]
fn grammar_types_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<GrammarCompiler>();
    send_sync::<baton_grammar::CompiledGrammar>();
    send::<SequenceGrammar>();
}
