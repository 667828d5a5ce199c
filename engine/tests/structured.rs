//! Constrained decoding through `start_engine`/`EngineHandle` on the CPU backend: a tiny
//! random model (whose unconstrained output is noise, so only the grammar can make it
//! valid) and the default model. Outputs must match their grammar and end by themselves;
//! async scheduling, n > 1, preemption and the prefill → decode relay change nothing; a bad
//! grammar is refused; compiling never holds up the engine.

mod common;

use std::time::{Duration, Instant};

use baton_core::api::{EngineClient, EngineError, EngineOutput, EngineRequest, FinishReason};
use baton_core::params::SamplingParams;
use baton_core::structured::GrammarSpec;
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{EngineConfig, EngineHandle};
use baton_formats::testing::TinySpec;
use baton_formats::{LoadedModel, Tokenizer};
use common::relay::{collect, relay, rt, tokens};
use common::*;
use serde_json::Value;

/// A schema whose every valid document is short, so a random model still ends it.
fn person_schema() -> GrammarSpec {
    GrammarSpec::JsonSchema(
        serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "pet": {"enum": ["cat", "dog", "none"]}
            },
            "required": ["name", "age", "pet"],
            "additionalProperties": false
        })
        .to_string(),
    )
}

/// Checks a document against [`person_schema`] field by field.
fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let obj = v.as_object().unwrap_or_else(|| panic!("{text:?} is not an object"));
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "name", "pet"], "{text:?}");
    assert!(obj["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text:?}");
    assert!(obj["age"].as_u64().is_some_and(|a| a <= 120), "{text:?}");
    assert!(["cat", "dog", "none"].contains(&obj["pet"].as_str().unwrap_or("")), "{text:?}");
}

/// Greedy without a seed, sampled at temperature 1 with one.
fn constrained(spec: GrammarSpec, seed: Option<u64>) -> SamplingParams {
    let base = match seed {
        Some(_) => SamplingParams { temperature: 1.0, ..SamplingParams::default() },
        None => SamplingParams::greedy(),
    };
    SamplingParams { structured: Some(spec), seed, max_tokens: Some(200), ..base }
}

fn tokenizer(m: &LoadedModel) -> &Tokenizer {
    m.tokenizer.as_ref().expect("tokenizer")
}

/// Runs one request; its text and how it ended.
fn generate(
    e: &EngineHandle,
    tok: &Tokenizer,
    prompt: &[u32],
    params: SamplingParams,
) -> (Vec<u32>, String, FinishReason) {
    let (ids, _, finish) = drain(e.submit(EngineRequest::new(prompt.to_vec(), params)).expect("submit"));
    let eos = e.info().eos_token_ids;
    let body: Vec<u32> = ids.iter().copied().filter(|t| !eos.contains(t)).collect();
    (ids, tok.decode(&body, false).expect("decode"), finish)
}

#[test]
fn json_schema_regex_and_choice_outputs_match_their_grammar() {
    let m = tiny(&TinySpec::llama());
    let (tok, vocab) = (tokenizer(&m.model), m.model.config.vocab_size);
    let e = engine(&m.model, EngineConfig::default());
    for (i, seed) in [None, Some(7), Some(8)].into_iter().enumerate() {
        let (_, text, finish) = generate(&e, tok, &prompt(10 + i as u64, 9, vocab), constrained(person_schema(), seed));
        assert_eq!(finish, FinishReason::Stop, "{text:?}");
        assert_person(&text);

        let (_, text, finish) = generate(
            &e,
            tok,
            &prompt(20 + i as u64, 5, vocab),
            constrained(GrammarSpec::Regex("[a-c]{2,4}-[0-9]{2}".into()), seed),
        );
        assert_eq!(finish, FinishReason::Stop, "{text:?}");
        let (head, tail) = text.split_once('-').unwrap_or_else(|| panic!("{text:?} has no '-'"));
        assert!((2..=4).contains(&head.len()) && head.chars().all(|c| ('a'..='c').contains(&c)), "{text:?}");
        assert!(tail.len() == 2 && tail.chars().all(|c| c.is_ascii_digit()), "{text:?}");

        let choices = vec!["north".to_string(), "south".into(), "east \"by\" west".into()];
        let (_, text, finish) = generate(
            &e,
            tok,
            &prompt(30 + i as u64, 7, vocab),
            constrained(GrammarSpec::Choice(choices.clone()), seed),
        );
        assert_eq!(finish, FinishReason::Stop, "{text:?}");
        assert!(choices.contains(&text), "{text:?}");

        let (_, text, _) =
            generate(&e, tok, &prompt(40 + i as u64, 7, vocab), constrained(GrammarSpec::JsonObject, seed));
        // Any object: it may be cut by max_tokens, but what there is starts one.
        assert!(text.starts_with('{'), "{text:?}");
    }
    assert!(e.step_timing().grammar_masks > 0);
    assert_all_blocks_free(&e);
    e.shutdown();
}

