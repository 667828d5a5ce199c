//! FP8 weights (`--quantization fp8`, and FP8 checkpoints) on the CPU reference backend.
//!
//! Accuracy is reported as figures, not asserted against tuned thresholds: each FP8 model
//! against the same weights unquantized, both on the bf16-emulating backend, teacher-forced
//! over 64 greedy tokens of the unquantized run: mean and max |Δlogit| and greedy agreement.
//! Only loose sanity is asserted (finite logits, FP8 really used, agreement ≥ 50 %). Also:
//! the backend's FP8 linear is exactly the kernels' reference, each Hub format's fixture
//! (scripts/golden/make_fp8.py) loads and runs, an FP8 Qwen3-MoE checkpoint's experts load
//! dequantized to bf16 bit for bit (scripts/golden/make_fp8_moe.py), and `--quantization fp8`
//! serves through the engine, random (`--load-format dummy`) weights included.

mod common;

use std::path::Path;

use baton_engine::EngineConfig;
use baton_engine::backend::Backend;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::weight_quantization::WeightQuantization;
use baton_formats::testing::{default_model_path, load_golden};
use baton_formats::{LoadFormat, LoadedModel, ModelConfig, load_model};
use baton_kernels::cpu::{ActivationScale, Fp8Matrix, linear_fp8};
use common::teacher_forced::{self, Figures, Seq};
use common::*;

/// `(reference config and weights)` vs `(fp8 config and weights)`, teacher-forced on the
/// reference's greedy tokens.
fn compare(reference: (&ModelConfig, &LoadedModel), fp8: (&ModelConfig, &LoadedModel), prompt: &[u32]) -> Figures {
    let steps = 64;
    let len = prompt.len() + steps;
    let mut r = Seq::with_config(reference.0, reference.1.weights.as_ref(), KvCacheDtype::Auto, len);
    let mut q = Seq::with_config(fp8.0, fp8.1.weights.as_ref(), KvCacheDtype::Auto, len);
    teacher_forced::compare(prompt, steps, |t| r.feed(t), |t| q.feed(t))
}

fn report(name: &str, f: &Figures) {
    f.report("fp8-weights", name);
    assert!(f.max_abs > 0.0, "{name}: FP8 weights gave bit-identical logits (not used?)");
}

fn quantized_at_load(cfg: &ModelConfig) -> ModelConfig {
    let mut q = cfg.clone();
    WeightQuantization::Fp8.apply(&mut q);
    q
}

#[test]
fn the_cpu_backend_fp8_linear_is_the_kernel_reference() {
    let (m, k, n) = (5, 96, 40);
    let values: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1).collect();
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 3.0).collect();
    let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
    for (w, act) in [
        (Fp8Matrix::quantize_per_channel(&values, n, k).expect("w"), ActivationScale::PerToken),
        (
            Fp8Matrix::new(
                n,
                k,
                Fp8Matrix::quantize_per_channel(&values, n, k).expect("w").codes().to_vec(),
                (0..2 * 2).map(|i| 0.001 * (i + 1) as f32).collect(),
                32,
                64,
            )
            .expect("block"),
            ActivationScale::None,
        ),
    ] {
        let mut want = vec![f32::NAN; m * n];
        linear_fp8(&x, &w, Some(&bias), m, act, &mut want).expect("reference");
        let mut b = CpuBackend::new();
        let mat = b.upload_mat_fp8(w, act).expect("upload");
        let (xb, bb) = (b.upload_vec(x.clone()).expect("x"), b.upload_vec(bias.clone()).expect("bias"));
        let mut out = vec![f32::NAN; m * n];
        b.linear(&xb, m, &mat, Some(&bb), &mut out).expect("linear");
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn fp8_weights_quantized_at_load_vs_bf16_on_the_golden_models() {
    for name in ["llama", "qwen2", "tied", "qwen3", "gemma2"] {
        let (dir, golden) = load_golden(name).expect("golden fixture");
        let model = load_model(&dir, LoadFormat::Auto).expect("load fixture");
        let fp8 = quantized_at_load(&model.config);
        report(name, &compare((&model.config, &model), (&fp8, &model), &golden.prompts[0].ids));
    }
}

#[test]
fn each_hub_fp8_format_loads_and_runs_close_to_its_source() {
    let (dir, golden) = load_golden("llama").expect("golden fixture");
    let source = load_model(&dir, LoadFormat::Auto).expect("load source");
    for format in ["block", "tensor", "ct"] {
        let model = load_model(&fp8_fixture(format), LoadFormat::Auto).expect("load fp8 fixture");
        assert!(model.config.quantization.is_some(), "{format}");
        report(
            &format!("llama-{format}"),
            &compare((&source.config, &source), (&model.config, &model), &golden.prompts[0].ids),
        );
    }
}

fn fp8_fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("formats/tests/fixtures/fp8").join(name)
}

