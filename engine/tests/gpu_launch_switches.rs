//! Switches of the CUDA backend that must change nothing but timing: the same steps with each
//! on and off give bit-identical logits, eager and from CUDA graphs, over prefill chunks,
//! mixed batches and decode steps.
//! - Programmatic dependent launch (every kernel may start while the one before it finishes,
//!   and waits for it inside): a missing wait would show as a race, logits that move from run
//!   to run.
//! - The gated MLP's activation fused into the skinny GEMM (`set_fused_gate`): decode steps of
//!   up to 16 rows take the fused kernel, which must write the bits the product + activation
//!   pair writes.
//! - Over FP8 weights (W8A8 per token), the RMSNorm that quantizes its rows for the next
//!   projection (`set_fused_norm`, prefill-sized steps), and SiLU·mul that quantizes its rows for
//!   the down projection (`BranchBoundary::then`): the same codes as the kernel pairs they
//!   replace, so the same bits.
//! - RoPE and the KV write in the qkv product's epilogue (`set_fused_rope`): the same rotated q
//!   and the same cache bits as the RoPE kernel after the product, so the same logits; over a
//!   bf16 and an FP8 cache, on Llama (the epilogue runs), Qwen2 (a qkv bias: over bf16 weights
//!   the bias kernel and the RoPE kernel run, over FP8 weights the epilogue adds the bias) and
//!   Qwen3 (q/k norm: never offered).
//! - Over FP8 weights, the skinny FP8 GEMM's epilogues (`set_fused_gate`, `set_fused_rope`): the
//!   gated activation, and RoPE + the KV write; the same bits as the product + kernel pairs.
//! - The RMSNorm fused into the skinny GEMMs around it (`set_fused_norm`): the residual add in
//!   o_proj's and down's epilogues, the normalization on qkv's and gate_up's loads. Its
//!   `1 / rms` is summed in another order than the norm kernel's, so an element of the
//!   normalized activation may round the other way: the logits agree within the bf16 check
//!   and the greedy tokens agree except at a near tie, where the comparison stops. On the MoE
//!   models (Qwen3-MoE, Mixtral) the same switch fuses both norms of a MoE layer
//!   (`Backend::moe_branch`: the router normalizes on its loads, down's un-permute adds to the
//!   residual), or either one (`set_moe_norm_fusion`), which their decode steps must take.
//!
//! - The shared-memory carve-outs the launches ask for (`set_carveout_policy`): the per-step
//!   rule pins 50 % on every launch of a decode step of 1-4 rows (on Llama, whose qkv product
//!   carries RoPE; never on Qwen3) and plans attention's splits in that share; the same pins
//!   fixed give the same bits, and pins alone (splits planned as without) change no bit
//!   either.
//!
//! Named `gpu_*`: excluded from CI by name, and they FAIL when no GPU is present.

mod common;

use baton_engine::backend::cuda::{CudaBackend, MoeNormFusion};
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::runner::ModelRunner;
use baton_engine::weight_quantization::WeightQuantization;
use baton_formats::Architecture;
use baton_formats::testing::TinySpec;
use baton_kernels::cuda::{CarveoutPins, CarveoutPolicy, STEP_CARVEOUT_PERCENT};
use common::{prompt, tiny};

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 24;

/// What a test switches: PDL, graphs, the fused gate, the fused norm, the fused RoPE, the
/// carve-out policy; and the cache it runs over (bf16, or FP8 E4M3 with scales 1).
#[derive(Clone, Copy)]
struct Switches {
    pdl: bool,
    graphs: bool,
    fused_gate: bool,
    fused_norm: bool,
    fused_rope: bool,
    carveout: CarveoutPolicy,
    fp8_kv: bool,
}

impl Switches {
    /// Every switch at its default (on) over a bf16 cache, graphs as given.
    fn defaults(graphs: bool) -> Self {
        Self {
            pdl: true,
            graphs,
            fused_gate: true,
            fused_norm: true,
            fused_rope: true,
            carveout: CarveoutPolicy::PerStep,
            fp8_kv: false,
        }
    }
}

