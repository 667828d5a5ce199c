//! The engine with sliding-window layers (the transformers-written Gemma 2 and Gemma 3 text
//! fixtures: window 16, block size 16), on prompts longer than the window:
//! - greedy output is the same alone, batched with chunked prefill whose chunks cross the
//!   window's edge, without chunking, under preemption, with async scheduling off, and on a
//!   second round served from the prefix cache (which must hit);
//! - a prefix-cache hit on a shared prefix longer than the window gives the tokens a cold
//!   engine gives;
//! - KV that fell out of every sliding layer's window is never read by those layers: poisoning
//!   it changes nothing, while poisoning KV inside the window does.

mod common;

use baton_core::api::{EngineClient, EngineRequest};
use baton_engine::EngineConfig;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::testing::load_golden;
use baton_formats::{LayerType, LoadFormat, LoadedModel, load_model};
use common::*;

const FIXTURES: [&str; 2] = ["gemma2", "gemma3_text"];

fn fixture(name: &str) -> LoadedModel {
    let (dir, _) = load_golden(name).expect("golden fixture");
    load_model(&dir, LoadFormat::Auto).expect("load fixture")
}

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    // Around the window (16) and the block size (16), and several windows long.
    [1usize, 15, 16, 17, 31, 33, 47, 70, 101]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(300 + i as u64, len, vocab))
        .collect()
}

#[test]
fn windowed_models_are_batch_chunk_and_prefix_cache_invariant() {
    for name in FIXTURES {
        let model = fixture(name);
        let ps = prompts(model.config.vocab_size);
        let n_out = 24;
        let alone_engine = engine(&model, EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() });
        let alone: Vec<Vec<u32>> = ps.iter().map(|p| run(&alone_engine, p, greedy(n_out))).collect();
        alone_engine.shutdown();
        let distinct: std::collections::HashSet<&Vec<u32>> = alone.iter().collect();
        assert!(distinct.len() > ps.len() / 2, "{name}: outputs barely depend on the prompt: {alone:?}");
        for (label, cfg) in [
            // Chunks of 7 cross the window's edge at every offset.
            (
                "chunked prefill (budget 7)",
                EngineConfig { max_num_batched_tokens: 7, max_num_seqs: 4, ..EngineConfig::default() },
            ),
            (
                "no chunked prefill",
                EngineConfig { enable_chunked_prefill: false, max_num_batched_tokens: 256, ..EngineConfig::default() },
            ),
            (
                "tiny KV pool (preemption)",
                EngineConfig { num_kv_blocks: Some(14), max_model_len: Some(160), ..EngineConfig::default() },
            ),
            ("synchronous scheduling", EngineConfig { async_scheduling: false, ..EngineConfig::default() }),
        ] {
            let e = engine(&model, cfg);
            let streams: Vec<_> =
                ps.iter().map(|p| e.submit(EngineRequest::new(p.clone(), greedy(n_out))).expect("submit")).collect();
            let together: Vec<Vec<u32>> = streams.into_iter().map(|s| drain(s).0).collect();
            assert_eq!(together, alone, "{name}, {label}: greedy output differs from running alone");
            if label.contains("preemption") {
                assert!(e.stats().num_preemptions > 0, "{name}, {label}: the small pool should have preempted");
            }
            let hits = e.stats().prefix_cache_hits;
            let again: Vec<Vec<u32>> = ps.iter().map(|p| run(&e, p, greedy(n_out))).collect();
            assert_eq!(again, alone, "{name}, {label}: prefix-cache hits changed the output");
            if !label.contains("preemption") {
                assert!(e.stats().prefix_cache_hits - hits >= 64, "{name}, {label}: the second round hit no cache");
            }
            assert_all_blocks_free(&e);
            e.shutdown();
        }
    }
}

