//! FP8 KV key smoothing (`--kv-k-smoothing`, `baton_engine::kv_k_smoothing`) on the CPU
//! reference backend: what the start-up calibration measures and where it refuses, how much
//! closer to the bf16 cache it brings the default model's logits (a figure, printed, with a
//! loose bound), and how a hand-off between caches of different shifts is stored: adopted by a
//! cache no step has written, requantized otherwise, and over TCP identical to the unified
//! engine.

mod common;

use baton_engine::EngineConfig;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::{KvCacheDtype, KvCoding};
use baton_engine::kv_connector::KvAccess;
use baton_engine::kv_k_smoothing::{self, CALIBRATION_TEXT, KvKSmoothing, Smoothing};
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::runner::ModelRunner;
use baton_formats::testing::default_model_path;
use baton_formats::{LoadFormat, LoadedModel, load_model};
use baton_kernels::cpu::requantize_keys_e4m3;
use common::relay::*;
use common::teacher_forced::{self, Seq};
use common::*;

/// The served context the shifts are measured for (SmolLM2's `max_position_embeddings`).
const MAX_LEN: usize = 8192;

fn default_model() -> LoadedModel {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    load_model(&path, LoadFormat::Auto).expect("load default model")
}

fn encode(model: &LoadedModel, text: &str, special: bool) -> Vec<u32> {
    model.tokenizer.as_ref().expect("tokenizer").encode(text, special).expect("encode")
}

/// Tokens every sequence here has room for (the calibration text's included), so all of
/// them page alike: [`Seq`] deals its blocks from the top of a pool of `ROOM / 16 + 1`.
const ROOM: usize = 1024;

/// The blocks of a [`Seq`] of [`ROOM`] that hold its first `n` tokens.
fn first_blocks(n: usize) -> Vec<u32> {
    let top = ROOM.div_ceil(16) as u32;
    (0..n.div_ceil(16) as u32).map(|i| top - i).collect()
}

/// An FP8 sequence whose keys are smoothed on the calibration text first.
fn smoothed_seq(model: &LoadedModel) -> (Seq, Smoothing) {
    let calibration = encode(model, CALIBRATION_TEXT, true);
    assert!(calibration.len() < ROOM);
    let mut seq = Seq::new(model, model.weights.as_ref(), KvCacheDtype::Fp8E4M3, ROOM);
    let blocks = ROOM.div_ceil(16) + 1;
    let done = kv_k_smoothing::calibrate(&mut seq.runner, &calibration, (blocks, 16), MAX_LEN).expect("calibrate");
    (seq, done)
}

/// Log-probabilities of every position of `ids` fed in chunks of 256 through `runner`'s cache
/// (blocks from `table`).
fn log_probs(runner: &mut ModelRunner<CpuBackend>, ids: &[u32], table: &[u32]) -> Vec<Vec<f64>> {
    let vocab = runner.config().vocab_size;
    let mut out = Vec::new();
    for start in (0..ids.len()).step_by(256) {
        let chunk = &ids[start..(start + 256).min(ids.len())];
        let batch = BatchLayout {
            tokens: chunk.to_vec(),
            positions: (start..start + chunk.len()).collect(),
            seqs: vec![SeqLayout {
                row_start: 0,
                n_tokens: chunk.len(),
                start_pos: start,
                block_table: table.to_vec(),
            }],
            logit_rows: (0..chunk.len()).collect(),
            pending: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        let logits = runner.forward(&batch).expect("forward");
        for row in logits.chunks_exact(vocab) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            out.push(row.iter().map(|&x| x as f64 - lse).collect());
        }
    }
    out
}

/// Mean KL(base ‖ run) in nats per position.
fn mean_kl(base: &[Vec<f64>], run: &[Vec<f64>]) -> f64 {
    let kl = |p: &[f64], q: &[f64]| p.iter().zip(q).map(|(&a, &b)| a.exp() * (a - b)).sum::<f64>();
    base.iter().zip(run).map(|(p, q)| kl(p, q)).sum::<f64>() / base.len() as f64
}