fn model(m: &baton_formats::LoadedModel, sw: Switches) -> ModelRunner<CudaBackend> {
    let opts = baton_kernels::cuda::CudaOptions::default();
    let mut backend = CudaBackend::new(&opts).expect("open cuda:0");
    assert!(backend.device().pdl(), "PDL is on by default on this (Hopper) device");
    backend.set_pdl(sw.pdl);
    assert_eq!(backend.device().pdl(), sw.pdl);
    backend.set_graphs(sw.graphs);
    backend.set_fused_gate(sw.fused_gate);
    backend.set_fused_norm(sw.fused_norm);
    backend.set_fused_rope(sw.fused_rope);
    backend.set_carveout_policy(sw.carveout);
    let mut model = ModelRunner::load(&m.config, m.weights.as_ref(), backend).expect("load");
    if sw.fp8_kv {
        model.set_kv_cache_dtype(KvCacheDtype::Fp8E4M3, m.weights.as_ref()).expect("fp8 cache");
    }
    model.alloc_kv_cache(16 * BLOCKS_PER_SEQ, BLOCK).expect("kv cache");
    model
}

fn table(slot: usize) -> Vec<u32> {
    ((slot * BLOCKS_PER_SEQ) as u32..((slot + 1) * BLOCKS_PER_SEQ) as u32).collect()
}

/// Prefills `prompts` in one mixed step, then decodes `steps` greedy tokens for all of them;
/// returns every step's logits.
fn run(model: &mut ModelRunner<CudaBackend>, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab_size;
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut cached = vec![0usize; seqs.len()];
    let mut out = Vec::new();
    for _ in 0..=steps {
        let mut b = BatchLayout::default();
        for (i, s) in seqs.iter().enumerate() {
            let row_start = b.tokens.len();
            b.tokens.extend_from_slice(&s[cached[i]..]);
            b.positions.extend(cached[i]..s.len());
            b.seqs.push(SeqLayout {
                row_start,
                n_tokens: s.len() - cached[i],
                start_pos: cached[i],
                block_table: table(i),
            });
            b.logit_rows.push(b.tokens.len() - 1);
        }
        let logits = model.forward(&b).expect("step");
        for (i, s) in seqs.iter_mut().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let next = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(t, _)| t as u32);
            cached[i] = s.len();
            s.push(next);
        }
        out.push(logits);
    }
    out
}

/// Runs the same steps with `a` and `b` and asserts bit-identical logits.
fn assert_same_steps(what: &str, specs: &[TinySpec], a: impl Fn(bool) -> Switches, b: impl Fn(bool) -> Switches) {
    for spec in specs {
        assert_same_steps_on(what, &tiny(spec).model, &a, &b);
    }
}

/// [`assert_same_steps`] on one loaded model (nine sequences: decode steps of 9 rows); returns
/// the runners of the last (graphs) pair.
fn assert_same_steps_on(
    what: &str,
    m: &baton_formats::LoadedModel,
    a: impl Fn(bool) -> Switches,
    b: impl Fn(bool) -> Switches,
) -> (ModelRunner<CudaBackend>, ModelRunner<CudaBackend>) {
    let vocab = m.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..9).map(|i| prompt(40 + i, 1 + 23 * i as usize, vocab)).collect();
    assert_same_steps_over(what, m, &prompts, a, b)
}

/// [`assert_same_steps_on`] over the given prompts (one sequence each).
fn assert_same_steps_over(
    what: &str,
    m: &baton_formats::LoadedModel,
    prompts: &[Vec<u32>],
    a: impl Fn(bool) -> Switches,
    b: impl Fn(bool) -> Switches,
) -> (ModelRunner<CudaBackend>, ModelRunner<CudaBackend>) {
    let mut last = None;
    for graphs in [false, true] {
        let (mut ma, mut mb) = (model(m, a(graphs)), model(m, b(graphs)));
        let with = run(&mut ma, prompts, 24);
        let without = run(&mut mb, prompts, 24);
        assert_eq!(with.len(), without.len());
        for (step, (x, y)) in with.iter().zip(&without).enumerate() {
            assert!(x.iter().all(|v| v.is_finite()), "{:?} step {step}: non-finite logits", m.config.architecture);
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{:?}, graphs {graphs}, step {step}: logits differ with {what} on",
                m.config.architecture
            );
        }
        last = Some((ma, mb));
    }
    last.expect("two runs")
}

#[test]
fn gpu_pdl_launches_give_bit_identical_steps() {
    assert_same_steps("PDL", &[TinySpec::llama(), TinySpec::qwen2()], Switches::defaults, |graphs| Switches {
        pdl: false,
        ..Switches::defaults(graphs)
    });
}

#[test]
fn gpu_fused_gate_gives_bit_identical_steps() {
    assert_same_steps("the fused gate", &[TinySpec::llama(), TinySpec::qwen3()], Switches::defaults, |graphs| {
        Switches { fused_gate: false, ..Switches::defaults(graphs) }
    });
}

