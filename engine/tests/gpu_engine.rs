//! Whole-model checks of the CUDA backend through `start_engine`: the tiny test models
//! (Llama GQA untied, Qwen2 with biases, tied with Llama 3.1 RoPE scaling, Qwen3 with its per-head
//! q/k norm fused into the RoPE + KV write kernel, Qwen3-MoE and Mixtral through the MoE
//! kernels), written and loaded
//! through the real writer and loader, give the same greedy tokens on `cuda:0` as on the CPU;
//! so do the Phi-3 and Phi-4-mini checkpoints transformers wrote (LongRoPE, partial rotary), and
//! the Gemma 2 and Gemma 3 (text) ones (sliding windows shorter than the longer prompts,
//! soft-capping, `1 + w` norms, GELU-tanh, a RoPE per layer kind).
//!
//! The CUDA backend stores weights and activations in bf16, the CPU in f32, so a greedy
//! argmax can legitimately flip where the CPU's top two tokens are within rounding of each
//! other. The rule: tokens must be identical, except that at the first divergence (after
//! which the continuations are different sequences) the CPU must rate the GPU's token within
//! `NEAR_TIE` nats of its own choice. Every divergence is printed.
//!
//! Named `gpu_*`: excluded from CI by name, and they FAIL when no GPU is present.

mod common;

use baton_core::api::{EngineClient, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, resolve_device, start_engine};
use baton_formats::Architecture;
use baton_formats::testing::TinySpec;
use common::{drain, golden_model, peaked_gemma_fixture, prompt, tiny};

/// Largest CPU logprob gap between the CPU's and the GPU's token that counts as a near tie,
/// and largest logprob difference allowed on tokens both chose (nats).
const NEAR_TIE: f32 = 0.03;
const MAX_TOKENS: usize = 24;

fn start(model: &baton_formats::LoadedModel, device: DeviceSpec) -> EngineHandle {
    start_with(model, device, false)
}

/// `bf16_reference`: on the CPU, emulate the CUDA backend's bf16 storage.
fn start_with(model: &baton_formats::LoadedModel, device: DeviceSpec, bf16_reference: bool) -> EngineHandle {
    let cfg = EngineConfig {
        num_threads: Some(2),
        num_kv_blocks: Some(256),
        // 512, or less where the model's own context is shorter (the Phi fixtures' 144).
        max_model_len: Some(model.config.max_position_embeddings.min(512)),
        cpu_emulates_bf16: bf16_reference,
        ..EngineConfig::default()
    };
    start_engine(model, device, cfg).unwrap_or_else(|e| panic!("start on {device}: {e}"))
}

fn params() -> SamplingParams {
    SamplingParams { max_tokens: Some(MAX_TOKENS), ignore_eos: true, logprobs: Some(5), ..SamplingParams::greedy() }
}

/// (tokens, per-token (logprob of the chosen token, top alternatives)).
type Run = (Vec<u32>, Vec<(f32, Vec<(u32, f32)>)>);

/// Submits every prompt at once (so the engine batches prefill chunks with decode rows) and
/// collects each result.
fn run_all(engine: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Run> {
    let streams: Vec<_> =
        prompts.iter().map(|p| engine.submit(EngineRequest::new(p.clone(), params())).expect("submit")).collect();
    streams
        .into_iter()
        .map(|s| {
            let (toks, outs, _) = drain(s);
            let lps = outs.iter().flat_map(|o| o.logprobs.iter().map(|l| (l.logprob, l.top.clone()))).collect();
            (toks, lps)
        })
        .collect()
}

/// `tie`: [`NEAR_TIE`], or [`SOFT_ATTENTION_TIE`] for models with q/k norm, [`MOE_ROUTING_TIE`]
/// for routed experts (see there).
fn compare(name: &str, cpu: &[Run], gpu: &[Run], tie: f32) -> usize {
    let mut identical = 0;
    let mut worst = 0.0f32;
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        assert_eq!(c.0.len(), MAX_TOKENS, "{name} prompt {i}: cpu length");
        assert_eq!(g.0.len(), MAX_TOKENS, "{name} prompt {i}: gpu length");
        // Up to the first divergence both ran the same sequence: their logprobs must agree.
        let same = c.0.iter().zip(&g.0).take_while(|(a, b)| a == b).count();
        for (t, (lc, lg)) in c.1.iter().zip(&g.1).take(same).enumerate() {
            let d = (lc.0 - lg.0).abs();
            worst = worst.max(d);
            assert!(d < tie, "{name} prompt {i} token {t}: logprob cpu {} gpu {}", lc.0, lg.0);
        }
        match c.0.iter().zip(&g.0).position(|(a, b)| a != b) {
            None => identical += 1,
            Some(t) => {
                let (own, top) = &c.1[t];
                let gpu_tok = g.0[t];
                let alt = top.iter().find(|(id, _)| *id == gpu_tok).map(|x| x.1);
                println!(
                    "{name} prompt {i}: diverges at token {t}: cpu {} ({own:.4}) gpu {gpu_tok} (cpu logprob {alt:?})",
                    c.0[t]
                );
                let alt = alt.unwrap_or_else(|| panic!("{name} prompt {i}: gpu token {gpu_tok} not in cpu top-5"));
                assert!(own - alt < tie, "{name} prompt {i} token {t}: not a near tie ({own} vs {alt})");
            }
        }
    }
    println!(
        "{name}: {identical}/{} prompts identical for {MAX_TOKENS} tokens; largest logprob gap on shared tokens {worst:.4}",
        cpu.len()
    );
    identical
}

