//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, dequantized at load)
//! answers a chat prompt coherently on the CPU engine. The file comes from
//! `scripts/fetch-default-model.sh` (the test command runs it first).

mod common;

use baton_core::api::{EngineClient, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::EngineConfig;
use baton_formats::testing::default_model_path;
use baton_formats::{ChatMessage, LoadFormat, load_model};
use common::*;

#[test]
fn default_model_answers_a_chat_prompt() {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    let model = load_model(&path, LoadFormat::Auto).expect("load default model");
    let tok = model.tokenizer.as_ref().expect("GGUF tokenizer");
    let template = model.chat_template.as_ref().expect("GGUF chat template");
    let engine = engine(&model, EngineConfig { max_model_len: Some(2048), ..EngineConfig::default() });
    let ask = |q: &str| -> String {
        let text =
            template.render(&[ChatMessage { role: "user".into(), content: q.into() }], true).expect("render template");
        let ids = tok.encode(&text, false).expect("encode");
        let params = SamplingParams { max_tokens: Some(24), ..SamplingParams::greedy() };
        let s = engine.submit(EngineRequest::new(ids, params)).expect("submit");
        let (out, _, _) = drain(s);
        tok.decode(&out, true).expect("decode")
    };
    let paris = ask("What is the capital of France?");
    assert!(paris.contains("Paris"), "answer: {paris:?}");
    let math = ask("What is 2 plus 2? Answer with a number.");
    assert!(math.contains('4'), "answer: {math:?}");
    assert_all_blocks_free(&engine);
}