#[test]
fn gpu_fused_rope_gives_bit_identical_steps() {
    assert_same_steps(
        "RoPE in the qkv epilogue",
        &[TinySpec::llama(), TinySpec::qwen2(), TinySpec::qwen3()],
        Switches::defaults,
        |graphs| Switches { fused_rope: false, ..Switches::defaults(graphs) },
    );
    let fp8 = |graphs| Switches { fp8_kv: true, ..Switches::defaults(graphs) };
    assert_same_steps_on(
        "RoPE in the qkv epilogue over an FP8 cache",
        &tiny(&TinySpec::llama()).model,
        fp8,
        |graphs| Switches { fused_rope: false, ..fp8(graphs) },
    );
}

#[test]
fn gpu_fp8_weight_epilogues_give_bit_identical_steps() {
    // Decode steps of 9 rows run the skinny FP8 kernel: with the switches on, the gated
    // activation and (Llama; Qwen2 with its qkv bias; not Qwen3, whose q/k norm keeps the RoPE
    // kernel) RoPE + the KV write in its epilogue.
    for (spec, rope) in [(TinySpec::llama(), true), (TinySpec::qwen2(), true), (TinySpec::qwen3(), false)] {
        let mut m = tiny(&spec);
        WeightQuantization::Fp8.apply(&mut m.model.config);
        let arch = m.model.config.architecture;
        let off = |graphs| Switches { fused_rope: false, fused_gate: false, ..Switches::defaults(graphs) };
        let (on, unfused) = assert_same_steps_on("the FP8 epilogues", &m.model, Switches::defaults, off);
        assert_eq!(unfused.backend().fp8_fused_epilogues(), (0, 0), "{arch:?}: the switches off, an epilogue ran");
        // Per decode step: every layer's gate, and where it is offered the qkv product's RoPE of
        // every layer past the first (layer 0's input norm is no boundary). These runners replay
        // graphs, so the host counted at least the captured step.
        let layers = on.config().num_hidden_layers as u64;
        let (gated, roped) = on.backend().fp8_fused_epilogues();
        assert!(gated >= layers, "{arch:?}: {gated} gated FP8 epilogues, fewer than one step's {layers}");
        if rope {
            assert!(roped >= layers - 1, "{arch:?}: {roped} RoPE FP8 epilogues, fewer than one step's {}", layers - 1);
        } else {
            assert_eq!(roped, 0, "{arch:?}: a q/k norm, yet the RoPE epilogue ran");
        }
        if rope {
            let fp8 = |graphs| Switches { fp8_kv: true, ..Switches::defaults(graphs) };
            let off = |graphs| Switches { fused_rope: false, ..fp8(graphs) };
            assert_same_steps_on("RoPE in the FP8 qkv epilogue over an FP8 cache", &m.model, fp8, off);
        }
    }
}

#[test]
fn gpu_fused_norm_matches_the_unfused_steps() {
    let specs = [TinySpec::llama(), TinySpec::qwen3(), TinySpec::qwen2(), TinySpec::qwen3_moe(), TinySpec::mixtral()];
    for spec in specs {
        let m = tiny(&spec);
        let vocab = m.model.config.vocab_size;
        // Eight sequences: decode steps of 8 rows, the most the skinny GEMM (so the fusion) takes.
        let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(40 + i, 1 + 23 * i as usize, vocab)).collect();
        // On the MoE models, each choice of the MoE branch's norms to fuse.
        let fusions: &[MoeNormFusion] = match spec.moe {
            Some(_) => &[MoeNormFusion::Both, MoeNormFusion::Router, MoeNormFusion::Down],
            None => &[MoeNormFusion::Both],
        };
        for (&fusion, graphs) in fusions.iter().flat_map(|f| [(f, false), (f, true)]) {
            let on = Switches::defaults(graphs);
            let off = Switches { fused_norm: false, ..on };
            let mut fused_model = model(&m.model, on);
            fused_model.backend_mut().set_moe_norm_fusion(Some(fusion));
            let fused = run(&mut fused_model, &prompts, 24);
            let mut unfused_model = model(&m.model, off);
            let unfused = run(&mut unfused_model, &prompts, 24);
            // The decode steps (8 rows: the skinny GEMM's largest) took the fused route: every
            // model's dense boundaries (Qwen3-MoE has a dense layer), the MoE models' MoE branches;
            // nothing with the switch off.
            let (dense, moe) = fused_model.backend().norm_fusions();
            let what = format!("{:?}, {fusion:?}, graphs {graphs}", spec.architecture);
            assert_eq!(dense > 0, spec.architecture != Architecture::Mixtral, "{what}: fused dense boundaries {dense}");
            assert_eq!(moe > 0, spec.moe.is_some(), "{what}: fused MoE branches {moe}");
            assert_eq!(unfused_model.backend().norm_fusions(), (0, 0), "{what}: fused with the switch off");
            let mut compared = 0;
            'steps: for (step, (x, y)) in fused.iter().zip(&unfused).enumerate() {
                let what = format!("{:?}, {fusion:?}, graphs {graphs}, step {step}", spec.architecture);
                assert!(x.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
                let err = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
                let norm = y.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
                assert!(err <= 1e-2 * norm, "{what}: logits differ by {:.3e} (relative)", err / norm);
                compared += 1;
                for (row_x, row_y) in x.chunks_exact(vocab).zip(y.chunks_exact(vocab)) {
                    let top = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(t, v)| (t, *v));
                    let (Some((tx, _)), Some((ty, vy))) = (top(row_x), top(row_y)) else { continue };
                    if tx != ty {
                        // Only at a near tie; the sequences part here, so stop comparing.
                        let gap = vy - row_y[tx];
                        assert!(gap <= 1e-2 * vy.abs().max(1.0), "{what}: greedy tokens differ by a gap of {gap}");
                        break 'steps;
                    }
                }
            }
            assert!(compared >= 2, "{:?}: only {compared} steps compared", spec.architecture);
        }
    }
}