#[test]
fn smoothing_the_default_models_keys_brings_fp8_logits_closer_to_the_bf16_cache() {
    let model = default_model();
    let text = include_str!("../../bench/data/eighty-days-ch1-2.txt");
    let ids: Vec<u32> = encode(&model, text, false).into_iter().take(768).collect();
    let store = model.weights.as_ref();
    let (mut smoothed, done) = smoothed_seq(&model);
    let Smoothing::Shifted { tokens, retained, max_abs } = done else {
        panic!("the default model's keys were not smoothed: {done:?}")
    };
    println!(
        "calibration: {tokens} tokens, {:.1} % of the measured offset kept, largest |shift| {max_abs:.3}",
        retained * 100.0
    );
    assert!(tokens >= 500 && retained > 0.0 && retained < 1.0, "{done:?}");
    let (head_dim, kv_heads) = smoothed.runner.key_geometry();
    for layer in 0..smoothed.runner.num_layers() {
        let shift = smoothed.runner.kv_k_shift(layer);
        assert_eq!(shift.len(), kv_heads * head_dim, "layer {layer}");
        assert!(shift.iter().all(|s| s.is_finite()) && shift.iter().any(|&s| s != 0.0), "layer {layer}: {shift:?}");
    }
    let table = first_blocks(ROOM);
    let mut bf16 = Seq::new(&model, store, KvCacheDtype::Auto, ROOM);
    let mut plain = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, ROOM);
    let base = log_probs(&mut bf16.runner, &ids, &table);
    let unshifted = mean_kl(&base, &log_probs(&mut plain.runner, &ids, &table));
    let shifted = mean_kl(&base, &log_probs(&mut smoothed.runner, &ids, &table));
    println!(
        "fp8-kv SmolLM2-135M over {} tokens: mean KL to the bf16 cache {unshifted:.5} unshifted, {shifted:.5} smoothed ({:+.1} %)",
        ids.len(),
        (shifted / unshifted - 1.0) * 100.0
    );
    assert!(unshifted > 0.0, "the FP8 cache is really used");
    assert!(shifted < 0.8 * unshifted, "smoothed KL {shifted} is not 20 % below the unshifted {unshifted}");
}

#[test]
fn soft_capped_or_sink_attention_bf16_caches_and_short_texts_stay_unshifted() {
    for (name, why) in [("gemma2", "soft-capping"), ("gpt_oss", "sinks")] {
        let model = golden_model(name);
        let mut seq = Seq::new(&model, model.weights.as_ref(), KvCacheDtype::Fp8E4M3, 256);
        let tokens = prompt(3, 200, model.config.vocab_size);
        let done = kv_k_smoothing::calibrate(&mut seq.runner, &tokens, (17, 16), MAX_LEN).expect("calibrate");
        match &done {
            Smoothing::Unshifted(reason) => assert!(reason.contains(why), "{name}: {reason}"),
            other => panic!("{name}: {other:?}"),
        }
        assert!((0..seq.runner.num_layers()).all(|l| seq.runner.kv_k_shift(l).is_empty()), "{name}");
    }
    // Gemma 3 (q/k norm, no soft-cap) is smoothed.
    let model = golden_model("gemma3_text");
    let mut seq = Seq::new(&model, model.weights.as_ref(), KvCacheDtype::Fp8E4M3, 256);
    let tokens = prompt(4, 200, model.config.vocab_size);
    let done = kv_k_smoothing::calibrate(&mut seq.runner, &tokens, (17, 16), MAX_LEN).expect("calibrate");
    assert!(matches!(done, Smoothing::Shifted { tokens: 200, .. }), "{done:?}");

    let model = golden_model("llama");
    let tokens = prompt(5, 200, model.config.vocab_size);
    let mut bf16 = Seq::new(&model, model.weights.as_ref(), KvCacheDtype::Auto, 256);
    let done = kv_k_smoothing::calibrate(&mut bf16.runner, &tokens, (17, 16), MAX_LEN).expect("calibrate");
    assert!(matches!(&done, Smoothing::Unshifted(r) if r.contains("not FP8")), "{done:?}");
    let mut fp8 = Seq::new(&model, model.weights.as_ref(), KvCacheDtype::Fp8E4M3, 256);
    let short = kv_k_smoothing::calibrate(&mut fp8.runner, &tokens[..40], (17, 16), MAX_LEN).expect("calibrate");
    assert!(matches!(&short, Smoothing::Unshifted(r) if r.contains("40 calibration tokens")), "{short:?}");
    assert!((0..fp8.runner.num_layers()).all(|l| fp8.runner.kv_k_shift(l).is_empty()));
}