/// An FP8 Qwen3-MoE checkpoint (every expert F8_E4M3 with 16 × 24 block scales,
/// `scripts/golden/make_fp8_moe.py`) loads; Baton dequantizes FP8 experts at load to bf16, so it
/// computes exactly what the fixture's reference checkpoint computes (each expert's
/// `code × scale` rounded to bf16 by numpy / ml_dtypes, stored as BF16): logits bit for bit over
/// a prompt and 16 greedy steps, and not the source model's (the experts really are the
/// quantized ones).
#[test]
fn fp8_moe_experts_load_dequantized_to_bf16_bit_for_bit() {
    let dir = fp8_fixture("qwen3_moe_experts");
    let fp8 = load_model(&dir, LoadFormat::Auto).expect("load the FP8 MoE fixture");
    assert!(fp8.config.quantization.is_some(), "the fixture declares FP8");
    let reference = load_model(&dir.join("reference"), LoadFormat::Auto).expect("load the reference");
    assert!(reference.config.quantization.is_none());
    let (source_dir, golden) = load_golden("qwen3_moe").expect("golden fixture");
    let source = load_model(&source_dir, LoadFormat::Auto).expect("load source");
    let prompt = &golden.prompts[0].ids;
    let len = prompt.len() + 16;
    let mut seqs =
        [&reference, &fp8, &source].map(|m| teacher_forced::Seq::new(m, m.weights.as_ref(), KvCacheDtype::Auto, len));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut feed = prompt.clone();
    let mut differs_from_source = false;
    for step in 0..16 {
        let [r, q, s] = seqs.each_mut().map(|seq| seq.feed(&feed));
        assert!(r.iter().all(|v| v.is_finite()), "step {step}: finite logits");
        assert_eq!(bits(&q), bits(&r), "step {step}: the FP8 experts' logits differ from the reference's");
        differs_from_source |= bits(&q) != bits(&s);
        feed = vec![teacher_forced::argmax(&r)];
    }
    assert!(differs_from_source, "the FP8 experts gave the unquantized source's logits (not read?)");
}

/// A bad scale of an FP8 expert (NaN) is refused at load, naming its tensor.
#[test]
fn fp8_moe_expert_with_a_nan_scale_is_refused_naming_it() {
    let src = fp8_fixture("qwen3_moe_experts");
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
        }
    }
    let mut bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let name = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv";
    // The safetensors layout: an 8-byte little-endian header length, the JSON header, the data.
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let start = header[name]["data_offsets"][0].as_u64().expect("offsets") as usize + 8 + n;
    bytes[start + 4..start + 8].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(dir.path().join("model.safetensors"), bytes).expect("write");
    let err = load_model(dir.path(), LoadFormat::Auto).expect_err("a NaN scale is refused").to_string();
    assert!(err.contains(name) && err.contains("NaN"), "{err}");
}

#[test]
fn fp8_weights_vs_bf16_on_the_default_model() {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    let model = load_model(&path, LoadFormat::Auto).expect("load default model");
    let tok = model.tokenizer.as_ref().expect("tokenizer");
    let prompt = tok.encode("The capital of France is Paris. The capital of Italy is", false).expect("encode");
    let fp8 = quantized_at_load(&model.config);
    report("SmolLM2-135M", &compare((&model.config, &model), (&fp8, &model), &prompt));
}

#[test]
fn quantization_fp8_serves_through_the_engine_with_stored_and_dummy_weights() {
    let m = golden_model("llama");
    let cfg = EngineConfig { quantization: WeightQuantization::Fp8, ..EngineConfig::default() };
    let prompt = prompt(7, 12, m.config.vocab_size);
    let fp8 = run(&engine(&m, cfg.clone()), &prompt, greedy(16));
    let bf16 = run(&engine(&m, EngineConfig::default()), &prompt, greedy(16));
    assert_eq!((fp8.len(), bf16.len()), (16, 16));
    println!("fp8-weights engine llama: fp8 {fp8:?}\n                           f32 {bf16:?}");
    // Random weights, quantized at load (`--load-format dummy --quantization fp8`).
    let dummy_dir = tempfile::tempdir().expect("tempdir");
    let config = dummy_dir.path().join("config.json");
    std::fs::write(&config, m.config.to_hf_json().to_string()).expect("write config");
    let dummy = load_model(&config, LoadFormat::Dummy).expect("dummy");
    let toks = run(&engine(&dummy, cfg), &prompt, greedy(8));
    assert_eq!(toks.len(), 8);
    assert!(toks.iter().all(|t| (*t as usize) < m.config.vocab_size));
}