#[test]
fn gpu_w8a8_norm_quantization_gives_bit_identical_steps() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let mut m = tiny(&spec);
        WeightQuantization::Fp8.apply(&mut m.model.config);
        let on = Switches::defaults;
        let off = |graphs| Switches { fused_norm: false, ..Switches::defaults(graphs) };
        let (fused, _) = assert_same_steps_on("the W8A8 norm quantization", &m.model, on, off);
        // The prefill step (837 rows) went through cuBLASLt's FP8 GEMM: the fused path ran, and
        // the down projections took SiLU·mul's codes (once a layer of each prefill step).
        assert!(fused.backend().w8a8_active(), "{:?}: cuBLASLt refused the FP8 GEMM", spec.architecture);
        assert!(
            fused.backend().w8a8_handoffs() > 0,
            "{:?}: no down projection took SiLU·mul's codes",
            spec.architecture
        );
    }
}

#[test]
fn gpu_carveout_policies_give_bit_identical_steps() {
    let rule = CarveoutPins {
        others: Some(STEP_CARVEOUT_PERCENT),
        attention: Some(STEP_CARVEOUT_PERCENT),
        split_by_pin: true,
    };
    let pins_only = CarveoutPins { split_by_pin: false, ..rule };
    let fixed = |pins, fp8_kv| {
        move |graphs| Switches { carveout: CarveoutPolicy::Fixed(pins), fp8_kv, ..Switches::defaults(graphs) }
    };
    // Llama's qkv product carries RoPE (the rule applies); Qwen3's q/k norm keeps the RoPE kernel
    // (never pinned).
    for (spec, pinned) in [(TinySpec::llama(), rule), (TinySpec::qwen3(), CarveoutPins::default())] {
        let m = tiny(&spec).model;
        let arch = m.config.architecture;
        let vocab = m.config.vocab_size;
        // Decode steps of one row and of three (a graph's bucket of four): the rule's shapes.
        for n in [1, 3] {
            let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(70 + i, 150 + 40 * i as usize, vocab)).collect();
            for fp8_kv in [false, true] {
                let per_step = move |graphs| Switches { fp8_kv, ..Switches::defaults(graphs) };
                let what = format!("{n} rows, FP8 cache {fp8_kv}: the per-step carve-out against its pins fixed");
                let (auto, _) = assert_same_steps_over(&what, &m, &prompts, per_step, fixed(pinned, fp8_kv));
                // The last step was a decode step of n rows.
                assert_eq!(auto.backend().device().carveout_pins(), pinned, "{arch:?}, {n} rows: the rule's pins");
                if n == 1 && pinned == rule {
                    let what = format!("{n} rows, FP8 cache {fp8_kv}: pins alone against none");
                    let none = fixed(CarveoutPins::default(), fp8_kv);
                    assert_same_steps_over(&what, &m, &prompts, fixed(pins_only, fp8_kv), none);
                }
            }
        }
        // Nine rows take the wide variant: no pin.
        let (nine, _) = assert_same_steps_on("nine rows", &m, Switches::defaults, Switches::defaults);
        assert_eq!(nine.backend().device().carveout_pins(), CarveoutPins::default(), "{arch:?}: nine rows were pinned");
    }
}