#[test]
fn a_fresh_cache_adopts_the_senders_shift_and_a_used_one_requantizes_into_its_own() {
    let model = default_model();
    let prompt: Vec<u32> = encode(&model, "Phileas Fogg was a man of precise habits, and", false);
    let blocks = first_blocks(prompt.len());
    // P: smoothed, fed the prompt.
    let (mut p, _) = smoothed_seq(&model);
    let p_logits = p.feed(&prompt);
    let layers = p.runner.num_layers();
    let frames: Vec<(Vec<u8>, Vec<u8>, Option<KvCoding>)> = (0..layers)
        .map(|l| {
            let (k, v) = KvAccess::read_kv_blocks(&mut p.runner, l, &blocks).expect("read");
            (k, v, KvAccess::kv_coding(&p.runner, l))
        })
        .collect();
    assert!(frames.iter().all(|f| f.2.as_ref().is_some_and(|c| !c.k_shift.is_empty())), "P's frames carry shifts");

    // D, unshifted and fresh (no step since its cache was made): adopts P's shifts, stores the
    // codes as sent, and decodes exactly as P does.
    let store = model.weights.as_ref();
    let mut d = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, ROOM);
    for (l, (k, v, c)) in frames.iter().enumerate() {
        d.runner.import_kv_blocks(l, &blocks, k, v, c.as_ref()).expect("import");
        assert_eq!(Some(d.runner.kv_k_shift(l)), c.as_ref().map(|c| c.k_shift.clone()), "layer {l} adopted");
        assert_eq!(&KvAccess::read_kv_blocks(&mut d.runner, l, &blocks).expect("read").0, k, "layer {l} as sent");
    }
    d.skip(prompt.len());
    let next = teacher_forced::argmax(&p_logits);
    assert_eq!(d.feed(&[next]), p.feed(&[next]), "D decodes over P's KV exactly as P does");

    // D2 has run a step of its own: its (empty) shift stays, the keys are requantized into it.
    let mut used = Seq::new(&model, store, KvCacheDtype::Fp8E4M3, ROOM);
    used.feed(&prompt);
    let stride = used.runner.key_geometry().0 * used.runner.key_geometry().1;
    for (l, (k, v, c)) in frames.iter().enumerate() {
        used.runner.import_kv_blocks(l, &blocks, k, v, c.as_ref()).expect("import");
        assert!(used.runner.kv_k_shift(l).is_empty(), "layer {l}: a used cache keeps its shift");
        let (kc, vc) = KvAccess::read_kv_blocks(&mut used.runner, l, &blocks).expect("read back");
        let sent = c.as_ref().expect("fp8");
        let mut want = k.clone();
        requantize_keys_e4m3(&mut want, stride, (sent.scale.k, &sent.k_shift), (1.0, &[])).expect("requantize");
        assert_eq!(kc, want, "layer {l}: keys requantized from P's shift into none");
        assert_eq!(&vc, v, "layer {l}: values of equal scales stored as sent");
    }
}

#[test]
fn a_smoothed_prefill_worker_hands_off_over_tcp_to_an_unshifted_decode_worker() {
    let model = default_model();
    assert_eq!(model.config.max_position_embeddings, MAX_LEN, "the shifts measured here are the served ones");
    let fp8 = EngineConfig { kv_cache_dtype: KvCacheDtype::Fp8E4M3, ..EngineConfig::default() };
    let off = EngineConfig { kv_k_smoothing: KvKSmoothing::Off, ..fp8.clone() };
    let prompts: Vec<Vec<u32>> =
        ["The Reform Club was", "Passepartout, who had served"].iter().map(|t| encode(&model, t, false)).collect();
    // The unified engine and P measure the same shifts; D measures none and adopts P's.
    let unified = engine(&model, fp8.clone());
    let p = engine(&model, fp8);
    let d = engine(&model, off);
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