#[test]
fn n4_async_scheduling_and_preemption_keep_outputs_valid_and_identical() {
    let m = tiny(&TinySpec::llama());
    let (tok, vocab) = (tokenizer(&m.model), m.model.config.vocab_size);
    let run_all = |cfg: EngineConfig| -> (Vec<Vec<u32>>, EngineHandle) {
        let e = engine(&m.model, cfg);
        // n = 4 is four engine requests with their own seeds (the frontend's fan-out),
        // submitted together so they share steps; plus an unconstrained neighbour.
        let mut streams: Vec<_> = (0..4u64)
            .map(|i| {
                let params = SamplingParams { max_tokens: Some(80), ..constrained(person_schema(), Some(100 + i)) };
                let r = EngineRequest::new(prompt(50, 11, vocab), params);
                e.submit(r).expect("submit")
            })
            .collect();
        streams.push(e.submit(EngineRequest::new(prompt(51, 20, vocab), greedy(30))).expect("submit"));
        let outs: Vec<Vec<u32>> = streams.into_iter().map(|s| drain(s).0).collect();
        (outs, e)
    };
    let (sync_outs, sync_e) = run_all(EngineConfig::default());
    let (async_outs, async_e) = run_all(EngineConfig { async_scheduling: true, ..EngineConfig::default() });
    assert_eq!(async_outs, sync_outs, "async scheduling changed a seeded constrained request");
    assert!(async_e.step_timing().planned_ahead > 0, "no step was planned ahead: {:?}", async_e.step_timing());
    // Eight blocks of 16 tokens for five requests of 11-20 + 20-50 tokens: preemption.
    let tiny_pool = EngineConfig { num_kv_blocks: Some(8), max_model_len: Some(96), ..EngineConfig::default() };
    let (small_outs, small_e) = run_all(tiny_pool.clone());
    assert!(small_e.stats().num_preemptions > 0, "the small pool did not preempt");
    let eos = sync_e.info().eos_token_ids;
    for outs in [&sync_outs, &small_outs] {
        for ids in &outs[..4] {
            let body: Vec<u32> = ids.iter().copied().filter(|t| !eos.contains(t)).collect();
            assert_person(&tok.decode(&body, false).expect("decode"));
        }
    }
    let distinct: std::collections::HashSet<_> = sync_outs[..4].iter().collect();
    assert!(distinct.len() > 1, "four seeds gave one output");
    assert_eq!(small_outs, sync_outs, "preemption changed the output");
    let (async_small, e) = run_all(EngineConfig { async_scheduling: true, ..tiny_pool });
    assert_eq!(async_small, sync_outs, "async scheduling with preemption changed the output");
    for e in [sync_e, async_e, small_e, e] {
        assert_all_blocks_free(&e);
        e.shutdown();
    }
}

#[test]
fn a_grammar_that_does_not_compile_is_refused_before_the_engine_sees_it() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let e = engine(&m.model, EngineConfig::default());
    for (spec, kind) in [
        (GrammarSpec::JsonSchema(r#"{"type": "nonsense"}"#.into()), "json_schema"),
        (GrammarSpec::Regex("(unclosed".into()), "regex"),
        (GrammarSpec::Lark("start: missing".into()), "grammar"),
    ] {
        let mut s = e.submit(EngineRequest::new(prompt(1, 4, vocab), constrained(spec, None))).expect("queued");
        match s.blocking_next() {
            Some(Err(err @ EngineError::InvalidGrammar { .. })) => {
                assert!(err.is_invalid_request());
                let EngineError::InvalidGrammar { kind: k, message } = err else { unreachable!() };
                assert_eq!(k, kind);
                assert!(!message.is_empty());
            }
            other => panic!("expected InvalidGrammar, got {other:?}"),
        }
        assert!(s.blocking_next().is_none(), "the refusal is the only item");
    }
    // Nothing was admitted, nothing counts as waiting.
    assert_eq!(e.step_timing().steps, 0);
    assert_all_blocks_free(&e);
    e.shutdown();
}

/// A schema with many patterned properties: slow to compile (~0.4 s for 3,000 on a
/// 2-core machine; `examples/mask_cost.rs` in baton-grammar prints it).
fn slow_schema(n: usize) -> GrammarSpec {
    let props: serde_json::Map<String, Value> = (0..n)
        .map(|i| {
            (format!("field_{i}"), serde_json::json!({"type": "string", "pattern": format!("^x{i}[a-f]{{4,12}}$")}))
        })
        .collect();
    GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "properties": props}).to_string())
}