#[test]
fn a_prefix_hit_longer_than_the_window_gives_the_cold_tokens() {
    for name in FIXTURES {
        let model = fixture(name);
        let vocab = model.config.vocab_size;
        let shared = prompt(41, 56, vocab);
        let mut a = shared.clone();
        a.extend(prompt(42, 9, vocab));
        let mut b = shared;
        b.extend(prompt(43, 21, vocab));
        let cold = engine(&model, EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() });
        let want = run(&cold, &b, greedy(20));
        cold.shutdown();
        let warm = engine(&model, EngineConfig::default());
        run(&warm, &a, greedy(4));
        let before = warm.stats().prefix_cache_hits;
        let got = run(&warm, &b, greedy(20));
        // The 56 shared tokens fill 3 blocks of 16: all three hit.
        assert_eq!(warm.stats().prefix_cache_hits - before, 48, "{name}");
        assert_eq!(got, want, "{name}: a prefix-cache hit changed the tokens");
        assert_all_blocks_free(&warm);
        warm.shutdown();
    }
}

/// One prefill of `ids` then one decode step, through the runner (block size 16, block `i` of
/// the sequence in physical block `i`), with `poison(runner)` run between them; the decode
/// step's logits.
fn decode_after(model: &LoadedModel, ids: &[u32], poison: impl FnOnce(&mut ModelRunner<CpuBackend>)) -> Vec<f32> {
    let mut m = ModelRunner::load(&model.config, model.weights.as_ref(), CpuBackend::new()).expect("load");
    let bs = 16;
    let blocks = (ids.len() + 1).div_ceil(bs);
    m.alloc_kv_cache(blocks, bs).expect("kv");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let (prompt, last) = ids.split_at(ids.len() - 1);
    let step = |tokens: &[u32], start: usize| BatchLayout {
        tokens: tokens.to_vec(),
        positions: (start..start + tokens.len()).collect(),
        seqs: vec![SeqLayout { row_start: 0, n_tokens: tokens.len(), start_pos: start, block_table: table.clone() }],
        logit_rows: vec![tokens.len() - 1],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    m.forward(&step(prompt, 0)).expect("prefill");
    poison(&mut m);
    m.forward(&step(last, prompt.len())).expect("decode")
}

#[test]
fn kv_outside_every_sliding_window_is_never_read() {
    for name in FIXTURES {
        let model = fixture(name);
        let cfg = &model.config;
        let window = cfg.sliding_window.expect("windowed fixture");
        let sliding: Vec<usize> =
            (0..cfg.num_hidden_layers).filter(|&l| cfg.layer_types[l] == LayerType::Sliding).collect();
        // 50 tokens: the last query (position 49) sees positions 34..=49 in sliding layers, so
        // blocks 0 and 1 (positions 0..32) are out of their window; block 2 is partly in it.
        let ids = prompt(77, 50, cfg.vocab_size);
        assert!(ids.len() - 1 - window >= 32, "the test needs two blocks out of the window");
        let block_bytes = 16 * cfg.num_key_value_heads * cfg.head_dim * 4;
        let nan: Vec<u8> = f32::NAN.to_ne_bytes().repeat(block_bytes / 4 * 2);
        let poison = |blocks: &'static [u32]| {
            let sliding = sliding.clone();
            let nan = nan.clone();
            move |m: &mut ModelRunner<CpuBackend>| {
                let n = blocks.len() * block_bytes;
                for &l in &sliding {
                    m.write_kv_blocks(l, blocks, &nan[..n], &nan[..n]).expect("poison");
                }
            }
        };
        let clean = decode_after(&model, &ids, |_| {});
        assert!(clean.iter().all(|x| x.is_finite()), "{name}");
        let out_of_window = decode_after(&model, &ids, poison(&[0, 1]));
        assert_eq!(out_of_window, clean, "{name}: KV outside the window was read");
        let in_window = decode_after(&model, &ids, poison(&[2]));
        assert!(in_window.iter().any(|x| x.is_nan()), "{name}: poisoning KV inside the window changed nothing");
    }
}
