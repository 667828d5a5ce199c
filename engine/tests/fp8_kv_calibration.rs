//! FP8 KV scale calibration (`--calculate-kv-scales`) on the CPU reference backend.
//!
//! The scales of a calibrating write are amax / vLLM's constants over the write's own K (after
//! RoPE) and V, only for the layers asked; the engine calibrates on its first prefill step, then
//! keeps the scales; on models whose K/V fall outside what scale 1.0 stores well (values past
//! ±448, or in E4M3's subnormal range), calibrated FP8 logits are closer to the bf16 cache's
//! than uncalibrated ones (figures printed, the comparison asserted); calibration is refused
//! unless the cache is FP8; and a decode side adopts a prefill side's calibrated scales while
//! its own wait, else requantizes the received codes into its own.

mod common;

use baton_core::kv_transfer::KvDtype;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{Backend, BatchLayout, KvCacheShape, KvScale, SeqLayout};
use baton_engine::kv_cache_dtype::{K_SCALE_CONSTANT, KvCacheDtype, KvCoding, V_SCALE_CONSTANT};
use baton_engine::kv_connector::KvAccess;
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{DeviceSpec, EngineConfig, start_engine};
use baton_formats::testing::TinySpec;
use baton_formats::{LoadFormat, LoadedModel, load_model};
use baton_kernels::cpu::fp8::quantize_e4m3;
use baton_kernels::cpu::{RopeScalingKind, RopeTable, abs_max, requantize_e4m3};
use common::relay::*;
use common::teacher_forced::{self, Figures, Seq};
use common::*;