/// Models whose attention is soft (see [`SOFT_ATTENTION_TIE`]): q/k norm (Qwen3, Gemma 3)
/// or scores soft-capped (Gemma 2).
fn soft_attention(a: Architecture) -> bool {
    matches!(a, Architecture::Qwen3 | Architecture::Gemma2 | Architecture::Gemma3Text)
}

/// CPU and CUDA greedy runs of `model` (see [`compare`]), then the CUDA run again over its
/// prefix cache; returns the prompts identical end to end in the first comparison.
fn cpu_and_cuda_agree(name: &str, model: &baton_formats::LoadedModel) -> (usize, usize) {
    let vocab = model.config.vocab_size;
    // Lengths off the block size (16), one longer than a block table's first blocks (and
    // than the Gemma fixtures' sliding window, 16).
    let prompts: Vec<Vec<u32>> =
        [1usize, 7, 16, 17, 40, 100].iter().enumerate().map(|(i, &l)| prompt(i as u64 + 11, l, vocab)).collect();
    // MoE models against the bf16 emulation (see MOE_ROUTING_TIE), the others against f32.
    let cpu = run_all(&start_with(model, DeviceSpec::Cpu, model.config.moe.is_some()), &prompts);
    let gpu_engine = start(model, DeviceSpec::Cuda(0));
    assert!(gpu_engine.info().device.starts_with("cuda"), "engine runs on {}", gpu_engine.info().device);
    let gpu = run_all(&gpu_engine, &prompts);
    let tie = tie_for(&model.config, NEAR_TIE);
    let identical = compare(name, &cpu, &gpu, tie);
    // A second round reuses the prefix cache on the GPU (cached prefix + new chunk).
    let again = run_all(&gpu_engine, &prompts);
    compare(&format!("{name} (prefix cached)"), &cpu, &again, tie);
    (identical, prompts.len())
}

#[test]
fn gpu_tiny_models_greedy_match_cpu() {
    let mut identical = 0;
    let mut total = 0;
    for (name, spec) in [
        ("llama", TinySpec::llama()),
        ("qwen2", TinySpec::qwen2()),
        ("tied", TinySpec::tied()),
        ("qwen3", TinySpec::qwen3()),
        ("qwen3_moe", TinySpec::qwen3_moe()),
        ("mixtral", TinySpec::mixtral()),
    ] {
        let (same, n) = cpu_and_cuda_agree(name, &tiny(&spec).model);
        identical += same;
        total += n;
    }
    for name in ["gemma2", "gemma3_text", "mistral_window"] {
        let (same, n) = cpu_and_cuda_agree(name, &golden_model(name));
        identical += same;
        total += n;
    }
    // The tiny random models are nearly flat (top logprob ≈ -4.4 over 384 tokens), so near
    // ties are common (about half the prompts meet one within 24 tokens); every divergence
    // was checked above to be one. A broken kernel diverges at once and far from a tie; a
    // third of the prompts identical end to end is the floor (9/18 seen on an H100).
    println!("{identical}/{total} prompts identical for all {MAX_TOKENS} tokens");
    assert!(identical * 3 >= total, "only {identical}/{total} prompts identical");
}

#[test]
fn gpu_auto_device_picks_cuda() {
    assert_eq!(resolve_device(DeviceSpec::Auto).expect("resolve"), DeviceSpec::Cuda(0));
    assert!(resolve_device(DeviceSpec::Cuda(4096)).is_err(), "a missing ordinal must be refused");
}

