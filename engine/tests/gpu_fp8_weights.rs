//! FP8 weights on the CUDA backend (`--quantization fp8`): the W8A16 kernels of
//! `kernels/cuda/fp8_linear.cu` serving a golden tiny model (decode through the skinny FP8
//! kernel, the prompt through the dequantized bf16 GEMM) and random weights of a real shape
//! (`--load-format dummy --quantization fp8`, Llama-3.2-1B). The CPU engine (W8A8 per-token
//! reference) and the GPU (W8A16) are compared as figures (greedy agreement printed), with only
//! sanity asserted: every request completes with in-vocabulary tokens, and FP8 changes the GPU's
//! output relative to its bf16 weights somewhere (the FP8 path is really taken).
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use std::path::Path;

use baton_engine::weight_quantization::WeightQuantization;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, start_engine};
use baton_formats::{LoadFormat, LoadedModel, load_model};
use common::{golden_model, greedy, prompt, run};

fn start(model: &LoadedModel, device: DeviceSpec, quantization: WeightQuantization) -> EngineHandle {
    let cfg = EngineConfig {
        num_threads: Some(2),
        max_model_len: Some(512),
        num_kv_blocks: Some(64),
        quantization,
        ..EngineConfig::default()
    };
    start_engine(model, device, cfg).unwrap_or_else(|e| panic!("start on {device} with {quantization}: {e}"))
}

#[test]
fn gpu_fp8_weights_serve_a_golden_model_close_to_the_cpu_reference() {
    let model = golden_model("llama");
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..4).map(|s| prompt(s, 20 + 7 * s as usize, vocab)).collect();
    let gpu_fp8 = start(&model, DeviceSpec::Cuda(0), WeightQuantization::Fp8);
    let gpu_bf16 = start(&model, DeviceSpec::Cuda(0), WeightQuantization::None);
    let cpu_fp8 = start(&model, DeviceSpec::Cpu, WeightQuantization::Fp8);
    let (mut agree, mut total, mut differs_from_bf16) = (0usize, 0usize, false);
    for p in &prompts {
        let g = run(&gpu_fp8, p, greedy(32));
        let b = run(&gpu_bf16, p, greedy(32));
        let c = run(&cpu_fp8, p, greedy(32));
        assert_eq!((g.len(), c.len()), (32, 32));
        assert!(g.iter().all(|t| (*t as usize) < vocab));
        agree += g.iter().zip(&c).take_while(|(a, b)| a == b).count();
        total += 32;
        differs_from_bf16 |= g != b;
    }
    println!("gpu-fp8-weights llama: GPU W8A16 vs CPU W8A8 reference, common greedy prefix {agree}/{total} tokens");
    assert!(differs_from_bf16, "FP8 weights gave the bf16 weights' tokens on every prompt (FP8 path not taken?)");
    // Stop and join the engine threads before the process exits: left running, a CUDA engine
    // thread met the driver's teardown at exit (SIGSEGV after the test passed, 3 of 6 runs in
    // session 16).
    for engine in [gpu_fp8, gpu_bf16, cpu_fp8] {
        engine.shutdown();
    }
}

#[test]
fn gpu_fp8_dummy_weights_of_a_real_shape_serve() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/models/llama-3.2-1b.json");
    let model = load_model(&config, LoadFormat::Dummy).expect("dummy model");
    let engine = start(&model, DeviceSpec::Cuda(0), WeightQuantization::Fp8);
    let vocab = model.config.vocab_size;
    // 1 row (skinny kernel) and a 300-token prompt (dequantized GEMM).
    for p in [prompt(1, 1, vocab), prompt(2, 300, vocab)] {
        let toks = run(&engine, &p, greedy(8));
        assert_eq!(toks.len(), 8);
        assert!(toks.iter().all(|t| (*t as usize) < vocab));
    }
    engine.shutdown();
}
