//! A quantized GGUF model and its `export_hf` folder run identically on the CPU backend:
//! bit-identical logits for a prefill and the same greedy tokens through the engine. The
//! bf16 export matches the GGUF run under bf16 weight emulation (which rounds weights to
//! bf16 exactly as the export does), so the bf16 flag hands a reference the CUDA backend's
//! weights.

mod common;

use baton_engine::EngineConfig;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::testing::{TinySpec, write_gguf};
use baton_formats::{ExportDType, ExportOptions, GgufType, LoadFormat, LoadedModel, export_hf, load_model};
use common::*;

/// Logits of the last position of `ids` after one prefill.
fn last_logits(model: &LoadedModel, backend: CpuBackend, ids: &[u32]) -> Vec<f32> {
    let mut m = ModelRunner::load(&model.config, model.weights.as_ref(), backend).expect("load model");
    let block_size = 16;
    let blocks = ids.len().div_ceil(block_size);
    m.alloc_kv_cache(blocks, block_size).expect("kv cache");
    let batch = BatchLayout {
        tokens: ids.to_vec(),
        positions: (0..ids.len()).collect(),
        seqs: vec![SeqLayout {
            row_start: 0,
            n_tokens: ids.len(),
            start_pos: 0,
            block_table: (0..blocks as u32).collect(),
        }],
        logit_rows: vec![ids.len() - 1],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    m.forward(&batch).expect("forward")
}

#[test]
fn gguf_and_its_export_give_identical_logits_and_greedy_tokens() {
    for (spec, ty) in
        [(TinySpec::llama(), GgufType::Q4_1), (TinySpec::tied(), GgufType::Q8_0), (TinySpec::qwen2(), GgufType::Q4_1)]
    {
        let what = format!("{:?} {ty:?}", spec.architecture);
        let tmp = tempfile::tempdir().expect("tmp");
        let gguf = load_model(&write_gguf(&tmp.path().join("m.gguf"), &spec, ty).expect("gguf"), LoadFormat::Auto)
            .expect("load gguf");
        let out = tmp.path().join("hf");
        export_hf(&gguf, &out, &ExportOptions::default()).expect("export");
        let hf = load_model(&out, LoadFormat::Auto).expect("load export");

        for (seed, len) in [(5u64, 1usize), (6, 23), (7, 70)] {
            let ids = prompt(seed, len, spec.vocab_size);
            let a = last_logits(&gguf, CpuBackend::new(), &ids);
            let b = last_logits(&hf, CpuBackend::new(), &ids);
            assert_eq!(a.len(), spec.vocab_size);
            assert!(a.iter().any(|&x| x != 0.0), "{what}: degenerate logits");
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{what} len {len}: logits of the export differ from the GGUF's");
        }

        let (eg, eh) = (engine(&gguf, EngineConfig::default()), engine(&hf, EngineConfig::default()));
        for (seed, len) in [(11u64, 9usize), (12, 40)] {
            let ids = prompt(seed, len, spec.vocab_size);
            let (tg, th) = (run(&eg, &ids, greedy(24)), run(&eh, &ids, greedy(24)));
            assert_eq!(tg.len(), 24, "{what}");
            assert_eq!(tg, th, "{what}: greedy tokens of the export differ from the GGUF's");
        }
        assert_all_blocks_free(&eg);
        assert_all_blocks_free(&eh);
        eg.shutdown();
        eh.shutdown();
    }
}

#[test]
fn bf16_export_matches_the_gguf_under_bf16_weight_emulation() {
    let spec = TinySpec::llama();
    let tmp = tempfile::tempdir().expect("tmp");
    let gguf =
        load_model(&write_gguf(&tmp.path().join("m.gguf"), &spec, GgufType::Q4_1).expect("gguf"), LoadFormat::Auto)
            .expect("load gguf");
    let out = tmp.path().join("hf-bf16");
    export_hf(&gguf, &out, &ExportOptions { dtype: ExportDType::BF16, force: false }).expect("export");
    let hf = load_model(&out, LoadFormat::Auto).expect("load export");
    let ids = prompt(21, 33, spec.vocab_size);
    let a = last_logits(&gguf, CpuBackend::emulating_bf16(), &ids);
    let b = last_logits(&hf, CpuBackend::emulating_bf16(), &ids);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "bf16 export differs under emulation");
    // ...while the exact f32 run of the bf16 export is not the f32 run of the GGUF (the
    // rounding is real, so the identity above is not vacuous).
    let c = last_logits(&gguf, CpuBackend::new(), &ids);
    let d = last_logits(&hf, CpuBackend::new(), &ids);
    assert!(c.iter().zip(&d).any(|(x, y)| x != y), "bf16 rounding changed nothing");
}