/// With well-conditioned tiny models (larger init, so the top logit stands clear of the
/// rest, as in a trained model) the CUDA run must give exactly the greedy tokens of the CPU
/// reference that stores bf16 where the CUDA backend does (`cpu_emulates_bf16`).
///
/// Not against the exact f32 CPU run: on these models rounding only the weights to bf16
/// already changes the CPU's own greedy tokens within 3–28 steps, so no bf16 backend can match
/// it (bench/results/exactness-bf16-emulation-cpu-2026-11-21.md; this test's earlier form
/// compared with it and failed for that reason). Peaked models make near ties rare, so the
/// remaining differences (accumulation order, exp2 vs exp) must not flip a token here, except
/// at a near tie within [`ATTENTION_TIE`].
/// The one kind of divergence the exactness test allows: the tensor-core attention kernels
/// round the softmax weights to bf16 before P·V (as FlashAttention does) at the running max
/// of each key tile, which the CPU emulation cannot reproduce (the rounding depends on the
/// tile order), and that moves logits by up to ~1e-2. A token whose reference top-2 gap is
/// below this (nats) may flip; the first H100 run with those kernels met two such ties in 108
/// tokens of the qwen2 model (gaps 0.0049 and 0.0005).
const ATTENTION_TIE: f32 = 0.01;

/// The same rounding in models whose attention is soft. Qwen3's q/k norm scales every head
/// to RMS ≈ 1, so the tiny models' attention scores are O(1) and the softmax spreads over
/// many keys (the Llama-shaped tiny models' scores are O(10): nearly one-hot), and rounding
/// each of many softmax weights moves the logits more. Measured on the H100 (session 10):
/// with a one-token prompt (attention over one key, so no softmax rounding) the CUDA Qwen3
/// logits equal the bf16 emulation's exactly (`gpu_transformers_bf16`), and on transformers'
/// own bf16 fixtures CUDA is as close to transformers as the f32 reference is; the
/// well-conditioned model's divergences were at reference gaps 0.012, 0.020 and 0.039, and
/// one shared token's logprob moved 0.0303 from the f32 reference.
const SOFT_ATTENTION_TIE: f32 = 0.05;

/// The tie a mixture-of-experts model's comparisons allow (nats). Routing is discontinuous:
/// a token whose router scores its k-th and (k+1)-th experts within rounding of each other
/// may take the other expert on the GPU, which moves that token's logits by the difference
/// of two experts' outputs, not by rounding noise. Measured on the CPU (session 11, 16 seeds
/// of each tiny MoE spec, f32 against the bf16 emulation, which rounds where CUDA does):
/// isolated tokens moved by up to 0.23 nats and divergences met reference gaps up to 0.24
/// (dense models: 0.024 and 0.014). The CUDA run is compared with the bf16 emulation, which
/// makes the same routing decisions except where accumulation order or the attention
/// kernels' softmax rounding crosses a router tie, so such flips are rarer still; a broken
/// MoE kernel moves the logits by whole nats from the first token.
const MOE_ROUTING_TIE: f32 = 0.3;

/// The tie for `config`: `dense` for Llama-shaped attention, [`SOFT_ATTENTION_TIE`] for soft
/// attention ([`soft_attention`]), [`MOE_ROUTING_TIE`] with routed experts.
fn tie_for(config: &baton_formats::ModelConfig, dense: f32) -> f32 {
    if config.moe.is_some() {
        MOE_ROUTING_TIE
    } else if soft_attention(config.architecture) {
        SOFT_ATTENTION_TIE
    } else {
        dense
    }
}

#[test]
fn gpu_well_conditioned_models_match_bf16_reference_exactly() {
    for (name, spec) in [
        ("llama", TinySpec::llama()),
        ("qwen2", TinySpec::qwen2()),
        ("tied", TinySpec::tied()),
        ("qwen3", TinySpec::qwen3()),
        ("qwen3_moe", TinySpec::qwen3_moe()),
        ("mixtral", TinySpec::mixtral()),
    ] {
        let spec = TinySpec { init_std: 0.5, seed: spec.seed + 1000, ..spec };
        matches_bf16_reference(name, &tiny(&spec).model);
    }
    // The Gemma fixtures, peaked by scaling their final norm (see `peaked_gemma_fixture`).
    for name in ["gemma2", "gemma3_text"] {
        matches_bf16_reference(name, &peaked_gemma_fixture(name, 8.0));
    }
}