/// Deterministic values in `[-amp, amp)`.
fn values(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

#[test]
fn calibrated_scales_are_amax_over_the_vllm_constants_of_the_rotated_k_and_v() {
    let (layers, bs, kvh, hd, n_heads) = (2, 4, 2, 8, 4);
    let mut b = CpuBackend::new();
    let table = RopeTable::new(hd, 10_000.0, RopeScalingKind::None).expect("rope");
    b.set_rope(table.clone()).expect("rope");
    b.set_kv_cache_dtype(KvDtype::Fp8E4M3, vec![KvScale::default(); layers]).expect("fp8");
    b.alloc_kv_cache(KvCacheShape {
        num_layers: layers,
        num_blocks: 4,
        block_size: bs,
        num_kv_heads: kvh,
        head_dim: hd,
        dtype: KvDtype::Fp8E4M3,
    })
    .expect("cache");
    // Two sequences (5 prompt tokens; 3 more of one already 2 long), as a mixed step has them.
    let positions: Vec<usize> = (0..5).chain(2..5).collect();
    let batch = BatchLayout {
        tokens: vec![0; 8],
        positions: positions.clone(),
        seqs: vec![
            SeqLayout { row_start: 0, n_tokens: 5, start_pos: 0, block_table: vec![0, 1] },
            SeqLayout { row_start: 5, n_tokens: 3, start_pos: 2, block_table: vec![2, 3] },
        ],
        logit_rows: vec![4, 7],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    let rows = positions.len();
    let mut q = values(1, rows * n_heads * hd, 1.0);
    let k = values(2, rows * kvh * hd, 37.0);
    let v = values(3, rows * kvh * hd, 2.5);
    let mut rotated = k.clone();
    table.apply_partial(&mut rotated, kvh, hd, &positions).expect("rotate");
    let (k_amax, v_amax) = (abs_max(&rotated), abs_max(&v));
    assert_ne!(k_amax, abs_max(&k), "the rotation changes the amax, so the test tells before from after RoPE");

    // Only layer 1 calibrates.
    b.calibrate_kv_scales(&[false, true]).expect("calibrate");
    let mut kb = k.clone();
    b.rope_and_write_kv(1, &mut q, &mut kb, &v, n_heads, &batch).expect("write");
    let mut kb0 = k.clone();
    b.rope_and_write_kv(0, &mut q.clone(), &mut kb0, &v, n_heads, &batch).expect("write layer 0");
    b.calibrate_kv_scales(&[]).expect("stop");
    let scales = b.kv_scales();
    assert_eq!(scales[0], KvScale::default(), "a layer not asked keeps its scales");
    assert_eq!(scales[1], KvScale { k: k_amax / K_SCALE_CONSTANT, v: v_amax / V_SCALE_CONSTANT });
    assert_eq!((K_SCALE_CONSTANT, V_SCALE_CONSTANT), (200.0, 100.0), "vLLM's defaults");

    // The write used the new scales: sequence 0's five tokens are blocks 0 and 1's first slots.
    let (kc, vc) = b.kv_io().expect("kv io").read_kv_blocks(1, &[0, 1]).expect("read");
    let w = 5 * kvh * hd;
    let mut want = vec![0u8; w];
    quantize_e4m3(&rotated[..w], scales[1].k, &mut want);
    assert_eq!(&kc[..w], &want[..]);
    quantize_e4m3(&v[..w], scales[1].v, &mut want);
    assert_eq!(&vc[..w], &want[..]);

    // Later writes do not calibrate, and a NaN amax keeps the scale it had.
    let before = b.kv_scales();
    b.rope_and_write_kv(1, &mut q.clone(), &mut k.clone(), &values(4, v.len(), 300.0), n_heads, &batch).expect("w");
    assert_eq!(b.kv_scales(), before, "calibration was stopped");
    let mut nan_v = v.clone();
    nan_v[3] = f32::NAN;
    b.calibrate_kv_scales(&[true, false]).expect("calibrate");
    b.rope_and_write_kv(0, &mut q.clone(), &mut k.clone(), &nan_v, n_heads, &batch).expect("write");
    assert_eq!(b.kv_scales()[0], KvScale { k: k_amax / K_SCALE_CONSTANT, v: 1.0 });
}

/// The tiny Llama with every tensor ending in each suffix multiplied by its factor.
fn scaled(parts: &[(&str, f32)]) -> (TinyModel, LoadedModel) {
    let m = tiny(&TinySpec::llama());
    let mut model = load_model(&m.path, LoadFormat::Auto).expect("load tiny model");
    for &(suffix, factor) in parts {
        model = scaled_tensors(model, suffix, factor);
    }
    (m, model)
}

/// bf16 cache vs FP8 at scale 1.0 and vs FP8 calibrated, teacher-forced on the bf16 run.
fn plain_and_calibrated(model: &LoadedModel, prompt: &[u32], steps: usize) -> (Figures, Figures, Vec<KvScale>) {
    let store = model.weights.as_ref();
    let len = prompt.len() + steps;
    let mut reference = Seq::new(model, store, KvCacheDtype::Auto, len);
    let mut plain = Seq::new(model, store, KvCacheDtype::Fp8E4M3, len);
    let mut cal = Seq::new(model, store, KvCacheDtype::Fp8E4M3, len).calibrated();
    let p = teacher_forced::compare(prompt, steps, |t| reference.feed(t), |t| plain.feed(t));
    let mut reference = Seq::new(model, store, KvCacheDtype::Auto, len);
    let mut first = None;
    let c = teacher_forced::compare(
        prompt,
        steps,
        |t| reference.feed(t),
        |t| {
            let logits = cal.feed(t);
            // Fixed after the first prefill: every later step sees the same scales.
            let now = cal.runner.kv_scales();
            assert_eq!(*first.get_or_insert_with(|| now.clone()), now, "the scales moved after the first prefill");
            logits
        },
    );
    (p, c, cal.runner.kv_scales())
}

#[test]
fn calibrated_fp8_logits_are_closer_to_the_bf16_cache_than_scale_one() {
    // Values past E4M3's ±448 at scale 1.0 (V projections ×4000), then values in its subnormal
    // range (K and V projections ÷2000): the two ways a fixed scale of 1.0 fails.
    for (name, parts) in [
        ("large V", vec![("v_proj.weight", 4000.0)]),
        ("small K and V", vec![("k_proj.weight", 1.0 / 2000.0), ("v_proj.weight", 1.0 / 2000.0)]),
    ] {
        let (_keep, model) = scaled(&parts);
        let prompt = prompt(7, 24, model.config.vocab_size);
        let (plain, cal, scales) = plain_and_calibrated(&model, &prompt, 32);
        for (tag, f) in [("scale 1.0", &plain), ("calibrated", &cal)] {
            println!(
                "fp8-kv {tag} {name}: mean |Δlogit| {:.5}, max |Δlogit| {:.4}, greedy agreement {}/{}",
                f.mean_abs, f.max_abs, f.agree, f.steps
            );
        }
        println!("{name}: calibrated scales {scales:?}");
        assert!(scales.iter().all(|s| *s != KvScale::default()), "{name}: every layer calibrated");
        assert!(
            cal.mean_abs < plain.mean_abs,
            "{name}: calibrated mean |Δlogit| {} is not below scale 1.0's {}",
            cal.mean_abs,
            plain.mean_abs
        );
    }
}

#[test]
fn calibration_is_refused_unless_the_cache_is_fp8() {
    let m = tiny(&TinySpec::llama());
    for dtype in [KvCacheDtype::Auto, KvCacheDtype::Bf16] {
        let cfg = EngineConfig {
            kv_cache_dtype: dtype,
            calculate_kv_scales: true,
            num_threads: Some(1),
            ..EngineConfig::default()
        };
        let err = start_engine(&m.model, DeviceSpec::Cpu, cfg).err().expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("--calculate-kv-scales") && msg.contains("--kv-cache-dtype fp8"), "{msg}");
    }
    let store = m.model.weights.as_ref();
    let mut f32_seq = Seq::new(&m.model, store, KvCacheDtype::Auto, 16);
    let err = f32_seq.runner.calculate_kv_scales().expect_err("an f32 cache does not calibrate");
    assert!(err.to_string().contains("F32"), "{err}");
    let ok = EngineConfig {
        kv_cache_dtype: KvCacheDtype::Fp8E4M3,
        calculate_kv_scales: true,
        num_threads: Some(1),
        ..EngineConfig::default()
    };
    let e = start_engine(&m.model, DeviceSpec::Cpu, ok).expect("FP8 + calibration starts");
    assert_eq!(run(&e, &prompt(1, 9, m.model.config.vocab_size), greedy(4)).len(), 4);
    e.shutdown();
}

#[test]
fn a_receiving_cache_adopts_pending_scales_and_otherwise_requantizes() {
    let (_keep, model) = scaled(&[("v_proj.weight", 4000.0)]);
    let store = model.weights.as_ref();
    let prompt = prompt(11, 20, model.config.vocab_size);
    let blocks: Vec<u32> = (1..=2).rev().collect();
    // P: calibrated on the prompt.
    let mut p = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, 32).calibrated();
    let p_logits = p.feed(&prompt);
    let p_scales = p.runner.kv_scales();
    let layers = p_scales.len();
    let frames: Vec<(Vec<u8>, Vec<u8>, Option<KvCoding>)> = (0..layers)
        .map(|l| {
            let (k, v) = KvAccess::read_kv_blocks(&mut p.runner, l, &blocks).expect("read");
            (k, v, KvAccess::kv_coding(&p.runner, l))
        })
        .collect();
    assert!(frames.iter().all(|f| f.2.is_some()));

    // D with calibration pending adopts them, and decodes exactly as P does.
    let mut d = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, 32).calibrated();
    for (l, (k, v, s)) in frames.iter().enumerate() {
        d.runner.import_kv_blocks(l, &blocks, k, v, s.as_ref()).expect("import");
    }
    assert_eq!(d.runner.kv_scales(), p_scales);
    assert!(!d.runner.kv_scales_pending(), "adopted scales are fixed");
    d.skip(prompt.len());
    let next = teacher_forced::argmax(&p_logits);
    assert_eq!(d.feed(&[next]), p.feed(&[next]), "D decodes over P's KV exactly as P does");

    // D without calibration keeps scale 1.0 and stores the codes requantized into it.
    let mut fixed = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, 32);
    for (l, (k, v, s)) in frames.iter().enumerate() {
        fixed.runner.import_kv_blocks(l, &blocks, k, v, s.as_ref()).expect("import");
        let (kc, vc) = KvAccess::read_kv_blocks(&mut fixed.runner, l, &blocks).expect("read back");
        let (mut want_k, mut want_v) = (k.clone(), v.clone());
        let sent = s.as_ref().expect("fp8").scale;
        requantize_e4m3(&mut want_k, sent.k, 1.0);
        requantize_e4m3(&mut want_v, sent.v, 1.0);
        assert_eq!((kc, vc), (want_k, want_v), "layer {l}");
    }
    assert_eq!(fixed.runner.kv_scales(), vec![KvScale::default(); layers]);
}

#[test]
fn a_calibrated_prefill_worker_hands_its_scales_to_a_calibrating_decode_worker_over_tcp() {
    // V past ±448: scale 1.0 clips, so a D that did not take P's scales would decode otherwise.
    let (_keep, model) = scaled(&[("v_proj.weight", 4000.0)]);
    let vocab = model.config.vocab_size;
    let cfg =
        EngineConfig { kv_cache_dtype: KvCacheDtype::Fp8E4M3, calculate_kv_scales: true, ..EngineConfig::default() };
    let prompts: Vec<Vec<u32>> =
        [33usize, 9, 50].iter().enumerate().map(|(i, &n)| prompt(40 + i as u64, n, vocab)).collect();
    // The unified engine's first prefill is the same first prompt as P's, so the same scales.
    let unified = engine(&model, cfg.clone());
    let p = engine(&model, cfg.clone());
    let d = engine(&model, cfg);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        relays_match_unified(&unified, &p, &d, &listener, &prompts).await;
    });
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d] {
        e.shutdown();
    }
}