#[test]
fn compiling_a_slow_grammar_does_not_delay_other_requests_tokens() {
    let m = tiny(&TinySpec::llama());
    let (tok, vocab) = (tokenizer(&m.model), m.model.config.vocab_size);
    let e = engine(&m.model, EngineConfig::default());
    // Warm the compiler (its vocabulary trie) so the timed compile is the grammar's alone.
    generate(&e, tok, &prompt(2, 3, vocab), constrained(GrammarSpec::Choice(vec!["x".into()]), None));
    let spec = slow_schema(3000);
    let compiler = baton_grammar::GrammarCompiler::new(tok, &e.info().eos_token_ids, vocab).expect("compiler");
    let t0 = Instant::now();
    compiler.compile(&spec).expect("the slow schema compiles");
    let compile_time = t0.elapsed();

    let mut plain = e.submit(EngineRequest::new(prompt(3, 8, vocab), greedy(400))).expect("submit");
    plain.blocking_next().expect("first token").expect("ok");
    let slow = e.submit(EngineRequest::new(prompt(4, 8, vocab), constrained(spec, None))).expect("submit");
    let mut last = Instant::now();
    let mut max_gap = Duration::ZERO;
    let mut n = 0;
    while let Some(o) = plain.blocking_next() {
        let o = o.expect("ok");
        max_gap = max_gap.max(last.elapsed());
        last = Instant::now();
        n += 1;
        if o.finish_reason.is_some() {
            break;
        }
    }
    drop(slow);
    assert!(n > 100);
    assert!(
        max_gap < compile_time / 2,
        "a token of the unconstrained request waited {max_gap:?}; compiling the schema takes {compile_time:?}"
    );
    e.shutdown();
}

#[test]
fn a_relayed_constrained_request_matches_one_engine() {
    let m = tiny(&TinySpec::llama());
    let (tok, vocab) = (tokenizer(&m.model), m.model.config.vocab_size);
    let unified = engine(&m.model, EngineConfig::default());
    let (p, d) = (engine(&m.model, EngineConfig::default()), engine(&m.model, EngineConfig::default()));
    let eos = unified.info().eos_token_ids;
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        for (i, spec) in [person_schema(), GrammarSpec::Choice(vec!["yes".into(), "no".into()])].into_iter().enumerate()
        {
            for seed in [None, Some(5)] {
                let pr = prompt(60 + i as u64, 24, vocab);
                let params = constrained(spec.clone(), seed);
                let alone: Vec<EngineOutput> =
                    collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
                let (p_out, d_out) = relay(&p, &d, &listener, &pr, params, None).await;
                assert_eq!(p_out[0].new_token_ids, alone[0].new_token_ids, "the prefill side's first token");
                assert_eq!(tokens(&d_out), tokens(&alone), "{spec:?} seed {seed:?}");
                assert_eq!(d_out.last().and_then(|o| o.finish_reason), Some(FinishReason::Stop));
                let body: Vec<u32> = tokens(&d_out).into_iter().filter(|t| !eos.contains(t)).collect();
                let text = tok.decode(&body, false).expect("decode");
                if i == 0 {
                    assert_person(&text);
                } else {
                    assert!(text == "yes" || text == "no", "{text:?}");
                }
            }
        }
    });
    for e in [unified, p, d] {
        assert_all_blocks_free(&e);
        e.shutdown();
    }
}

#[test]
fn the_default_model_answers_in_the_schema() {
    use baton_formats::testing::default_model_path;
    use baton_formats::{ChatMessage, LoadFormat, load_model};
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    let model = load_model(&path, LoadFormat::Auto).expect("load the default model");
    let tok = tokenizer(&model);
    let template = model.chat_template.as_ref().expect("chat template");
    let e =
        engine(&model, EngineConfig { max_model_len: Some(512), async_scheduling: true, ..EngineConfig::default() });
    let ask = "Describe a person called Ana, 34, who has a cat, as JSON with name, age and pet.";
    let text = template.render(&[ChatMessage { role: "user".into(), content: ask.into() }], true).expect("render");
    let ids = tok.encode(&text, false).expect("encode");
    let params = SamplingParams { max_tokens: Some(60), ..constrained(person_schema(), None) };
    let (_, answer, finish) = generate(&e, tok, &ids, params);
    assert_eq!(finish, FinishReason::Stop, "{answer:?}");
    assert_person(&answer);
    let t = e.step_timing();
    assert!(t.grammar_masks > 5 && t.grammar_time > Duration::ZERO, "{t:?}");
    e.shutdown();
}