/// The body of [`gpu_well_conditioned_models_match_bf16_reference_exactly`] for one model.
fn matches_bf16_reference(name: &str, model: &baton_formats::LoadedModel) {
    let tie = tie_for(&model.config, ATTENTION_TIE);
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        [1usize, 7, 16, 17, 40, 100].iter().enumerate().map(|(i, &l)| prompt(i as u64 + 31, l, vocab)).collect();
    let cpu = run_all(&start_with(model, DeviceSpec::Cpu, true), &prompts);
    // The model must actually be peaked, or this test would prove nothing more than the one above.
    let mean_top: f32 =
        cpu.iter().flat_map(|r| r.1.iter().map(|l| l.0)).sum::<f32>() / (prompts.len() * MAX_TOKENS) as f32;
    assert!(mean_top > -1.5, "{name}: the well-conditioned model is not peaked (mean top logprob {mean_top})");
    let gpu = run_all(&start(model, DeviceSpec::Cuda(0)), &prompts);
    let mut failures = Vec::new();
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        if let Some(t) = c.0.iter().zip(&g.0).position(|(a, b)| a != b) {
            // A divergence where the reference's own top two are within ATTENTION_TIE is
            // allowed (and printed): see ATTENTION_TIE.
            let (own, top) = &c.1[t];
            let gpu_tok = g.0[t];
            if let Some((_, alt)) = top.iter().find(|(id, _)| *id == gpu_tok)
                && own - alt < tie
            {
                println!("{name} prompt {i}: near tie at token {t} ({own} vs {alt}), allowed");
                continue;
            }
            // Both ran the same prefix up to t: show both top-5 lists at the divergence.
            let msg = format!(
                "{name} prompt {i}: diverges at token {t}: cpu chose {} top {:?}; gpu chose {} top {:?}",
                c.0[t], c.1[t].1, g.0[t], g.1[t].1
            );
            println!("{msg}");
            failures.push(msg);
        }
    }
    assert!(failures.is_empty(), "greedy tokens differ between CPU and CUDA:\n{}", failures.join("\n"));
    println!("{name}: {} prompts identical; mean top logprob {mean_top:.3}", prompts.len());
}

/// Phi-3 (LongRoPE, fused qkv/gate_up) and Phi-4-mini (also partial rotary, tied): the
/// checkpoints transformers wrote, served at their whole context (so with LongRoPE's long
/// factors and the attention factor), give on CUDA the greedy tokens of the bf16-emulating CPU
/// reference up to near ties. These fixtures are plainly initialised (flat logits, and soft
/// attention as in Qwen3's case), so the tie is [`SOFT_ATTENTION_TIE`]: on the H100 (session 11)
/// a one-token prompt's CUDA logits equal the bf16 emulation's exactly and longer prompts'
/// differ by at most 0.015 (`gpu_transformers_bf16`, where CUDA is as close to transformers
/// bf16 as the f32 reference is), and the first run met a tie of 0.0104 here.
#[test]
fn gpu_phi_checkpoints_match_bf16_reference() {
    for name in ["phi3", "phi4_mini"] {
        let (dir, _) = baton_formats::testing::load_golden(name).expect("golden fixture");
        let model = baton_formats::load_model(&dir, baton_formats::LoadFormat::Auto).expect("load fixture");
        assert!(model.config.longrope.is_some(), "{name}: a LongRoPE checkpoint");
        let vocab = model.config.vocab_size;
        let prompts: Vec<Vec<u32>> =
            [1usize, 7, 16, 17, 40, 100].iter().enumerate().map(|(i, &l)| prompt(i as u64 + 51, l, vocab)).collect();
        let cpu = run_all(&start_with(&model, DeviceSpec::Cpu, true), &prompts);
        let gpu_engine = start(&model, DeviceSpec::Cuda(0));
        let gpu = run_all(&gpu_engine, &prompts);
        let identical = compare(name, &cpu, &gpu, SOFT_ATTENTION_TIE);
        let again = run_all(&gpu_engine, &prompts);
        compare(&format!("{name} (prefix cached)"), &cpu, &again, SOFT_ATTENTION_TIE);
        assert!(identical * 3 >= prompts.len(), "{name}: only {identical}/{} prompts identical", prompts.len());
    }
}

/// gpt-oss (sinks, alternating windows of 16, YaRN, biased experts with the clamped SwiGLU),
/// the checkpoint transformers wrote and its MXFP4 copy (experts dequantized at load), give
/// on CUDA the greedy tokens of the bf16-emulating CPU reference up to MoE routing near ties
/// ([`MOE_ROUTING_TIE`]), also over the prefix cache. The prompts of 17 to 100 tokens run
/// past the window.
#[test]
fn gpu_gpt_oss_checkpoints_match_bf16_reference() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mxfp4 = baton_formats::testing::golden_checkpoint_copy("gpt_oss_mxfp4", tmp.path()).expect("copy");
    let (f32_dir, _) = baton_formats::testing::load_golden("gpt_oss").expect("golden fixture");
    for (name, dir) in [("gpt_oss", f32_dir), ("gpt_oss_mxfp4", mxfp4)] {
        let model = baton_formats::load_model(&dir, baton_formats::LoadFormat::Auto).expect("load fixture");
        let vocab = model.config.vocab_size;
        let prompts: Vec<Vec<u32>> =
            [1usize, 7, 16, 17, 40, 100].iter().enumerate().map(|(i, &l)| prompt(i as u64 + 71, l, vocab)).collect();
        let cpu = run_all(&start_with(&model, DeviceSpec::Cpu, true), &prompts);
        let gpu_engine = start(&model, DeviceSpec::Cuda(0));
        let gpu = run_all(&gpu_engine, &prompts);
        let identical = compare(name, &cpu, &gpu, MOE_ROUTING_TIE);
        let again = run_all(&gpu_engine, &prompts);
        compare(&format!("{name} (prefix cached)"), &cpu, &again, MOE_ROUTING_TIE);
        assert!(identical * 3 >= prompts.len(), "{name}: only {identical}/{} prompts identical", prompts.len());
    }
}

/// An FP8 Qwen3-MoE checkpoint (experts F8_E4M3 with block scales, dequantized at load to bf16;
/// `scripts/golden/make_fp8_moe.py`) gives on CUDA exactly the greedy tokens of its reference
/// checkpoint (the same experts stored as bf16), and the CPU reference's up to MoE routing near
/// ties ([`MOE_ROUTING_TIE`]).
#[test]
fn gpu_fp8_moe_experts_checkpoint_matches_its_bf16_reference() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("formats/tests/fixtures/fp8/qwen3_moe_experts");
    let fp8 = baton_formats::load_model(&dir, baton_formats::LoadFormat::Auto).expect("load the FP8 fixture");
    let reference =
        baton_formats::load_model(&dir.join("reference"), baton_formats::LoadFormat::Auto).expect("load reference");
    let vocab = fp8.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        [1usize, 7, 16, 17, 40, 100].iter().enumerate().map(|(i, &l)| prompt(i as u64 + 91, l, vocab)).collect();
    let engines = [
        start_with(&fp8, DeviceSpec::Cpu, true),
        start(&fp8, DeviceSpec::Cuda(0)),
        start(&reference, DeviceSpec::Cuda(0)),
    ];
    let [cpu, gpu, gpu_reference] = [0, 1, 2].map(|i| run_all(&engines[i], &prompts));
    // Stop the engine threads before asserting or exiting (a CUDA engine thread left running has
    // met the driver's teardown at exit).
    for engine in engines {
        engine.shutdown();
    }
    assert_eq!(gpu, gpu_reference, "the FP8 experts' tokens differ from their bf16 reference's on CUDA");
    let identical = compare("qwen3_moe_fp8_experts", &cpu, &gpu, MOE_ROUTING_TIE);
    assert!(identical * 3 >= prompts.len(), "only {identical}/{} prompts identical to the CPU", prompts.len());
}

/// With no block count given, the CUDA engine sizes the KV pool from free device memory:
/// a larger `gpu_memory_utilization` gives a larger pool, and the engine still serves.
#[test]
fn gpu_kv_cache_sized_from_free_memory() {
    let m = tiny(&TinySpec::llama());
    let mut blocks = Vec::new();
    for util in [0.05f32, 0.1] {
        let cfg = EngineConfig {
            num_threads: Some(2),
            num_kv_blocks: None,
            gpu_memory_utilization: util,
            max_model_len: Some(512),
            ..EngineConfig::default()
        };
        let engine = start_engine(&m.model, DeviceSpec::Cuda(0), cfg).expect("start with sized KV cache");
        let n = engine.info().num_blocks;
        println!("gpu_memory_utilization {util}: {n} blocks");
        let toks = common::run(&engine, &prompt(5, 20, m.model.config.vocab_size), common::greedy(8));
        assert_eq!(toks.len(), 8);
        blocks.push(n);
    }
    assert!(blocks[0] > 0 && blocks[1] > blocks[0], "pool sizes {blocks:?}");
    let bad = EngineConfig { num_kv_blocks: None, gpu_memory_utilization: 1.5, ..EngineConfig::default() };
    assert!(start_engine(&m.model, DeviceSpec::Cuda(0), bad).is_err(), "utilization above 1 accepted");
}
